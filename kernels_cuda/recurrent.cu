// Gated DeltaNet (qwen35's linear-attention layers) on float32 activations in VRAM; the
// numpy references are kernels_cpu/delta_net.py's.
//
//   gated_delta_net: the delta rule over n tokens, one warp per state row. Row j of a value
//                    head's transposed state M (M[j][i] = S[i][j]) only ever meets row j,
//                    k, q, v[j] and the token's scalars, so a warp keeps its row in
//                    registers (S/32 values a lane) across all the tokens:
//                      x = M[j] * exp(g);  delta = (v[j] - x . k) * beta
//                      M[j] = x + k * delta;  out[j] = (M[j] . q) / sqrt(S)
//                    writing the row back at the end and after each token count in
//                    snap_at (the snapshots a sequence keeps to be cut back to).
//                    Value head h reads key head h % n_k (tiled, as llama.cpp).
//   ssm_conv_silu:   the short causal conv over inp = window ++ x (taps first weights),
//                    then silu; one thread per (token, channel).
//   delta_gates:     beta = sigmoid(b), g = softplus(a + dt_bias) * ssm_a.
//   l2_norm_rows:    x / sqrt(sum(x^2) + eps * n) over rows (build_gdn_l2_norm).
//   sigmoid_mul:     x * sigmoid(gate) (the gated attention's output).
#include <stdint.h>

#define DN_MAX_PER_LANE 8  // S up to 256 (a multiple of 32)
#define DN_WARPS 4         // rows (warps) a block

__device__ __forceinline__ float dn_warp_sum(float s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

extern "C" __global__ void __launch_bounds__(32 * DN_WARPS)
gated_delta_net(const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,
                float* out, float* snaps, const int* snap_at, int n_snap, int n_tok, int n_k, int n_v, int S) {
    // grid (n_v, S / DN_WARPS), block (32 * DN_WARPS): warp w of block (h, b) owns row b * DN_WARPS + w
    const int h = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.y * DN_WARPS + (threadIdx.x >> 5);
    if (j >= S) return;
    const int kh = h % n_k;
    const int per = S / 32;
    const float scale = 1.0f / sqrtf((float)S);
    float* row = state + ((long long)h * S + j) * S;
    float m[DN_MAX_PER_LANE];
#pragma unroll
    for (int c = 0; c < DN_MAX_PER_LANE; ++c) m[c] = c < per ? row[c * 32 + lane] : 0.0f;
    int si = 0;
    for (int t = 0; t < n_tok; ++t) {
        const float* kt = k + ((long long)t * n_k + kh) * S;
        const float* qt = q + ((long long)t * n_k + kh) * S;
        const float eg = expf(g[(long long)t * n_v + h]);
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < DN_MAX_PER_LANE; ++c) {
            if (c < per) {
                m[c] *= eg;
                s += m[c] * kt[c * 32 + lane];
            }
        }
        s = dn_warp_sum(s);
        const float delta = (v[((long long)t * n_v + h) * S + j] - s) * beta[(long long)t * n_v + h];
        float o = 0.0f;
#pragma unroll
        for (int c = 0; c < DN_MAX_PER_LANE; ++c) {
            if (c < per) {
                m[c] += kt[c * 32 + lane] * delta;
                o += m[c] * qt[c * 32 + lane];
            }
        }
        o = dn_warp_sum(o);
        if (lane == 0) out[((long long)t * n_v + h) * S + j] = o * scale;
        if (si < n_snap && snap_at[si] == t + 1) {
            float* snap_row = snaps + (((long long)si * n_v + h) * S + j) * S;
#pragma unroll
            for (int c = 0; c < DN_MAX_PER_LANE; ++c)
                if (c < per) snap_row[c * 32 + lane] = m[c];
            ++si;
        }
    }
#pragma unroll
    for (int c = 0; c < DN_MAX_PER_LANE; ++c)
        if (c < per) row[c * 32 + lane] = m[c];
}

extern "C" __global__ void ssm_conv_silu(const float* inp, const float* w_t, float* out, int n_tok, int C, int K) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_tok * C) return;
    const int c = (int)(idx % C);
    const int t = (int)(idx / C);
    float a = 0.0f;
    for (int i = 0; i < K; ++i) a = fmaf(inp[(long long)(t + i) * C + c], w_t[(long long)i * C + c], a);
    out[idx] = a / (1.0f + expf(-a));
}

extern "C" __global__ void delta_gates(const float* b, const float* a, const float* dt_bias, const float* ssm_a,
                                       float* beta, float* g, int n_tok, int n_v) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_tok * n_v) return;
    const int h = (int)(idx % n_v);
    beta[idx] = 1.0f / (1.0f + expf(-b[idx]));
    const float x = a[idx] + dt_bias[h];
    const float soft = x > 20.0f ? x : logf(1.0f + expf(x));
    g[idx] = soft * ssm_a[h];
}

extern "C" __global__ void l2_norm_rows(const float* x, float* out, int n_rows, int n, float eps) {
    // one warp per row
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= n_rows) return;
    const float* xr = x + (long long)r * n;
    float s = 0.0f;
    for (int i = lane; i < n; i += 32) s += xr[i] * xr[i];
    s = dn_warp_sum(s);
    // ggml_rms_norm(x, eps / n) scaled by 1 / sqrt(n): x / sqrt(sum / n + eps / n) / sqrt(n)
    const float r_scale = rsqrtf(s / (float)n + eps / (float)n) * rsqrtf((float)n);
    float* yr = out + (long long)r * n;
    for (int i = lane; i < n; i += 32) yr[i] = xr[i] * r_scale;
}

extern "C" __global__ void sigmoid_mul(const float* x, const float* gate, float* out, long long n) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    out[idx] = x[idx] / (1.0f + expf(-gate[idx]));
}

extern "C" __global__ void qkv_split_norm(const float* xc, float* q, float* k, float* v, int n_tok, int n_k,
                                          int n_v, int S, float eps) {
    // the conv's output rows (n_tok, 2 n_k S + n_v S) -> q, k (n_tok, n_k, S) L2-normed per head
    // and v (n_tok, n_v, S); one warp per head row
    const int per_tok = 2 * n_k + n_v;
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= (long long)n_tok * per_tok) return;
    const int t = (int)(r / per_tok);
    const int j = (int)(r % per_tok);  // q heads, then k heads, then v heads
    const float* src = xc + (long long)t * per_tok * S + (long long)j * S;
    float* dst = j < n_k ? q + ((long long)t * n_k + j) * S
               : j < 2 * n_k ? k + ((long long)t * n_k + j - n_k) * S
               : v + ((long long)t * n_v + j - 2 * n_k) * S;
    float scale = 1.0f;
    if (j < 2 * n_k) {
        float s = 0.0f;
        for (int i = lane; i < S; i += 32) s += src[i] * src[i];
        s = dn_warp_sum(s);
        scale = rsqrtf(s / (float)S + eps / (float)S) * rsqrtf((float)S);
    }
    for (int i = lane; i < S; i += 32) dst[i] = src[i] * scale;
}
