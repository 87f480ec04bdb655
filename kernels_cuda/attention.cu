// Attention over a paged f16 K/V cache in VRAM.
//
// Cache layout (one layer): k_cache [n_phys_blocks, block_size, n_kv, hd] f16, v_cache the
// same with hd_v, kpos [n_phys_blocks * block_size] int32 (shared by the layers). Logical
// slot s of a sequence (its s-th token) lives in physical block block_table[s / block_size]
// at row s % block_size, i.e. physical slot p = block_table[s / bs] * bs + s % bs; kpos[p]
// is the position of the token there. Positions live with the blocks, so a block shared by
// several sequences (prefix cache, fork) carries its positions along. Masking is by
// position (causal: kpos <= qlim; sliding window: qpos - kpos < window), never by slot, so
// context shifts and reused prefix blocks need no special case. qlim is qpos itself for
// text; an image's rows (libmtmd's non-causal image batch) take their image's last
// position there, so each sees its whole image and the window still counts from its own. A contiguous cache is the
// special case block_size = n_ctx, block_table = {0} (then p = s).
//
//   kv_store:                f32 K/V of new tokens -> their slots (f16)
//   flash_attention_prefill: 8 queries of one head per block; K/V tiles of 32 keys staged
//                            in shared memory; online softmax; GQA by head // group.
//   flash_attention_tc_<HD>: the prefill on the fp16 tensor cores (sm_70+), head dims padded
//                            to HD = 64, 128 or 256: each warp owns 16 queries; per tile of 16
//                            keys S = Q K^T and O += P V by WMMA (f16 operands, f32 sums), the
//                            online softmax between them on S in shared memory, O in shared
//                            memory (rescaled by rows, which a fragment cannot be).
//   paged_decode_attention:  one (query, head) per block; 4 warps split the keys, each with
//                            its own online softmax, merged at the end (flash-decoding).
//   paged_decode_attention_wide: the same for head dims up to 512 (Gemma 4's global layers),
//                            for any number of queries: the prefill kernel's K/V tiles of
//                            512 would not fit a block's 48 KiB of shared memory.
//   *_q variants:            the same over a quantized cache (llama.cpp's --cache-type-k/-v):
//                            rows of raw ggml blocks (kernels_cuda/kv_quant.cu stores them),
//                            each value dequantized where it is read (kv_value), as
//                            ggml's to_float; the f16 side of a mixed pair is read as f16.
//                            Q comes rotated and the output goes back through hadamard_rows.
// q: (n_q, n_head, hd) f32, prescaled inside; out: (n_q, n_head, hd_v) f32. hd even, <= 256
// (<= 512 for the wide kernels).
#include <cuda_fp16.h>
#include <math_constants.h>
#include <limits.h>
#include <stdint.h>
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
#include <mma.h>
#define ATT_WMMA 1
#endif

#define MAX_HD 256       // the prefill kernel and paged_decode_attention
#define MAX_HD_WIDE 512  // paged_decode_attention_wide
#define PER_LANE (MAX_HD / 32)

// K/V types, as kernels_cuda/kv_quant.cu and launch.KV_TYPE_CODE name them
#define KV_F16 0
#define KV_Q8_0 1
#define KV_Q4_0 2
#define KV_Q4_1 3
#define KV_Q5_0 4
#define KV_Q5_1 5
#define KV_IQ4_NL 6

__constant__ float kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// an fp16 field (d, m) or an f16 value: at an even offset of a row of an even size (aligned)
__device__ __forceinline__ float half_at(const uint8_t* p) {
    return __half2float(*reinterpret_cast<const __half*>(p));
}

// Value d of a stored row: f16, or a quantized type's blocks read as ggml's to_float (q * d,
// or q * d + m with two roundings).
__device__ __forceinline__ float kv_value(const uint8_t* row, int type, int d) {
    const int j = d & 31;
    switch (type) {
        case KV_F16:
            return half_at(row + 2 * d);
        case KV_Q8_0: {
            const uint8_t* b = row + (d >> 5) * 34;
            return __fmul_rn((float)(int8_t)b[2 + j], half_at(b));
        }
        case KV_Q4_0: {
            const uint8_t* b = row + (d >> 5) * 18;
            const int c = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
            return __fmul_rn((float)(c - 8), half_at(b));
        }
        case KV_Q4_1: {
            const uint8_t* b = row + (d >> 5) * 20;
            const int c = j < 16 ? (b[4 + j] & 15) : (b[4 + j - 16] >> 4);
            return __fadd_rn(__fmul_rn((float)c, half_at(b)), half_at(b + 2));
        }
        case KV_Q5_0: {
            const uint8_t* b = row + (d >> 5) * 22;
            const int hi = (b[2 + (j >> 3)] >> (j & 7)) & 1;
            const int c = (j < 16 ? (b[6 + j] & 15) : (b[6 + j - 16] >> 4)) | (hi << 4);
            return __fmul_rn((float)(c - 16), half_at(b));
        }
        case KV_Q5_1: {
            const uint8_t* b = row + (d >> 5) * 24;
            const int hi = (b[4 + (j >> 3)] >> (j & 7)) & 1;
            const int c = (j < 16 ? (b[8 + j] & 15) : (b[8 + j - 16] >> 4)) | (hi << 4);
            return __fadd_rn(__fmul_rn((float)c, half_at(b)), half_at(b + 2));
        }
        default: {  // iq4_nl
            const uint8_t* b = row + (d >> 5) * 18;
            const int c = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
            return __fmul_rn(kIq4nlValues[c], half_at(b));
        }
    }
}

// One side (K or V) of a layer's cache: f16 values, or rows of a quantized type's blocks.
struct KvSide {
    const uint8_t* base;
    int type, row_bytes;
    __device__ __forceinline__ const uint8_t* row(long long r) const { return base + r * row_bytes; }
};

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Physical slot of logical slot `slot` (index into kpos and the cache's first two axes).
__device__ __forceinline__ long long paged_slot(const int* block_table, int block_size, int slot) {
    return (long long)block_table[slot / block_size] * block_size + slot % block_size;
}

__device__ __forceinline__ long long paged_row(const int* block_table, int block_size, int n_kv, int slot,
                                               int kvh) {
    return paged_slot(block_table, block_size, slot) * n_kv + kvh;  // times the head dim: element offset
}

__device__ __forceinline__ bool visible(int kp, int qp, int ql, int window) {
    return kp <= ql && (window <= 0 || qp - kp < window);
}

// One warp's running softmax state; lane owns output dims lane, lane+32, ... (NL of them)
template <int NL = PER_LANE>
struct Online {
    float m, l;
    float o[NL];
};

template <int NL>
__device__ __forceinline__ void online_init(Online<NL>& st) {
    st.m = -CUDART_INF_F;
    st.l = 0.0f;
#pragma unroll
    for (int i = 0; i < NL; ++i) st.o[i] = 0.0f;
}

// Fold one tile of up to 32 keys into st. Lane j scored key j (score = -inf when masked);
// vrow(j) gives key j's V row and vget(row, d) its value d. Returns without work when the
// whole tile is masked.
template <int NL, typename VRow, typename VGet>
__device__ __forceinline__ void online_update(Online<NL>& st, float score, int hd_v, VRow vrow, VGet vget) {
    const int lane = threadIdx.x & 31;
    const float tmax = warp_max(score);
    if (tmax == -CUDART_INF_F) return;
    const float m_new = fmaxf(st.m, tmax);
    const float corr = __expf(st.m - m_new);  // 0 on the first tile (m = -inf)
    const float p = score == -CUDART_INF_F ? 0.0f : __expf(score - m_new);
    st.l = st.l * corr + warp_sum(p);
#pragma unroll
    for (int i = 0; i < NL; ++i) st.o[i] *= corr;
    for (int j = 0; j < 32; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        if (pj == 0.0f) continue;  // warp-uniform: pj is a broadcast
        const auto v = vrow(j);
#pragma unroll
        for (int i = 0; i < NL; ++i) {
            const int d = lane + 32 * i;
            if (d < hd_v) st.o[i] += pj * vget(v, d);
        }
    }
    st.m = m_new;
}

// An attention sink (gpt-oss): one more logit in the softmax, with no value row.
template <int NL>
__device__ __forceinline__ void sink_fold(Online<NL>& st, float sink) {
    const float m_new = fmaxf(st.m, sink);
    const float corr = st.m == -CUDART_INF_F ? 0.0f : __expf(st.m - m_new);
    st.l = st.l * corr + __expf(sink - m_new);
#pragma unroll
    for (int i = 0; i < NL; ++i) st.o[i] *= corr;
    st.m = m_new;
}

extern "C" __global__ void kv_store(const float* k, const float* v, __half* k_cache, __half* v_cache,
                                    const int* block_table, const int* slots, int n_tok, int block_size,
                                    int n_kv, int hd, int hd_v) {
    // grid (n_tok, n_kv), threads over the head dims; slots are logical (token indices of the
    // sequence), mapped through its block table like the attention kernels' keys
    const int t = blockIdx.x, h = blockIdx.y;
    const long long row = paged_row(block_table, block_size, n_kv, slots[t], h);
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        k_cache[row * hd + d] = __float2half(k[((long long)t * n_kv + h) * hd + d]);
    for (int d = threadIdx.x; d < hd_v; d += blockDim.x)
        v_cache[row * hd_v + d] = __float2half(v[((long long)t * n_kv + h) * hd_v + d]);
}

extern "C" __global__ void kv_positions(int* kpos, const int* block_table, const int* step, int n_tok,
                                        int block_size) {
    // step = [n_keys, logical slot x n_tok, position x n_tok]: each new token's position into its
    // physical slot, inside the step (a CUDA graph replays it; no host copy per token)
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n_tok) kpos[paged_slot(block_table, block_size, step[1 + t])] = step[1 + n_tok + t];
}

#define FA_WARPS 8
#define FA_KEYS 32
#define FA_LD (MAX_HD + 2)  // +2 halfs: an odd word stride, so lane j reading row j hits distinct banks

template <bool QUANT>
__device__ __forceinline__ void flash_prefill(const float* q, KvSide kc, KvSide vc, const int* block_table,
                                              const int* kpos, const int* qpos, const int* qlim, float* out,
                                              int n_q, int n_keys,
                                              int block_size, int n_head, int n_kv, int hd, int hd_v, float scale,
                                              int window, const float* sinks) {
    const __half* k_cache = reinterpret_cast<const __half*>(kc.base);
    const __half* v_cache = reinterpret_cast<const __half*>(vc.base);
    __shared__ float qs[FA_WARPS][MAX_HD];
    __shared__ __half ks[FA_KEYS][FA_LD];
    __shared__ __half vs[FA_KEYS][FA_LD];
    __shared__ int kp_s[FA_KEYS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.y, kvh = head / (n_head / n_kv);
    const int qi = blockIdx.x * FA_WARPS + warp;
    const bool active = qi < n_q;
    const int qp = active ? qpos[qi] : 0, ql = active ? qlim[qi] : 0;
    for (int d = lane; d < hd; d += 32)
        qs[warp][d] = active ? q[((long long)qi * n_head + head) * hd + d] * scale : 0.0f;
    Online<> st;
    online_init(st);
    for (int base = 0; base < n_keys; base += FA_KEYS) {
        __syncthreads();  // previous tile fully consumed
        for (int idx = threadIdx.x; idx < FA_KEYS * MAX_HD; idx += blockDim.x) {
            const int j = idx / MAX_HD, d = idx % MAX_HD, s = base + j;
            if (s < n_keys) {
                const long long row = paged_row(block_table, block_size, n_kv, s, kvh);
                if (QUANT) {  // dequantized into the f16 tile
                    if (d < hd) ks[j][d] = __float2half(kv_value(kc.row(row), kc.type, d));
                    if (d < hd_v) vs[j][d] = __float2half(kv_value(vc.row(row), vc.type, d));
                } else {
                    if (d < hd) ks[j][d] = k_cache[row * hd + d];
                    if (d < hd_v) vs[j][d] = v_cache[row * hd_v + d];
                }
                if (d == 0) kp_s[j] = kpos[paged_slot(block_table, block_size, s)];
            } else if (d == 0) {
                kp_s[j] = INT_MAX;  // never visible
            }
        }
        __syncthreads();
        if (!active) continue;
        float score = -CUDART_INF_F;
        if (visible(kp_s[lane], qp, ql, window)) {
            float acc = 0.0f;
            for (int d = 0; d < hd; ++d) acc += qs[warp][d] * __half2float(ks[lane][d]);
            score = acc;
        }
        online_update(st, score, hd_v, [&](int j) { return &vs[j][0]; },
                      [](const __half* v, int d) { return __half2float(v[d]); });
    }
    if (!active) return;
    if (sinks) sink_fold(st, sinks[head]);
    const float inv = st.l > 0.0f ? 1.0f / st.l : 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < hd_v) out[((long long)qi * n_head + head) * hd_v + d] = st.o[i] * inv;
    }
}

// n_keys_p: the key count in VRAM (a step's input, so that a CUDA graph replays it)
#define FLASH_ARGS                                                                                              \
    const float *q, const int *block_table, const int *kpos, const int *qpos, const int *qlim, float *out,      \
        int n_q,                                                                                                \
        const int *n_keys_p, int block_size, int n_head, int n_kv, int hd, int hd_v, float scale, int window,   \
        const float *sinks

extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)
    flash_attention_prefill(const __half* k_cache, const __half* v_cache, FLASH_ARGS) {
    const KvSide kc{reinterpret_cast<const uint8_t*>(k_cache), KV_F16, 2 * hd};
    const KvSide vc{reinterpret_cast<const uint8_t*>(v_cache), KV_F16, 2 * hd_v};
    flash_prefill<false>(q, kc, vc, block_table, kpos, qpos, qlim, out, n_q, *n_keys_p, block_size, n_head, n_kv,
                         hd, hd_v, scale, window, sinks);
}

extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)
    flash_attention_prefill_q(const uint8_t* k_cache, const uint8_t* v_cache, int k_type, int v_type,
                              int k_row_bytes, int v_row_bytes, FLASH_ARGS) {
    const KvSide kc{k_cache, k_type, k_row_bytes}, vc{v_cache, v_type, v_row_bytes};
    flash_prefill<true>(q, kc, vc, block_table, kpos, qpos, qlim, out, n_q, *n_keys_p, block_size, n_head, n_kv,
                        hd, hd_v, scale, window, sinks);
}

#ifdef ATT_WMMA
#define TC_KEYS 16
#define TC_PLD 24  // the P tile's row stride in halfs (WMMA: a multiple of 8)

template <int HD, int WARPS, bool QUANT>
__device__ __forceinline__ void flash_tc(const float* q, KvSide kc, KvSide vc, const int* block_table,
                                         const int* kpos, const int* qpos, const int* qlim, float* out, int n_q,
                                         int n_keys,
                                         int block_size, int n_head, int n_kv, int hd, int hd_v, float scale,
                                         int window, const float* sinks) {
    using namespace nvcuda;
    constexpr int LD = HD + 8;  // halfs: 16-byte rows for WMMA, banks spread
    constexpr int BQ = 16 * WARPS;
    const __half* k_cache = reinterpret_cast<const __half*>(kc.base);
    const __half* v_cache = reinterpret_cast<const __half*>(vc.base);
    __shared__ __align__(32) __half qs[BQ * LD];
    __shared__ __align__(32) __half ks[TC_KEYS * LD];
    __shared__ __align__(32) __half vs[TC_KEYS * LD];
    __shared__ __align__(32) float os[WARPS][16 * HD];
    __shared__ __align__(32) float ss[WARPS][16 * 16];
    __shared__ __align__(32) __half ps[WARPS][16 * TC_PLD];
    __shared__ float m_s[WARPS][16], l_s[WARPS][16];
    __shared__ int kp_s[TC_KEYS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.y, kvh = head / (n_head / n_kv), q0 = blockIdx.x * BQ;
    for (int idx = threadIdx.x; idx < BQ * HD; idx += blockDim.x) {  // Q, scaled, as f16 (0 past hd, n_q)
        const int r = idx / HD, d = idx % HD, qi = q0 + r;
        qs[r * LD + d] = __float2half(qi < n_q && d < hd ? q[((long long)qi * n_head + head) * hd + d] * scale : 0.0f);
    }
    for (int idx = lane; idx < 16 * HD; idx += 32) os[warp][idx] = 0.0f;
    if (lane < 16) {
        m_s[warp][lane] = -CUDART_INF_F;
        l_s[warp][lane] = 0.0f;
    }
    const int row = lane >> 1, half = lane & 1;  // a pair of lanes a query row, 8 keys / HD/2 dims each
    const int qi = q0 + 16 * warp + row;
    const int qp = qi < n_q ? qpos[qi] : INT_MIN;  // an absent query sees no key
    const int ql = qi < n_q ? qlim[qi] : INT_MIN;
    for (int base = 0; base < n_keys; base += TC_KEYS) {
        __syncthreads();  // the previous tile consumed
        for (int idx = threadIdx.x; idx < TC_KEYS * HD; idx += blockDim.x) {
            const int j = idx / HD, d = idx % HD, s = base + j;
            float kv = 0.0f, vv = 0.0f;
            if (s < n_keys) {
                const long long r = paged_row(block_table, block_size, n_kv, s, kvh);
                if (QUANT) {
                    if (d < hd) kv = kv_value(kc.row(r), kc.type, d);
                    if (d < hd_v) vv = kv_value(vc.row(r), vc.type, d);
                } else {
                    if (d < hd) kv = __half2float(k_cache[r * hd + d]);
                    if (d < hd_v) vv = __half2float(v_cache[r * hd_v + d]);
                }
            }
            ks[j * LD + d] = __float2half(kv);
            vs[j * LD + d] = __float2half(vv);
            if (d == 0) kp_s[j] = s < n_keys ? kpos[paged_slot(block_table, block_size, s)] : INT_MAX;
        }
        __syncthreads();
        {  // S = Q K^T for this warp's 16 queries
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> sacc;
            wmma::fill_fragment(sacc, 0.0f);
#pragma unroll
            for (int d = 0; d < HD; d += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
                wmma::load_matrix_sync(a, qs + 16 * warp * LD + d, LD);
                wmma::load_matrix_sync(b, ks + d, LD);
                wmma::mma_sync(sacc, a, b, sacc);
            }
            wmma::store_matrix_sync(ss[warp], sacc, 16, wmma::mem_row_major);
        }
        __syncwarp();
        float sc[8], tmax = -CUDART_INF_F;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            const int col = 8 * half + c;
            sc[c] = visible(kp_s[col], qp, ql, window) ? ss[warp][row * 16 + col] : -CUDART_INF_F;
            tmax = fmaxf(tmax, sc[c]);
        }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        const float m_old = m_s[warp][row], m_new = fmaxf(m_old, tmax);
        const float corr = m_new == -CUDART_INF_F ? 1.0f : __expf(m_old - m_new);  // 0 after an empty start
        float psum = 0.0f;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            const float p = sc[c] == -CUDART_INF_F ? 0.0f : __expf(sc[c] - m_new);
            ps[warp][row * TC_PLD + 8 * half + c] = __float2half(p);
            psum += p;
        }
        psum += __shfl_xor_sync(0xffffffffu, psum, 1);
        for (int d = half * (HD / 2); d < (half + 1) * (HD / 2); ++d) os[warp][row * HD + d] *= corr;
        __syncwarp();  // every lane read m_s and rescaled O before they change
        if (half == 0) {
            l_s[warp][row] = l_s[warp][row] * corr + psum;
            m_s[warp][row] = m_new;
        }
        {  // O += P V
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> pa;
            wmma::load_matrix_sync(pa, ps[warp], TC_PLD);
#pragma unroll
            for (int d = 0; d < HD; d += 16) {
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> vb;
                wmma::load_matrix_sync(o, os[warp] + d, HD, wmma::mem_row_major);
                wmma::load_matrix_sync(vb, vs + d, LD);
                wmma::mma_sync(o, pa, vb, o);
                wmma::store_matrix_sync(os[warp] + d, o, HD, wmma::mem_row_major);
            }
        }
        __syncwarp();
    }
    if (qi >= n_q) return;
    float m = m_s[warp][row], l = l_s[warp][row], corr = 1.0f;
    if (sinks) {  // an attention sink joins the max and the sum, with no value
        const float s = sinks[head], m_new = fmaxf(m, s);
        corr = m == -CUDART_INF_F ? 0.0f : __expf(m - m_new);
        l = l * corr + __expf(s - m_new);
    }
    const float inv = l > 0.0f ? corr / l : 0.0f;
    for (int d = half * (HD / 2); d < (half + 1) * (HD / 2); ++d)
        if (d < hd_v) out[((long long)qi * n_head + head) * hd_v + d] = os[warp][row * HD + d] * inv;
}

#define TC_ENTRY(HD, WARPS)                                                                                     \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                   \
        flash_attention_tc_##HD(const __half* k_cache, const __half* v_cache, FLASH_ARGS) {                  \
        const KvSide kc{reinterpret_cast<const uint8_t*>(k_cache), KV_F16, 2 * hd};                         \
        const KvSide vc{reinterpret_cast<const uint8_t*>(v_cache), KV_F16, 2 * hd_v};                       \
        flash_tc<HD, WARPS, false>(q, kc, vc, block_table, kpos, qpos, qlim, out, n_q, *n_keys_p, block_size,    \
                                   n_head, n_kv, hd, hd_v, scale, window, sinks);                               \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                   \
        flash_attention_tc_q_##HD(const uint8_t* k_cache, const uint8_t* v_cache, int k_type, int v_type,      \
                                  int k_row_bytes, int v_row_bytes, FLASH_ARGS) {                               \
        const KvSide kc{k_cache, k_type, k_row_bytes}, vc{v_cache, v_type, v_row_bytes};                        \
        flash_tc<HD, WARPS, true>(q, kc, vc, block_table, kpos, qpos, qlim, out, n_q, *n_keys_p, block_size,     \
                                  n_head, n_kv, hd, hd_v, scale, window, sinks);                                \
    }

TC_ENTRY(64, 4)
TC_ENTRY(128, 2)
TC_ENTRY(256, 1)
#endif  // ATT_WMMA

#define DA_WARPS 4

template <int HD, bool QUANT>
__device__ __forceinline__ void decode_attention(const float* q, KvSide kc, KvSide vc, const int* block_table,
                                                 const int* kpos, const int* qpos, const int* qlim, float* out,
                                                 int n_keys,
                                                 int block_size, int n_head, int n_kv, int hd, int hd_v, float scale,
                                                 int window, const float* sinks) {
    const __half* k_cache = reinterpret_cast<const __half*>(kc.base);
    const __half* v_cache = reinterpret_cast<const __half*>(vc.base);
    constexpr int NL = HD / 32;
    __shared__ float qs[HD];
    __shared__ float m_s[DA_WARPS], l_s[DA_WARPS];
    __shared__ float o_s[DA_WARPS][HD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.x, qi = blockIdx.y, kvh = head / (n_head / n_kv);
    const int qp = qpos[qi], ql = qlim[qi];
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = q[((long long)qi * n_head + head) * hd + d] * scale;
    __syncthreads();
    Online<NL> st;
    online_init(st);
    for (int base = warp * 32; base < n_keys; base += 32 * DA_WARPS) {
        const int s = base + lane;
        float score = -CUDART_INF_F;
        if (s < n_keys && visible(kpos[paged_slot(block_table, block_size, s)], qp, ql, window)) {
            const long long row = paged_row(block_table, block_size, n_kv, s, kvh);
            float acc = 0.0f;
            if (QUANT) {
                const uint8_t* k = kc.row(row);
                for (int d = 0; d < hd; ++d) acc += qs[d] * kv_value(k, kc.type, d);
            } else {
                const __half2* k = reinterpret_cast<const __half2*>(k_cache + row * hd);
                for (int d = 0; d < hd / 2; ++d) {
                    const float2 kk = __half22float2(k[d]);
                    acc += qs[2 * d] * kk.x + qs[2 * d + 1] * kk.y;
                }
            }
            score = acc;
        }
        auto vrow = [&](int j) {
            const int sj = min(base + j, n_keys - 1);  // p_j = 0 for sj past the end, never read then
            return paged_row(block_table, block_size, n_kv, sj, kvh);
        };
        if (QUANT)
            online_update(st, score, hd_v, vrow, [&](long long r, int d) { return kv_value(vc.row(r), vc.type, d); });
        else
            online_update(st, score, hd_v, vrow, [&](long long r, int d) { return __half2float(v_cache[r * hd_v + d]); });
    }
    // merge the warps' partial softmaxes
    if (lane == 0) {
        m_s[warp] = st.m;
        l_s[warp] = st.l;
    }
#pragma unroll
    for (int i = 0; i < NL; ++i) {
        const int d = lane + 32 * i;
        if (d < hd_v) o_s[warp][d] = st.o[i];
    }
    __syncthreads();
    float m = sinks ? sinks[head] : -CUDART_INF_F;  // a sink joins the max and the sum, with no value
    for (int w = 0; w < DA_WARPS; ++w) m = fmaxf(m, m_s[w]);
    float l = sinks ? __expf(sinks[head] - m) : 0.0f;
    for (int w = 0; w < DA_WARPS; ++w) l += m_s[w] == -CUDART_INF_F ? 0.0f : l_s[w] * __expf(m_s[w] - m);
    for (int d = threadIdx.x; d < hd_v; d += blockDim.x) {
        float acc = 0.0f;
        for (int w = 0; w < DA_WARPS; ++w)
            if (m_s[w] != -CUDART_INF_F) acc += o_s[w][d] * __expf(m_s[w] - m);
        out[((long long)qi * n_head + head) * hd_v + d] = l > 0.0f ? acc / l : 0.0f;
    }
}

#define DECODE_ARGS FLASH_ARGS
#define DECODE_CALL(HD, QUANT)                                                                                   \
    decode_attention<HD, QUANT>(q, kc, vc, block_table, kpos, qpos, qlim, out, *n_keys_p, block_size, n_head, n_kv, \
                                hd, hd_v, scale, window, sinks)
#define F16_SIDES                                                                                                \
    const KvSide kc{reinterpret_cast<const uint8_t*>(k_cache), KV_F16, 2 * hd};                                 \
    const KvSide vc{reinterpret_cast<const uint8_t*>(v_cache), KV_F16, 2 * hd_v}
#define QUANT_PARAMS const uint8_t *k_cache, const uint8_t *v_cache, int k_type, int v_type, int k_row_bytes, int v_row_bytes
#define QUANT_SIDES const KvSide kc{k_cache, k_type, k_row_bytes}, vc{v_cache, v_type, v_row_bytes}

extern "C" __global__ void __launch_bounds__(DA_WARPS * 32)
    paged_decode_attention(const __half* k_cache, const __half* v_cache, DECODE_ARGS) {
    F16_SIDES;
    DECODE_CALL(MAX_HD, false);
}

extern "C" __global__ void __launch_bounds__(DA_WARPS * 32)
    paged_decode_attention_wide(const __half* k_cache, const __half* v_cache, DECODE_ARGS) {
    F16_SIDES;
    DECODE_CALL(MAX_HD_WIDE, false);
}

extern "C" __global__ void __launch_bounds__(DA_WARPS * 32) paged_decode_attention_q(QUANT_PARAMS, DECODE_ARGS) {
    QUANT_SIDES;
    DECODE_CALL(MAX_HD, true);
}

extern "C" __global__ void __launch_bounds__(DA_WARPS * 32)
    paged_decode_attention_q_wide(QUANT_PARAMS, DECODE_ARGS) {
    QUANT_SIDES;
    DECODE_CALL(MAX_HD_WIDE, true);
}
