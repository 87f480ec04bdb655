// Quantized K/V in VRAM: the store of new rows as ggml blocks, and the Hadamard rotation.
//
// A quantized K/V cache (llama.cpp's --cache-type-k/-v) keeps each head's row as raw ggml
// blocks of 32 values. The quantizers here are the ones edgeinfer's CPU store uses
// (kernels_cpu/kv_quant.py: ggml-cpu's from_float for each type) with every rounding spelled
// out (__fmul_rn, __fdiv_rn...): --use_fast_math would otherwise turn divisions approximate,
// and the stored bytes equal the CPU's for the same float rows.
//
// Before quantizing, rows are rotated as llama.cpp rotates them: each `rot`-value chunk by a
// Walsh-Hadamard transform scaled by 1/sqrt(rot) (kv_quant.fwht: scale first, then the
// butterflies u + v, u - v for len = 1, 2, 4, ...). Attention then rotates Q the same way
// (K's rotation) and its output back (V's): hadamard_rows.
//
//   kv_store_quant: f32 rows (n, n_kv, hd) of one side (K or V) -> their logical slots in a
//                   paged cache of that side's type (f16 values, or raw blocks).
//   hadamard_rows:  every `rot`-value chunk of x (rows, n) transformed; out of place.
// One warp per row; a row has at most 512 values.
#include <cuda_fp16.h>
#include <stdint.h>

#define KVQ_MAX 512

// the types: what kernels_cuda/launch.py's KV_TYPE_CODE names
#define KV_F16 0
#define KV_Q8_0 1
#define KV_Q4_0 2
#define KV_Q4_1 3
#define KV_Q5_0 4
#define KV_Q5_1 5
#define KV_IQ4_NL 6

__constant__ float kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// An fp16 field of a block (d, m) or an f16 value: always at an even byte offset of a row of
// an even size, so one aligned 16-bit store (two byte stores lost the low byte on an H200)
__device__ __forceinline__ void put_half(uint8_t* p, float x) {
    *reinterpret_cast<__half*>(p) = __float2half_rn(x);
}

__device__ __forceinline__ int block_bytes(int type) {
    switch (type) {
        case KV_Q8_0: return 34;
        case KV_Q4_1: return 20;
        case KV_Q5_0: return 22;
        case KV_Q5_1: return 24;
        default: return 18;  // q4_0, iq4_nl
    }
}

__device__ __forceinline__ float inv_or_zero(float d) { return d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f; }

// The value of largest magnitude (the first such), as ggml's `amax < fabsf(v)` scan.
__device__ __forceinline__ float signed_max(const float* x) {
    float amax = 0.0f, vmax = 0.0f;
    for (int j = 0; j < 32; ++j)
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            vmax = x[j];
        }
    return vmax;
}

__device__ __forceinline__ void put_nibbles(uint8_t* qs, const int* code) {
    for (int j = 0; j < 16; ++j) qs[j] = (uint8_t)((code[j] & 15) | ((code[j + 16] & 15) << 4));
}

__device__ __forceinline__ void put_qh(uint8_t* p, const int* code) {
    uint32_t qh = 0;
    for (int j = 0; j < 32; ++j) qh |= (uint32_t)((code[j] >> 4) & 1) << j;
    for (int b = 0; b < 4; ++b) p[b] = (uint8_t)(qh >> (8 * b));
}

// iq4_nl's nearest table value (ggml's best_index_int8: the upper one on a tie).
__device__ __forceinline__ int iq4nl_index(float al) {
    if (al <= kIq4nl[0]) return 0;
    if (al >= kIq4nl[15]) return 15;
    int mu = 1;
    while (mu < 15 && kIq4nl[mu] <= al) ++mu;
    return __fsub_rn(al, kIq4nl[mu - 1]) < __fsub_rn(kIq4nl[mu], al) ? mu - 1 : mu;
}

// One 32-value block x -> its bytes at `out`, as kernels_cpu/kv_quant.py's quantizers.
__device__ void quantize_block(const float* x, int type, uint8_t* out) {
    int code[32];
    if (type == KV_Q8_0) {  // AVX2 quantize_row_q8_0: id = 127 / amax, round half to even
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(x[j]));
        const float d = __fdiv_rn(amax, 127.0f);
        const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
        put_half(out, d);
        for (int j = 0; j < 32; ++j) out[2 + j] = (uint8_t)(int8_t)__float2int_rn(__fmul_rn(x[j], id));
    } else if (type == KV_Q4_0 || type == KV_Q5_0) {  // d = max / -8 (-16), code = trunc(x id + 8.5)
        const bool five = type == KV_Q5_0;
        const float d = __fdiv_rn(signed_max(x), five ? -16.0f : -8.0f);
        const float id = inv_or_zero(d);
        for (int j = 0; j < 32; ++j)
            code[j] = min(five ? 31 : 15, __float2int_rz(__fadd_rn(__fmul_rn(x[j], id), five ? 16.5f : 8.5f)));
        put_half(out, d);
        if (five) put_qh(out + 2, code);
        put_nibbles(out + (five ? 6 : 2), code);
    } else if (type == KV_Q4_1 || type == KV_Q5_1) {  // d = (max - min) / 15 (31), m = min
        const bool five = type == KV_Q5_1;
        float mn = x[0], mx = x[0];
        for (int j = 1; j < 32; ++j) {
            mn = fminf(mn, x[j]);
            mx = fmaxf(mx, x[j]);
        }
        const float d = __fdiv_rn(__fsub_rn(mx, mn), five ? 31.0f : 15.0f);
        const float id = inv_or_zero(d);
        for (int j = 0; j < 32; ++j) {
            const int c = __float2int_rz(__fadd_rn(__fmul_rn(__fsub_rn(x[j], mn), id), 0.5f));
            code[j] = five ? c : min(15, c);
        }
        put_half(out, d);
        put_half(out + 2, mn);
        if (five) put_qh(out + 4, code);
        put_nibbles(out + (five ? 8 : 4), code);
    } else {  // iq4_nl: quantize_row_iq4_nl_ref, no scale search
        const float vmax = signed_max(x);
        const bool live = fabsf(vmax) >= 1e-15f;
        const float id = inv_or_zero(live ? __fdiv_rn(vmax, -127.0f) : 0.0f);
        float sumqx = 0.0f, sumq2 = 0.0f;
        for (int j = 0; j < 32; ++j) {
            code[j] = iq4nl_index(__fmul_rn(id, x[j]));
            const float q = kIq4nl[code[j]];
            const float wq = __fmul_rn(__fmul_rn(x[j], x[j]), q);
            sumqx = __fadd_rn(sumqx, __fmul_rn(wq, x[j]));
            sumq2 = __fadd_rn(sumq2, __fmul_rn(wq, q));
        }
        const float d = live && sumq2 > 0.0f ? __fdiv_rn(sumqx, sumq2) : 0.0f;
        if (!live)
            for (int j = 0; j < 32; ++j) code[j] = 0;
        put_half(out, d);
        put_nibbles(out + 2, code);
    }
}

// x[0..n) in shared memory: each `rot`-chunk Walsh-Hadamard transformed by the warp.
__device__ void fwht_chunks(float* x, int n, int rot) {
    const int lane = threadIdx.x & 31;
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn((float)rot));
    for (int i = lane; i < n; i += 32) x[i] = __fmul_rn(x[i], scale);
    __syncwarp();
    for (int len = 1; len < rot; len <<= 1) {
        for (int p = lane; p < n / 2; p += 32) {  // pair p: within its chunk, element i and i + len
            const int chunk = p / (rot / 2), k = p % (rot / 2);
            const int i = chunk * rot + (k / len) * 2 * len + k % len;
            const float u = x[i], v = x[i + len];
            x[i] = __fadd_rn(u, v);
            x[i + len] = __fsub_rn(u, v);
        }
        __syncwarp();
    }
}

extern "C" __global__ void __launch_bounds__(32)
    kv_store_quant(const float* x, uint8_t* cache, const int* block_table, const int* slots, int n_tok,
                   int block_size, int n_kv, int hd, int row_bytes, int type, int rot) {
    // grid (n_tok, n_kv), one warp: the row of token t, head h, into its logical slot's block
    __shared__ float buf[KVQ_MAX];
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const float* src = x + ((long long)t * n_kv + h) * hd;
    for (int i = lane; i < hd; i += 32) buf[i] = src[i];
    __syncwarp();
    const int s = slots[t];
    const long long row = ((long long)block_table[s / block_size] * block_size + s % block_size) * n_kv + h;
    uint8_t* dst = cache + row * row_bytes;
    if (type == KV_F16) {
        for (int i = lane; i < hd; i += 32) put_half(dst + 2 * i, buf[i]);
        return;
    }
    if (rot > 0) fwht_chunks(buf, hd, rot);
    const int bb = block_bytes(type);
    for (int b = lane; b < hd / 32; b += 32) quantize_block(buf + 32 * b, type, dst + b * bb);
}

extern "C" __global__ void __launch_bounds__(32) hadamard_rows(const float* x, float* out, int n, int rot) {
    // grid (rows): row r of x (n values) -> out, every `rot`-chunk transformed
    __shared__ float buf[KVQ_MAX];
    const long long r = blockIdx.x;
    for (int i = threadIdx.x; i < n; i += 32) buf[i] = x[r * n + i];
    __syncwarp();
    fwht_chunks(buf, n, rot);
    for (int i = threadIdx.x; i < n; i += 32) out[r * n + i] = buf[i];
}
