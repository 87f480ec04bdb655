// Norms, RoPE, gated activations and adds on float32 activations in VRAM.
//
//   rms_norm:  out = x / sqrt(mean(x^2) + eps) * w (+ residual)   one block per row
//              (the weight multiply and gemma's "x + norm(h)" residual are fused in)
//   layer_norm: out = (x - mean) / sqrt(var + eps) * w + b, w and b optional (a vision encoder's norm)
//   pad_cols:  rows of n_cols copied into rows of n_pad, zeros after (a float matrix's input whose
//              width is no multiple of the GEMM's 32-value chunks, e.g. SigLIP's 4304)
//   rope:      rotary embedding of the first n_dims of every head; "norm" (adjacent pairs)
//              or "neox" (halves) mode; optional freq_factors (llama3 scaling) divide the
//              frequencies; base is passed per call (gemma's per-layer bases)
//   silu_mul / gelu_mul: act(gate) * up in one pass (no separate activation launch)
//   add, add_rows: residual add; bias add broadcast over rows
//   swiglu_oai: gpt-oss's clamped SwiGLU; add_id: per-expert bias rows;
//   moe_combine: a token's expert outputs weighted and summed in routing order
#include <cuda_fp16.h>
#include <stdint.h>

// The sum of every thread's s over the block (a multiple of 32 threads, up to 1024), returned to
// all of them; `partial` is free again on return, so a kernel can call it twice.
__device__ __forceinline__ float block_sum(float s, float* partial) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        s = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (threadIdx.x == 0) partial[0] = s;
    }
    __syncthreads();
    const float total = partial[0];
    __syncthreads();
    return total;
}

extern "C" __global__ void rms_norm(const float* x, const float* w, const float* residual, float* out, int n_cols,
                                    float eps) {
    // one block (up to 1024 threads, a multiple of 32) per row
    __shared__ float partial[32];
    const float* xr = x + (long long)blockIdx.x * n_cols;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) s += xr[i] * xr[i];
    const float r = rsqrtf(block_sum(s, partial) / (float)n_cols + eps);
    float* yr = out + (long long)blockIdx.x * n_cols;
    const float* rr = residual ? residual + (long long)blockIdx.x * n_cols : 0;
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) {
        const float y = xr[i] * r * w[i];
        yr[i] = rr ? rr[i] + y : y;
    }
}

extern "C" __global__ void layer_norm(const float* x, const float* w, const float* b, float* out, int n_cols,
                                      float eps) {
    // one block per row; the variance from x - mean (two passes, as ggml_norm), not E[x^2] - mean^2
    __shared__ float partial[32];
    const float* xr = x + (long long)blockIdx.x * n_cols;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s, partial) / (float)n_cols;
    float v = 0.0f;
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) {
        const float d = xr[i] - mean;
        v += d * d;
    }
    const float r = rsqrtf(block_sum(v, partial) / (float)n_cols + eps);
    float* yr = out + (long long)blockIdx.x * n_cols;
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) {
        float y = (xr[i] - mean) * r;
        if (w) y *= w[i];
        if (b) y += b[i];
        yr[i] = y;
    }
}

extern "C" __global__ void pad_cols(const float* x, float* out, long long n, int n_cols, int n_pad) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const int c = (int)(i % n_pad);
        out[i] = c < n_cols ? x[(i / n_pad) * n_cols + c] : 0.0f;
    }
}

#define ROPE_ARGS                                                                                      \
    int n_dims, float base, float freq_scale, int neox, const float *freq_factors, float ext_factor, float mscale, \
        float corr_low, float corr_high
#define ROPE_PASS n_dims, base, freq_scale, neox, freq_factors, ext_factor, mscale, corr_low, corr_high

// Pair idx of x's (token, head) rows (one thread per pair of output dims, hd/2 pairs a row):
// the two dims a, b of row `row` it gives and their values.
struct RopePair {
    long long row;
    int a, b;
    float ya, yb;
};

__device__ __forceinline__ RopePair rope_pair_values(const float* x, const int* positions, long long idx,
                                                     int n_heads, int hd, ROPE_ARGS) {
    const int pairs = hd / 2;
    const int i = (int)(idx % pairs);
    const long long row = idx / pairs;
    const int tok = (int)(row / n_heads);
    const float* xr = x + row * hd;
    int a, b;  // the two dims this thread writes
    const bool rotate = 2 * i < n_dims;
    if (neox) {
        const int half = n_dims / 2;
        if (rotate) { a = i; b = i + half; }
        else { a = n_dims + 2 * (i - half); b = a + 1; }
    } else {
        a = 2 * i; b = a + 1;
    }
    if (!rotate) return RopePair{row, a, b, xr[a], xr[b]};
    // theta in double, reduced mod 2 pi, then float sincos: float32 theta loses ~1e-3 rad
    // at positions ~1e5, double keeps long contexts matching the reference.
    double inv = pow((double)base, -2.0 * (double)i / (double)n_dims);
    if (freq_factors) inv /= (double)freq_factors[i];
    if (ext_factor != 0.0f) {  // YaRN: the interpolated and original angles mixed by a ramp over the pairs
        const float y = ((float)i - corr_low) / fmaxf(0.001f, corr_high - corr_low);
        const double mix = (double)((1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext_factor);
        inv = inv * (double)freq_scale * (1.0 - mix) + inv * mix;
    } else {
        inv *= (double)freq_scale;
    }
    double theta = fmod((double)positions[tok] * inv, 6.283185307179586);
    if (theta > 3.141592653589793) theta -= 6.283185307179586;  // [-pi, pi]: where fast sincos is accurate
    float s, c;
    sincosf((float)theta, &s, &c);
    if (ext_factor != 0.0f) { s *= mscale; c *= mscale; }
    const float x0 = xr[a], x1 = xr[b];
    return RopePair{row, a, b, x0 * c - x1 * s, x0 * s + x1 * c};
}

__device__ __forceinline__ void rope_pair_at(const float* x, float* out, const int* positions, long long idx,
                                             int n_heads, int hd, ROPE_ARGS) {
    const RopePair p = rope_pair_values(x, positions, idx, n_heads, hd, ROPE_PASS);
    out[p.row * hd + p.a] = p.ya;
    out[p.row * hd + p.b] = p.yb;
}

extern "C" __global__ void rope(const float* x, float* out, const int* positions, int n_tok, int n_heads, int hd,
                                ROPE_ARGS) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < (long long)n_tok * n_heads * (hd / 2)) rope_pair_at(x, out, positions, idx, n_heads, hd, ROPE_PASS);
}

// Q and K of one step in one launch (the same head size): the first n_tok * hq * hd/2 threads
// rotate q, the rest k, each exactly as `rope` does.
extern "C" __global__ void rope_qk(const float* q, float* q_out, const float* k, float* k_out, const int* positions,
                                   int n_tok, int hq, int hk, int hd, ROPE_ARGS) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x, nq = (long long)n_tok * hq * (hd / 2);
    if (idx < nq)
        rope_pair_at(q, q_out, positions, idx, hq, hd, ROPE_PASS);
    else if (idx - nq < (long long)n_tok * hk * (hd / 2))
        rope_pair_at(k, k_out, positions, idx - nq, hk, hd, ROPE_PASS);
}

// Cache row of (token, K/V head) row `row` of a step's K or V: its logical slot through the
// block table to the physical one (attention.cu's paged_row), times the heads.
__device__ __forceinline__ long long cache_row(const int* block_table, int block_size, const int* slots, int n_kv,
                                               long long row) {
    const int s = slots[row / n_kv];
    return ((long long)block_table[s / block_size] * block_size + s % block_size) * n_kv + row % n_kv;
}

// A step's Q roped, and its K roped and V written straight into their f16 cache rows (paged
// as attention.cu's kv_store: logical slot -> block_table[slot / bs] * bs + slot % bs): RoPE
// and the K/V store in one launch, each value as rope and kv_store give it. Threads: Q's pairs,
// then K's pairs, then V's values.
extern "C" __global__ void rope_qk_store(const float* q, float* q_out, const float* k, const float* v, __half* k_cache,
                                         __half* v_cache, const int* block_table, const int* slots,
                                         const int* positions, int n_tok, int hq, int hk, int hd, int hd_v,
                                         int block_size, ROPE_ARGS) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nq = (long long)n_tok * hq * (hd / 2), nk = (long long)n_tok * hk * (hd / 2);
    if (idx < nq) {
        rope_pair_at(q, q_out, positions, idx, hq, hd, ROPE_PASS);
    } else if (idx - nq < nk) {
        const RopePair p = rope_pair_values(k, positions, idx - nq, hk, hd, ROPE_PASS);
        const long long r = cache_row(block_table, block_size, slots, hk, p.row);
        k_cache[r * hd + p.a] = __float2half(p.ya);
        k_cache[r * hd + p.b] = __float2half(p.yb);
    } else if (idx - nq - nk < (long long)n_tok * hk * hd_v) {
        const long long e = idx - nq - nk;
        v_cache[cache_row(block_table, block_size, slots, hk, e / hd_v) * hd_v + e % hd_v] = __float2half(v[e]);
    }
}

extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// GELU, tanh approximation, as ggml_gelu. tanh(z) = 1 - 2 / (exp(2z) + 1): under --use_fast_math
// tanhf becomes tanh.approx.f32 (relative error 2^-11, far from the CPU's result), while expf
// stays within a few ulp. |z| <= 10 keeps exp finite; tanh(10) is 1.0f already.
__device__ __forceinline__ float gelu_tanh(float g) {
    const float z = fminf(fmaxf(0.7978845608028654f * g * (1.0f + 0.044715f * g * g), -10.0f), 10.0f);
    const float t = 1.0f - 2.0f / (expf(2.0f * z) + 1.0f);
    return 0.5f * g * (1.0f + t);
}

extern "C" __global__ void gelu_mul(const float* gate, const float* up, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gelu_tanh(gate[i]) * up[i];
}

extern "C" __global__ void gelu(const float* x, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gelu_tanh(x[i]);
}

extern "C" __global__ void mul(const float* a, const float* b, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * b[i];
}

extern "C" __global__ void mul_rows(const float* x, const float* row, float* out, long long n, int n_cols) {
    // x times one row broadcast over its rows (a per-feature scale)
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] * row[i % n_cols];
}

extern "C" __global__ void scale_rows(const float* x, const float* factors, float* out, long long n, int n_cols) {
    // each row of x times its own factor
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] * factors[i / n_cols];
}

extern "C" __global__ void scale(const float* x, float* out, long long n, float s) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] * s;
}

extern "C" __global__ void add(const float* a, const float* b, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

extern "C" __global__ void add_rows(float* x, const float* bias, long long n, int n_cols) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % n_cols];
}

extern "C" __global__ void swiglu_oai(const float* gate, const float* up, float* out, long long n, float alpha,
                                      float limit) {
    // as ggml_swiglu_oai: x = min(gate, limit), y = clamp(up, -limit, limit), x / (1 + exp(-alpha x)) * (y + 1)
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float x = fminf(gate[i], limit);
        const float y = fminf(fmaxf(up[i], -limit), limit);
        out[i] = x / (1.0f + expf(alpha * -x)) * (y + 1.0f);
    }
}

extern "C" __global__ void add_id(float* x, const float* bias, const int* ids, long long n, int n_cols) {
    // x[m, c] += bias[ids[m], c]: each grouped row gets its expert's bias row (ggml_add_id)
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[(long long)ids[i / n_cols] * n_cols + i % n_cols];
}

extern "C" __global__ void moe_combine(const float* y, const int* slot, const float* weights, float* out,
                                       long long n, int k, int n_cols) {
    // out[t, c] = sum over j < k, in order, of y[slot[t k + j], c] * weights[t k + j]: each product
    // rounded, then added slot by slot, as the CPU (and ggml's mul, then view adds) does
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long t = i / n_cols;
    const int c = (int)(i % n_cols);
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
        const long long a = t * k + j;
        const float term = y[(long long)slot[a] * n_cols + c] * weights[a];
        acc = j ? acc + term : term;
    }
    out[i] = acc;
}
