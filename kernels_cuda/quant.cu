// Quantized matrix kernels that read GGUF blocks directly from VRAM.
//
//   matvec_<type>:  decode, y[t, r] = sum_c W[r, c] * x[t, c] (+ residual), one warp per row.
//   gemm_<type>:    prefill, Y = X W^T. Quantized types on the 8-bit tensor cores (sm_72+):
//                   weight chunks unpacked to int8, activations quantized to int8 as ggml's
//                   q8_1, int8 WMMA with int32 sums scaled per chunk (gemm_q8_impl, as
//                   ggml-cuda's MMQ); F32/F16 dequantized to fp16 tiles, fp16 WMMA with float
//                   accumulate (gemm_impl).
//
// Every type is read as "chunks" of 32 consecutive weights: a Q4_0/Q5_0/Q8_0 block is one
// chunk, a K-quant or i-quant super-block (256) is eight. `dequant32<T>` turns chunk c of a row into
// 32 floats, and both kernels are written once on top of it.
//
// Activations stay float32 in the matvec (not quantized to q8 as on the CPU): decode is
// bound by the weight bytes read from DRAM, the f32 FMAs are far below the GPU's compute
// limit, and f32 keeps the result as close to the numpy reference as possible.
//
// Block layouts (bytes) follow ggml / gguf.quants:
//   Q4_0 18: d f16 | qs[16]          Q4_1 20: d, m f16 | qs[16]
//   Q5_0 22: d | qh u32 | qs[16]      Q5_1 24: d, m | qh u32 | qs[16]
//   Q8_0 34: d | qs int8[32]
//   Q4_K 144: d, dmin | scales[12] | qs[128]
//   Q5_K 176: d, dmin | scales[12] | qh[32] | qs[128]
//   Q6_K 210: ql[128] | qh[64] | scales int8[16] | d
//   MXFP4 17: e E8M0 u8 | qs[16] (4-bit E2M1 codes into kvalues_mxfp4, the values doubled)
// The i-quants (ggml-common.h's block_iq*, 256 values; chunk c is sub-block c & 7, whose bytes
// are its own): values are entries of a lattice grid (iq_tables.cuh), signed, times scales.
//   IQ2_XXS 66: d | qs u16[32] (per chunk: 4 grid bytes | u32 of 4 x 7 sign bits, scale << 28)
//   IQ2_XS  74: d | qs u16[32] (9-bit grid | 7-bit sign index) | scales[8] (a nibble per 16)
//   IQ2_S   82: d | qs[32] grid low bytes | signs[32] | qh[8] (grid bits 8-9) | scales[8]
//   IQ3_XXS 98: d | qs[64] grid bytes | u32[8] (4 x 7 sign bits, scale << 28)
//   IQ3_S  110: d | qs[64] | qh[8] (grid bit 8) | signs[32] | scales[4] (a nibble per chunk)
//   IQ1_S   50: d | qs[32] | qh u16[8] (3 grid bits x 4, scale << 12, shift sign << 15)
//   IQ1_M   56: qs[32] | qh[16] (3 grid bits + shift sign per 8) | scales u16[4] (3 bits per
//               16 values; d as an fp16 in their top nibbles)
#include <cuda_fp16.h>
#include <stdint.h>
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
#include <mma.h>
#define EI_WMMA 1
#endif

// GGMLQuantizationType values
// host+device so a CPU-only harness can check the block layouts against gguf.quants
#define EI_HD __host__ __device__

#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ2_XXS 16
#define T_IQ2_XS 17
#define T_IQ3_XXS 18
#define T_IQ1_S 19
#define T_IQ3_S 21
#define T_IQ2_S 22
#define T_IQ1_M 29
#define T_MXFP4 39
#define EI_IQ(T) \
    (T == T_IQ2_XXS || T == T_IQ2_XS || T == T_IQ2_S || T == T_IQ3_XXS || T == T_IQ3_S || T == T_IQ1_S || T == T_IQ1_M)
// types whose chunk has a scale per 16 values (chunk_q8's d[0] != d[1]): the 8-bit GEMM
// multiplies the two halves separately
#define EI_TWO_SCALES(T) (T == T_Q6_K || T == T_IQ2_XS || T == T_IQ2_S || T == T_IQ1_M)

// The i-quants' grids and sign table, defined by kernels_cuda/generated.py from
// kernels_cpu/iq_tables.py (the one copy of those numbers): this include is replaced by the
// generated text wherever the source is compiled (see generated.py). Device data, read through
// L1 as ggml-cuda's tables; nvcc's host pass gets host arrays of the same names, which the
// EI_HD unpacking reads in the host-only test harness (and nothing else on the host).
#ifdef __CUDA_ARCH__
#define EI_IQ_TABLE(type, name, n) static const __device__ type name[n]
#else
#define EI_IQ_TABLE(type, name, n) static const type name[n]
#endif
#include "iq_tables.cuh"

EI_HD __forceinline__ float ld_f16(const uint8_t* p) {
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

EI_HD __forceinline__ uint32_t ld_u32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// ggml_e8m0_to_fp32_half: 2^(e-128), exact (the two denormals e < 2 included) wherever
// denormals are kept; ldexpf rather than a bit cast so that the host harness compiles it
EI_HD __forceinline__ float e8m0_half(uint8_t e) { return ldexpf(1.0f, (int)e - 128); }

// kvalues_mxfp4[code]: magnitudes 0,1,2,3,4,6,8,12 as nibbles of one constant (no table in
// local memory), bit 3 the sign
EI_HD __forceinline__ float e2m1_doubled(int code) {
    const int m = (int)((0xC8643210u >> (4 * (code & 7))) & 0xF);
    return (float)((code & 8) ? -m : m);   // an int: code 8 is +0, as ggml's table
}

// scale and min j (0..7) of a Q4_K / Q5_K super-block: 6-bit values packed into 12 bytes
EI_HD __forceinline__ void scale_min_k4(int j, const uint8_t* q, float* sc, float* mn) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *mn = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

EI_HD __forceinline__ unsigned ld_u16(const uint8_t* p) { return (unsigned)p[0] | ((unsigned)p[1] << 8); }

// 8 values of a 64-bit grid entry (a byte each, the first lowest), negated where bit j of
// `signs` is set: IQ2's grids (8, 25, 43)
EI_HD __forceinline__ void grid8_signed(uint64_t g, unsigned signs, int8_t* q) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int v = (int)((g >> (8 * j)) & 0xFF);
        q[j] = (int8_t)(((signs >> j) & 1) ? -v : v);
    }
}

// 4 values of a 32-bit grid entry, signs in bits 0..3: IQ3's grids
EI_HD __forceinline__ void grid4_signed(uint32_t g, unsigned signs, int8_t* q) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int v = (int)((g >> (8 * j)) & 0xFF);
        q[j] = (int8_t)(((signs >> j) & 1) ? -v : v);
    }
}

// IQ1: 8 values of iq1s_grid (bytes -1, 0, 1) with the shift -1/8 (neg) or +1/8, times 8, as
// integers 8 g +- 1 (the chunk's scale carries the 1/8): ggml's dl * (g + delta) exactly, as
// dl / 8 is exact and 8 (g + delta) an integer
EI_HD __forceinline__ void grid8_iq1(uint64_t g, bool neg, int8_t* q) {
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = (int8_t)(8 * (int)(int8_t)((g >> (8 * j)) & 0xFF) + (neg ? -1 : 1));
}

// Chunk c of a quantized row as 8-bit integers: weight i = d[i / 16] * q[i] + m, which the
// 8-bit GEMM multiplies with 8-bit activations on the tensor cores (T_F32 / T_F16 have none).
// Q6_K's, IQ2_XS's, IQ2_S's and IQ1_M's 16-value halves have a scale each (EI_TWO_SCALES);
// every other type one scale a chunk. An i-quant's q are its signed grid values and d[] the
// scale as ggml's dequantize_row_* computes it (same operations, same order: same bits).
template <int T>
EI_HD __forceinline__ void chunk_q8(const uint8_t* row, int c, int8_t* q, float* d, float* m) {
    *m = 0.0f;
    if (T == T_Q4_0 || T == T_Q4_1) {
        const uint8_t* b = row + c * (T == T_Q4_0 ? 18 : 20);
        d[0] = d[1] = ld_f16(b);
        if (T == T_Q4_1) *m = ld_f16(b + 2);
        const int off = T == T_Q4_0 ? 8 : 0;
        const uint8_t* qs = b + (T == T_Q4_0 ? 2 : 4);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            q[i] = (int8_t)((qs[i] & 0xF) - off);
            q[i + 16] = (int8_t)((qs[i] >> 4) - off);
        }
    } else if (T == T_Q5_0 || T == T_Q5_1) {
        const uint8_t* b = row + c * (T == T_Q5_0 ? 22 : 24);
        d[0] = d[1] = ld_f16(b);
        if (T == T_Q5_1) *m = ld_f16(b + 2);
        const int off = T == T_Q5_0 ? 16 : 0;
        const uint32_t qh = ld_u32(b + (T == T_Q5_0 ? 2 : 4));
        const uint8_t* qs = b + (T == T_Q5_0 ? 6 : 8);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            q[i] = (int8_t)(((qs[i] & 0xF) | (((qh >> i) & 1) << 4)) - off);
            q[i + 16] = (int8_t)(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - off);
        }
    } else if (T == T_Q8_0) {
        const uint8_t* b = row + c * 34;
        d[0] = d[1] = ld_f16(b);
#pragma unroll
        for (int i = 0; i < 32; ++i) q[i] = (int8_t)b[2 + i];
    } else if (T == T_Q4_K || T == T_Q5_K) {
        const int sub = c & 7;
        const uint8_t* b = row + (c >> 3) * (T == T_Q4_K ? 144 : 176);
        float sc, mn;
        scale_min_k4(sub, b + 4, &sc, &mn);
        d[0] = d[1] = ld_f16(b) * sc;
        *m = -(ld_f16(b + 2) * mn);
        const uint8_t* qs = b + (T == T_Q4_K ? 16 : 48) + 32 * (sub >> 1);
        const int shift = (sub & 1) * 4;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            int v = (qs[i] >> shift) & 0xF;
            if (T == T_Q5_K) v |= ((b[16 + i] >> sub) & 1) << 4;
            q[i] = (int8_t)v;
        }
    } else if (T == T_MXFP4) {
        const uint8_t* b = row + c * 17;
        d[0] = d[1] = e8m0_half(b[0]);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            q[i] = (int8_t)e2m1_doubled(b[1 + i] & 0xF);
            q[i + 16] = (int8_t)e2m1_doubled(b[1 + i] >> 4);
        }
    } else if (T == T_Q6_K) {
        const int sub = c & 7, half = sub >> 2, k = sub & 3;
        const uint8_t* b = row + (c >> 3) * 210;
        const float dd = ld_f16(b + 208);
        const uint8_t* ql = b + 64 * half + 32 * (k & 1);
        const uint8_t* qh = b + 128 + 32 * half;
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 2 * k;
        d[0] = dd * (float)sc[0];
        d[1] = dd * (float)sc[1];
        const int lshift = (k >> 1) * 4, hshift = 2 * k;
#pragma unroll
        for (int i = 0; i < 32; ++i) q[i] = (int8_t)((((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4)) - 32);
    } else if (T == T_IQ2_XXS) {
        const int ib = c & 7;
        const uint8_t* b = row + (c >> 3) * 66;
        const uint8_t* qs = b + 2 + 8 * ib;
        const uint32_t aux = ld_u32(qs + 4);
        d[0] = d[1] = ld_f16(b) * (0.5f + (float)(aux >> 28)) * 0.25f;
#pragma unroll
        for (int l = 0; l < 4; ++l) grid8_signed(iq2xxs_grid[qs[l]], ksigns_iq2xs[(aux >> (7 * l)) & 127], q + 8 * l);
    } else if (T == T_IQ2_XS) {
        const int ib = c & 7;
        const uint8_t* b = row + (c >> 3) * 74;
        const float dd = ld_f16(b);
        const unsigned sc = b[66 + ib];
        d[0] = dd * (0.5f + (float)(sc & 0xF)) * 0.25f;
        d[1] = dd * (0.5f + (float)(sc >> 4)) * 0.25f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const unsigned v = ld_u16(b + 2 + 8 * ib + 2 * l);
            grid8_signed(iq2xs_grid[v & 511], ksigns_iq2xs[v >> 9], q + 8 * l);
        }
    } else if (T == T_IQ2_S) {
        const int ib = c & 7;
        const uint8_t* b = row + (c >> 3) * 82;
        const float dd = ld_f16(b);
        const unsigned sc = b[74 + ib], qh = b[66 + ib];
        d[0] = dd * (0.5f + (float)(sc & 0xF)) * 0.25f;
        d[1] = dd * (0.5f + (float)(sc >> 4)) * 0.25f;
#pragma unroll
        for (int l = 0; l < 4; ++l)
            grid8_signed(iq2s_grid[b[2 + 4 * ib + l] | ((qh << (8 - 2 * l)) & 0x300)], b[34 + 4 * ib + l], q + 8 * l);
    } else if (T == T_IQ3_XXS) {
        const int ib = c & 7;
        const uint8_t* b = row + (c >> 3) * 98;
        const uint8_t* qs = b + 2 + 8 * ib;
        const uint32_t aux = ld_u32(b + 66 + 4 * ib);
        d[0] = d[1] = ld_f16(b) * (0.5f + (float)(aux >> 28)) * 0.5f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const unsigned signs = ksigns_iq2xs[(aux >> (7 * l)) & 127];
            grid4_signed(iq3xxs_grid[qs[2 * l]], signs, q + 8 * l);
            grid4_signed(iq3xxs_grid[qs[2 * l + 1]], signs >> 4, q + 8 * l + 4);
        }
    } else if (T == T_IQ3_S) {
        const int ib = c & 7;
        const uint8_t* b = row + (c >> 3) * 110;
        const uint8_t* qs = b + 2 + 8 * ib;
        const uint8_t* signs = b + 74 + 4 * ib;
        const unsigned qh = b[66 + ib];
        d[0] = d[1] = ld_f16(b) * (float)(1 + 2 * ((b[106 + (ib >> 1)] >> (4 * (ib & 1))) & 0xF));
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            grid4_signed(iq3s_grid[qs[2 * l] | ((qh << (8 - 2 * l)) & 256)], signs[l], q + 8 * l);
            grid4_signed(iq3s_grid[qs[2 * l + 1] | ((qh << (7 - 2 * l)) & 256)], signs[l] >> 4, q + 8 * l + 4);
        }
    } else if (T == T_IQ1_S) {
        const int ib = c & 7;
        const uint8_t* b = row + (c >> 3) * 50;
        const uint8_t* qs = b + 2 + 4 * ib;
        const unsigned qh = ld_u16(b + 34 + 2 * ib);
        d[0] = d[1] = ld_f16(b) * (float)(2 * ((qh >> 12) & 7) + 1) * 0.125f;
#pragma unroll
        for (int l = 0; l < 4; ++l) grid8_iq1(iq1s_grid[qs[l] | (((qh >> (3 * l)) & 7) << 8)], qh & 0x8000, q + 8 * l);
    } else if (T == T_IQ1_M) {
        const int ib = c & 7;
        const uint8_t* b = row + (c >> 3) * 56;
        const uint8_t* qs = b + 4 * ib;
        const unsigned qh0 = b[32 + 2 * ib], qh1 = b[33 + 2 * ib];
        const unsigned bits = (ld_u16(b + 48) >> 12) | ((ld_u16(b + 50) >> 8) & 0xF0) | ((ld_u16(b + 52) >> 4) & 0xF00)
                              | (ld_u16(b + 54) & 0xF000);
        const float dd = __half2float(__ushort_as_half((unsigned short)bits));
        const unsigned sc = ld_u16(b + 48 + 2 * (ib >> 1)) >> (6 * (ib & 1));
        d[0] = dd * (float)(2 * (sc & 7) + 1) * 0.125f;
        d[1] = dd * (float)(2 * ((sc >> 3) & 7) + 1) * 0.125f;
        grid8_iq1(iq1s_grid[qs[0] | ((qh0 << 8) & 0x700)], qh0 & 0x08, q);
        grid8_iq1(iq1s_grid[qs[1] | ((qh0 << 4) & 0x700)], qh0 & 0x80, q + 8);
        grid8_iq1(iq1s_grid[qs[2] | ((qh1 << 8) & 0x700)], qh1 & 0x08, q + 16);
        grid8_iq1(iq1s_grid[qs[3] | ((qh1 << 4) & 0x700)], qh1 & 0x80, q + 24);
    }
}

// Chunk c (32 consecutive weights) of one row -> y[0..31]. Q4_0 and Q5_0 add their offset
// as ggml's to_float does (d * q - 8 d); the other quantized types are d * q + m from the
// 8-bit GEMM's own unpacking (chunk_q8), the same expressions as their to_float; the
// i-quants d * q alone (no + 0: ggml's -0 stays -0).
template <int T>
EI_HD __forceinline__ void dequant32(const uint8_t* row, int c, float* y) {
    if (T == T_F32) {
        const float* p = reinterpret_cast<const float*>(row) + 32 * c;
#pragma unroll
        for (int i = 0; i < 32; ++i) y[i] = p[i];
    } else if (T == T_F16) {
        const __half* p = reinterpret_cast<const __half*>(row) + 32 * c;
#pragma unroll
        for (int i = 0; i < 32; ++i) y[i] = __half2float(p[i]);
    } else if (T == T_Q4_0) {
        const uint8_t* b = row + c * 18;
        const float d = ld_f16(b), m = -8.0f * d;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            y[i] = d * (float)(b[2 + i] & 0xF) + m;
            y[i + 16] = d * (float)(b[2 + i] >> 4) + m;
        }
    } else if (T == T_Q5_0) {
        const uint8_t* b = row + c * 22;
        const float d = ld_f16(b), m = -16.0f * d;
        const uint32_t qh = ld_u32(b + 2);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            y[i] = d * (float)((b[6 + i] & 0xF) | (((qh >> i) & 1) << 4)) + m;
            y[i + 16] = d * (float)((b[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) + m;
        }
    } else if (EI_IQ(T)) {
        int8_t q[32];
        float d[2], m;
        chunk_q8<T>(row, c, q, d, &m);
#pragma unroll
        for (int i = 0; i < 32; ++i) y[i] = d[i >> 4] * (float)q[i];
    } else {
        int8_t q[32];
        float d[2], m;
        chunk_q8<T>(row, c, q, d, &m);
#pragma unroll
        for (int i = 0; i < 32; ++i) y[i] = d[i >> 4] * (float)q[i] + m;
    }
}

#ifndef EI_HOST_ONLY  // the harness in tests/test_cuda_compile.py needs only dequant32
// ---------------------------------------------------------------------------------------
// decode: one warp per output row; lane l handles chunks l, l+32, ... of that row.
#define MV_WARPS 4

// One weight row . x, reduced over the warp (every lane gets the sum): lane l takes chunks
// l, l+32, ... The fused kernels below call it too, so they give the plain matvec's bits.
template <int T>
__device__ __forceinline__ float matvec_row(const uint8_t* __restrict__ w, int n_cols, const float* __restrict__ x,
                                            int lane) {
    const float4* xt = reinterpret_cast<const float4*>(x);
    float acc = 0.0f;
    for (int c = lane; c < n_cols / 32; c += 32) {
        float v[32];
        dequant32<T>(w, c, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float4 a = xt[c * 8 + i];
            acc += v[4 * i] * a.x + v[4 * i + 1] * a.y + v[4 * i + 2] * a.z + v[4 * i + 3] * a.w;
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    return acc;
}

// x, residual and y point at one token's row (the entries below pick the token).
template <int T>
__device__ __forceinline__ void matvec_impl(const uint8_t* __restrict__ W, long long row_bytes, int n_rows,
                                            int n_cols, const float* __restrict__ x,
                                            const float* __restrict__ residual, float* __restrict__ y) {
    const int row = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n_rows) return;
    const float acc = matvec_row<T>(W + row * row_bytes, n_cols, x, lane);
    if (lane == 0) y[row] = residual ? acc + residual[row] : acc;
}

// matvec_row of a weight type known at run time (uniform across the warp): the fused kernels
// take matrices of different types in one launch (a Q4_K_M file's Q6_K attn_v beside Q4_K Q/K).
__device__ __forceinline__ float matvec_row_any(int type, const uint8_t* w, int n_cols, const float* x, int lane) {
    switch (type) {
        case T_F32: return matvec_row<T_F32>(w, n_cols, x, lane);
        case T_F16: return matvec_row<T_F16>(w, n_cols, x, lane);
        case T_Q4_0: return matvec_row<T_Q4_0>(w, n_cols, x, lane);
        case T_Q4_1: return matvec_row<T_Q4_1>(w, n_cols, x, lane);
        case T_Q5_0: return matvec_row<T_Q5_0>(w, n_cols, x, lane);
        case T_Q5_1: return matvec_row<T_Q5_1>(w, n_cols, x, lane);
        case T_Q8_0: return matvec_row<T_Q8_0>(w, n_cols, x, lane);
        case T_Q4_K: return matvec_row<T_Q4_K>(w, n_cols, x, lane);
        case T_Q5_K: return matvec_row<T_Q5_K>(w, n_cols, x, lane);
        case T_Q6_K: return matvec_row<T_Q6_K>(w, n_cols, x, lane);
        case T_MXFP4: return matvec_row<T_MXFP4>(w, n_cols, x, lane);
        case T_IQ2_XXS: return matvec_row<T_IQ2_XXS>(w, n_cols, x, lane);
        case T_IQ2_XS: return matvec_row<T_IQ2_XS>(w, n_cols, x, lane);
        case T_IQ2_S: return matvec_row<T_IQ2_S>(w, n_cols, x, lane);
        case T_IQ3_XXS: return matvec_row<T_IQ3_XXS>(w, n_cols, x, lane);
        case T_IQ3_S: return matvec_row<T_IQ3_S>(w, n_cols, x, lane);
        case T_IQ1_S: return matvec_row<T_IQ1_S>(w, n_cols, x, lane);
        case T_IQ1_M: return matvec_row<T_IQ1_M>(w, n_cols, x, lane);
    }
    return 0.0f;
}

// Up to three matrices on the same input in one launch (Q, K and V): grid (row blocks over the
// rows of all three, tokens). A warp's row in the concatenation picks its matrix.
extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)
    matvec_many(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, long long rb0, long long rb1,
                long long rb2, int t0, int t1, int t2, int r0, int r1, int r2, int n_cols, const float* x,
                float* y0, float* y1, float* y2) {
    const long long tok = blockIdx.y;
    int row = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const uint8_t* W;
    long long rb;
    int t, nr;
    float* y;
    if (row < r0) {
        W = W0, rb = rb0, t = t0, nr = r0, y = y0;
    } else if ((row -= r0) < r1) {
        W = W1, rb = rb1, t = t1, nr = r1, y = y1;
    } else if ((row -= r1) < r2) {
        W = W2, rb = rb2, t = t2, nr = r2, y = y2;
    } else {
        return;
    }
    const float acc = matvec_row_any(t, W + row * rb, n_cols, x + tok * n_cols, lane);
    if (lane == 0) y[tok * nr + row] = acc;
}

// The activations of elementwise.cu's silu_mul and gelu_mul, expression for expression (the
// fused kernel gives the unfused launches' bits; tests/test_cuda_fused.py checks that).
__device__ __forceinline__ float glu_silu(float g) { return g / (1.0f + expf(-g)); }
__device__ __forceinline__ float glu_gelu(float g) {
    const float z = fminf(fmaxf(0.7978845608028654f * g * (1.0f + 0.044715f * g * g), -10.0f), 10.0f);
    const float t = 1.0f - 2.0f / (expf(2.0f * z) + 1.0f);
    return 0.5f * g * (1.0f + t);
}

// act(gate . x) * (up . x) for every row: a gated feed-forward's gate, up and activation in
// one launch (act 0: SiLU, 1: GELU tanh). Grid (row blocks, tokens).
extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)
    matvec_glu(const uint8_t* Wg, const uint8_t* Wu, long long rbg, long long rbu, int tg, int tu, int n_rows,
               int n_cols, const float* x, int act, float* y) {
    const long long tok = blockIdx.y;
    const int row = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n_rows) return;
    const float* xt = x + tok * n_cols;
    const float g = matvec_row_any(tg, Wg + row * rbg, n_cols, xt, lane);
    const float u = matvec_row_any(tu, Wu + row * rbu, n_cols, xt, lane);
    if (lane == 0) y[tok * n_rows + row] = (act ? glu_gelu(g) : glu_silu(g)) * u;
}

// ---------------------------------------------------------------------------------------
// prefill: 64 tokens x 64 weight rows per block, K step 32 (one chunk), 4 warps.
// Threads 0..63 dequantize one weight row's chunk each, threads 64..127 stage X; both as
// fp16 in shared memory. Each warp owns a 32x32 corner of the output = 2x2 WMMA tiles.
#define GM 64
#define GN 64
#define GK 32
#define GLD (GK + 8)  // +8 halfs: keeps rows 16-byte aligned and spreads shared-memory banks

template <int T>
__device__ __forceinline__ void gemm_impl(const uint8_t* __restrict__ W, long long row_bytes, int n_rows,
                                          int n_cols, const float* __restrict__ X, const int* __restrict__ xrow,
                                          int n_tok, const float* __restrict__ residual, float* __restrict__ Y) {
    __shared__ __align__(32) __half xs[GM * GLD];
    __shared__ __align__(32) __half ws[GN * GLD];
    __shared__ __align__(32) float cs[GM * GN];
    const int tid = threadIdx.x, warp = tid >> 5;
    const int m0 = blockIdx.y * GM, n0 = blockIdx.x * GN;
#ifdef EI_WMMA
    using namespace nvcuda;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
#else
    float accs[32];  // fallback: thread owns 32 outputs of the 64x64 tile
    for (int i = 0; i < 32; ++i) accs[i] = 0.0f;
#endif
    for (int k0 = 0; k0 < n_cols; k0 += GK) {
        if (tid < GN) {
            const int r = n0 + tid;
            float v[32];
            if (r < n_rows) {
                dequant32<T>(W + r * row_bytes, k0 / 32, v);
            } else {
#pragma unroll
                for (int i = 0; i < 32; ++i) v[i] = 0.0f;
            }
#pragma unroll
            for (int i = 0; i < 32; ++i) ws[tid * GLD + i] = __float2half(v[i]);
        } else {
            const int t = tid - GN;  // stages token row t of this K step
            const int m = m0 + t;
            const float* xr = m < n_tok ? X + (long long)(xrow ? xrow[m] : m) * n_cols + k0 : 0;
#pragma unroll 8
            for (int i = 0; i < 32; ++i) xs[t * GLD + i] = __float2half(xr ? xr[i] : 0.0f);
        }
        __syncthreads();
#ifdef EI_WMMA
        const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
#pragma unroll
        for (int kk = 0; kk < GK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], xs + (wm + 16 * i) * GLD + kk, GLD);
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], ws + (wn + 16 * j) * GLD + kk, GLD);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
#else
        for (int e = 0; e < 32; ++e) {
            const int idx = tid * 32 + e, mm = idx / GN, nn = idx % GN;
            float s = 0.0f;
            for (int kk = 0; kk < GK; ++kk) s += __half2float(xs[mm * GLD + kk]) * __half2float(ws[nn * GLD + kk]);
            accs[e] += s;
        }
#endif
        __syncthreads();
    }
#ifdef EI_WMMA
    {
        const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                wmma::store_matrix_sync(cs + (wm + 16 * i) * GN + wn + 16 * j, acc[i][j], GN, wmma::mem_row_major);
    }
#else
    for (int e = 0; e < 32; ++e) cs[tid * 32 + e] = accs[e];
#endif
    __syncthreads();
    for (int idx = tid; idx < GM * GN; idx += blockDim.x) {
        const int m = m0 + idx / GN, n = n0 + idx % GN;
        if (m < n_tok && n < n_rows) {
            const long long o = (long long)m * n_rows + n;
            Y[o] = residual ? cs[idx] + residual[o] : cs[idx];
        }
    }
}

// ---------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------
// prefill on the 8-bit tensor cores, as ggml-cuda's MMQ: each K step (one 32-value chunk)
// threads 0..63 unpack one weight row's chunk to int8 with its scale(s) and offset
// (chunk_q8), threads 64..127 quantize one token's 32 activations to int8 as ggml's q8_1
// does (d = max|x| / 127, q = round(x / d), with the block's float sum for the offsets). Each
// warp multiplies its 32x32 corner with int8 WMMA (int32 sums, exact), stores the sums to its
// own shared tile, and its lane l folds weight row l's 32 sums into float accumulators:
// acc += (d_w * d_x) * sum + m_w * sum_x. The two 16-value halves of the EI_TWO_SCALES types
// (Q6_K, IQ2_XS, IQ2_S, IQ1_M) have their own scales and are multiplied separately.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 720
#define EI_IMMA 1
#endif
#define QH 16  // an int8 tile is kept as its two 16-value halves of K, rows of 16 bytes: every
               // WMMA pointer (16 rows on) 32-byte aligned and ldm 16 bytes, as WMMA requires
#define CLD 32         // a warp's int32 tile: 32 tokens x 32 rows

template <int T>
__device__ __forceinline__ void gemm_q8_impl(const uint8_t* __restrict__ W, long long row_bytes, int n_rows,
                                             int n_cols, const float* __restrict__ X, const int* __restrict__ xrow,
                                             int n_tok, const float* __restrict__ residual, float* __restrict__ Y) {
#ifndef EI_IMMA
    gemm_impl<T>(W, row_bytes, n_rows, n_cols, X, xrow, n_tok, residual, Y);  // sm_70: no int8 WMMA
#else
    using namespace nvcuda;
    constexpr int HALVES = EI_TWO_SCALES(T) ? 2 : 1;
    __shared__ __align__(32) int8_t xq[2][GM * QH];
    __shared__ __align__(32) int8_t wq[2][GN * QH];
    __shared__ float x_d[GM], x_sum[GM], w_d[GN][2], w_m[GN];
    __shared__ __align__(32) int ci[4][32 * CLD];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int m0 = blockIdx.y * GM, n0 = blockIdx.x * GN;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;  // this warp's tokens and rows in the tile
    float acc[32];  // lane l: weight row wn + l, tokens wm .. wm + 31
#pragma unroll
    for (int t = 0; t < 32; ++t) acc[t] = 0.0f;
    for (int k0 = 0; k0 < n_cols; k0 += GK) {
        if (tid < GN) {
            const int r = n0 + tid;
            int8_t q[32];
            float d[2] = {0.0f, 0.0f}, m = 0.0f;
            if (r < n_rows) {
                chunk_q8<T>(W + r * row_bytes, k0 / 32, q, d, &m);
            } else {
#pragma unroll
                for (int i = 0; i < 32; ++i) q[i] = 0;
            }
#pragma unroll
            for (int i = 0; i < 32; ++i) wq[i >> 4][tid * QH + (i & 15)] = q[i];
            w_d[tid][0] = d[0];
            w_d[tid][1] = d[1];
            w_m[tid] = m;
        } else {
            const int t = tid - GN, mt = m0 + t;
            const float* xr = mt < n_tok ? X + (long long)(xrow ? xrow[mt] : mt) * n_cols + k0 : 0;
            float v[32], amax = 0.0f, sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                v[i] = xr ? xr[i] : 0.0f;
                amax = fmaxf(amax, fabsf(v[i]));
                sum += v[i];
            }
            const float d = amax / 127.0f;
#pragma unroll
            for (int i = 0; i < 32; ++i) xq[i >> 4][t * QH + (i & 15)] = (int8_t)(amax == 0.0f ? 0 : (int)roundf(v[i] / d));
            x_d[t] = d;
            x_sum[t] = sum;
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, int> c[2][2];
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) wmma::fill_fragment(c[i][j], 0);
#pragma unroll
            for (int kk = 16 * h; kk < (HALVES == 2 ? 16 * h + 16 : GK); kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, signed char, wmma::row_major> a[2];
                wmma::fragment<wmma::matrix_b, 16, 16, 16, signed char, wmma::col_major> b[2];
#pragma unroll
                for (int i = 0; i < 2; ++i)
                    wmma::load_matrix_sync(a[i], reinterpret_cast<const signed char*>(xq[kk / 16]) + (wm + 16 * i) * QH, QH);
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    wmma::load_matrix_sync(b[j], reinterpret_cast<const signed char*>(wq[kk / 16]) + (wn + 16 * j) * QH, QH);
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int j = 0; j < 2; ++j) wmma::mma_sync(c[i][j], a[i], b[j], c[i][j]);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    wmma::store_matrix_sync(ci[warp] + (16 * i) * CLD + 16 * j, c[i][j], CLD, wmma::mem_row_major);
            __syncwarp();
            const float wd = w_d[wn + lane][h], wmin = h == 0 ? w_m[wn + lane] : 0.0f;
#pragma unroll
            for (int t = 0; t < 32; ++t)
                acc[t] += (wd * x_d[wm + t]) * (float)ci[warp][t * CLD + lane] + wmin * x_sum[wm + t];
            __syncwarp();
        }
        __syncthreads();
    }
    const int n = n0 + wn + lane;
    if (n < n_rows) {
#pragma unroll
        for (int t = 0; t < 32; ++t) {
            const int m = m0 + wm + t;
            if (m < n_tok) {
                const long long o = (long long)m * n_rows + n;
                Y[o] = residual ? acc[t] + residual[o] : acc[t];
            }
        }
    }
#endif
}

// extern "C" entry points, found by name from Python: matvec_<type> and gemm_<type>.
//
// A mixture of experts' 3-D tensor (n_expert slabs of n_rows rows) runs through the same two
// kernels, one expert's slab per output row (matvec_id) or per group (gemm_id):
//   matvec_id: y[a] = W_{row_expert[a]} . x[xrow[a]]             grid (row blocks, assignments)
//   gemm_id:   rows starts[g]..starts[g+1] of Y are expert experts[g]'s tokens, X rows
//              xrow[starts[g]..]; grid (row tiles, token tiles of the largest group, groups)
#define EI_ENTRY(suffix, T, GEMM)                                                                    \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)                                      \
        matvec_##suffix(const uint8_t* W, long long row_bytes, int n_rows, int n_cols, const float* x, \
                        const float* residual, float* y) {                                           \
        const long long t = blockIdx.y;                                                              \
        matvec_impl<T>(W, row_bytes, n_rows, n_cols, x + t * n_cols, residual ? residual + t * n_rows : 0, \
                       y + t * n_rows);                                                              \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(128)                                                \
        gemm_##suffix(const uint8_t* W, long long row_bytes, int n_rows, int n_cols, const float* X,  \
                      int n_tok, const float* residual, float* Y) {                                  \
        GEMM<T>(W, row_bytes, n_rows, n_cols, X, 0, n_tok, residual, Y);                             \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)                                      \
        matvec_id_##suffix(const uint8_t* W, long long row_bytes, int n_rows, int n_cols, const float* x, \
                           const int* xrow, const int* row_expert, float* y) {                       \
        const int a = blockIdx.y;                                                                    \
        matvec_impl<T>(W + (long long)row_expert[a] * n_rows * row_bytes, row_bytes, n_rows, n_cols,  \
                       x + (long long)xrow[a] * n_cols, 0, y + (long long)a * n_rows);               \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(128)                                                \
        gemm_id_##suffix(const uint8_t* W, long long row_bytes, int n_rows, int n_cols, const float* X, \
                         const int* xrow, const int* experts, const int* starts, float* Y) {         \
        const int g = blockIdx.z, s0 = starts[g], n_tok = starts[g + 1] - s0;                        \
        if ((int)blockIdx.y * GM >= n_tok) return; /* a smaller group: the whole block idles */      \
        GEMM<T>(W + (long long)experts[g] * n_rows * row_bytes, row_bytes, n_rows, n_cols, X,        \
                     xrow + s0, n_tok, 0, Y + (long long)s0 * n_rows);                               \
    }

// float weights through the fp16 WMMA GEMM, quantized ones through the 8-bit one
EI_ENTRY(f32, T_F32, gemm_impl)
EI_ENTRY(f16, T_F16, gemm_impl)
EI_ENTRY(q4_0, T_Q4_0, gemm_q8_impl)
EI_ENTRY(q4_1, T_Q4_1, gemm_q8_impl)
EI_ENTRY(q5_0, T_Q5_0, gemm_q8_impl)
EI_ENTRY(q5_1, T_Q5_1, gemm_q8_impl)
EI_ENTRY(q8_0, T_Q8_0, gemm_q8_impl)
EI_ENTRY(q4_k, T_Q4_K, gemm_q8_impl)
EI_ENTRY(q5_k, T_Q5_K, gemm_q8_impl)
EI_ENTRY(q6_k, T_Q6_K, gemm_q8_impl)
EI_ENTRY(mxfp4, T_MXFP4, gemm_q8_impl)
EI_ENTRY(iq2_xxs, T_IQ2_XXS, gemm_q8_impl)
EI_ENTRY(iq2_xs, T_IQ2_XS, gemm_q8_impl)
EI_ENTRY(iq2_s, T_IQ2_S, gemm_q8_impl)
EI_ENTRY(iq3_xxs, T_IQ3_XXS, gemm_q8_impl)
EI_ENTRY(iq3_s, T_IQ3_S, gemm_q8_impl)
EI_ENTRY(iq1_s, T_IQ1_S, gemm_q8_impl)
EI_ENTRY(iq1_m, T_IQ1_M, gemm_q8_impl)

// A chunk-aligned dequantize of whole rows to float32 (tests and the CPU-side fallback).
#define EI_DEQ(suffix, T)                                                                            \
    extern "C" __global__ void dequant_##suffix(const uint8_t* W, long long row_bytes, int n_rows,   \
                                                int n_cols, float* out) {                            \
        const int n_chunks = n_cols / 32;                                                            \
        const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                        \
        if (i >= (long long)n_rows * n_chunks) return;                                               \
        const int r = (int)(i / n_chunks), c = (int)(i % n_chunks);                                  \
        float v[32];                                                                                 \
        dequant32<T>(W + r * row_bytes, c, v);                                                       \
        for (int k = 0; k < 32; ++k) out[(long long)r * n_cols + 32 * c + k] = v[k];                 \
    }

EI_DEQ(f32, T_F32)
EI_DEQ(f16, T_F16)
EI_DEQ(q4_0, T_Q4_0)
EI_DEQ(q4_1, T_Q4_1)
EI_DEQ(q5_0, T_Q5_0)
EI_DEQ(q5_1, T_Q5_1)
EI_DEQ(q8_0, T_Q8_0)
EI_DEQ(q4_k, T_Q4_K)
EI_DEQ(q5_k, T_Q5_K)
EI_DEQ(q6_k, T_Q6_K)
EI_DEQ(mxfp4, T_MXFP4)
EI_DEQ(iq2_xxs, T_IQ2_XXS)
EI_DEQ(iq2_xs, T_IQ2_XS)
EI_DEQ(iq2_s, T_IQ2_S)
EI_DEQ(iq3_xxs, T_IQ3_XXS)
EI_DEQ(iq3_s, T_IQ3_S)
EI_DEQ(iq1_s, T_IQ1_S)
EI_DEQ(iq1_m, T_IQ1_M)
#endif  // EI_HOST_ONLY
