"""Gated DeltaNet (qwen35's linear-attention layers): the short causal conv, the gates and
the delta-rule recurrence, each as a numpy reference and a Numba kernel that computes the
same bits (tests/test_qwen35_kernels.py).

The order is llama.cpp's CPU one (ggml-cpu ops.cpp): llama.cpp builds qwen35 with its fused
`ggml_gated_delta_net` op on the CPU for prefill and decode alike, a token-by-token
recurrence. Per value head h (key head h % n_k, tiled) and token, with the state stored
transposed (M[j, i] = S[i, j]):

    M *= expf(g)                               libm expf, one float32 product per element
    delta[j] = (v[j] - dot(M[j], k)) * beta    ggml_vec_dot_f32: 32 lanes of fma, reduced
    M[j] += k * delta[j]                       ggml_vec_mad_f32: an fma per element
    out[j] = dot(M[j], q) * (1 / sqrtf(S))

`snap_at` (token counts 1..n within the chunk) asks for copies of the state after those
tokens: what a sequence keeps to be cut back to later (edgeinfer.kv.recurrent).

Shapes: q, k (n, n_k, S); v (n, n_v, S); g, beta (n, n_v); state (n_v, S, S);
conv window (d_conv - 1, C); conv input x (n, C); conv weight, taps first (d_conv, C).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .delta_net_ir import ROWS, fma32, rows_step
from .ggml_math import ggml_expf_any
from .threads import get_threads, worker_pool

_JIT = dict(cache=True, nogil=True)
# ggml_ssm_conv sums d_conv products in float32 as `sumf += s * c`; the oracle's build
# contracts that to an fma (tests/test_qwen35_kernels.py holds it to the oracle's ggml).
CONV_FMA = True


# -- numpy references ------------------------------------------------------------------------

def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _fma(a, b, c) -> np.ndarray:
    """float32 fma: the product of two float32 is exact in float64."""
    return (np.asarray(a, np.float64) * b + c).astype(np.float32)


def _expf(x) -> np.ndarray:
    from .libm import expf

    return expf(x)


def _logf(x) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _logf_kernel(x.reshape(-1), out.reshape(-1))
    return out


def dot32_reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f32 on AVX2 over the last axis (broadcast): 4 x 8 float32 lanes of fma over
    the multiples of 32, reduced as GGML_F32x8_REDUCE, the rest added in double."""
    a, b = np.broadcast_arrays(_f32(a), _f32(b))
    n = a.shape[-1]
    n32 = n - n % 32
    acc = np.zeros(a.shape[:-1] + (32,), np.float32)
    for c in range(0, n32, 32):
        acc = _fma(a[..., c:c + 32], b[..., c:c + 32], acc)
    s = acc.reshape(acc.shape[:-1] + (4, 8))
    x = (s[..., 0, :] + s[..., 2, :]) + (s[..., 1, :] + s[..., 3, :])
    t = x[..., :4] + x[..., 4:]
    total = ((t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])).astype(np.float64)
    for c in range(n32, n):
        total = total + (a[..., c] * b[..., c]).astype(np.float32).astype(np.float64)
    return total.astype(np.float32)


def gates_reference(beta_raw, alpha_raw, dt_bias, a) -> tuple[np.ndarray, np.ndarray]:
    """(beta, g) of (n, n_v) projections: beta = sigmoid(beta_raw) = 1 / (1 + expf(-x)),
    g = softplus(alpha_raw + dt_bias) * a (softplus x > 20 ? x : logf(1 + expf(x)); a holds
    -exp(A_log), as the file stores ssm_a)."""
    one = np.float32(1.0)
    beta = (one / (one + _expf(-_f32(beta_raw)))).astype(np.float32)
    x = (_f32(alpha_raw) + _f32(dt_bias)).astype(np.float32)
    with np.errstate(over="ignore"):
        soft = np.where(x > np.float32(20.0), x, _logf((one + _expf(x)).astype(np.float32)))
    return beta, (soft.astype(np.float32) * _f32(a)).astype(np.float32)


def sigmoid_reference(x) -> np.ndarray:
    """ggml_sigmoid: 1 / (1 + expf(-x)) with libm's expf."""
    one = np.float32(1.0)
    return (one / (one + _expf(-_f32(x)))).astype(np.float32)


def conv_silu_reference(window: np.ndarray, x: np.ndarray, w_t: np.ndarray, snap_at=(),
                        fma: bool = CONV_FMA) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml_ssm_conv then ggml_silu: out[t, c] = silu(sum_i inp[t + i, c] * w_t[i, c]) over
    inp = window ++ x; w_t is the file's (C, d_conv) weight transposed (conv_weight_t).
    Returns (out (n, C), the new window (d_conv - 1, C), the windows after each token count
    in snap_at (len, d_conv - 1, C))."""
    x, w_t = _f32(x), _f32(w_t)
    n, K = x.shape[0], w_t.shape[0]
    inp = np.concatenate([_f32(window), x])
    acc = np.zeros_like(x)
    for i in range(K):
        prod = inp[i:i + n] * w_t[i]
        acc = _fma(inp[i:i + n], w_t[i], acc) if fma else (acc + prod).astype(np.float32)
    with np.errstate(over="ignore"):
        out = (acc / (np.float32(1.0) + ggml_expf_any_np(-acc))).astype(np.float32)
    snaps = np.stack([inp[m:m + K - 1] for m in snap_at]) if len(snap_at) else np.zeros((0,) + window.shape,
                                                                                        np.float32)
    return out, inp[n:].copy(), snaps


def ggml_expf_any_np(x) -> np.ndarray:
    from edgeinfer.backends.base import ggml_expf_any

    return ggml_expf_any(x)


def l2_norm_reference(x: np.ndarray, eps: float) -> np.ndarray:
    """build_gdn_l2_norm: ggml_rms_norm(x, eps / n) (no weight) scaled by 1 / sqrtf(n), over
    the last axis."""
    x = _f32(x)
    n = np.float32(x.shape[-1])
    eps_n = np.float32(eps) / n
    sq = np.square(x, dtype=np.float32).astype(np.float64)
    mean = (np.cumsum(sq, axis=-1)[..., -1:] / x.shape[-1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt((mean + eps_n).astype(np.float32))
    return ((x * scale).astype(np.float32) * (np.float32(1.0) / np.sqrt(n))).astype(np.float32)


def delta_rule_reference(q, k, v, g, beta, state, snap_at=()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gated delta rule over n tokens (module docstring). Returns (out (n, n_v, S), the
    new state (n_v, S, S), the states after each token count in snap_at)."""
    q, k, v, g, beta = map(_f32, (q, k, v, g, beta))
    n, n_k, S = q.shape
    n_v = v.shape[1]
    kh = np.arange(n_v) % n_k
    scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(S)))
    M = _f32(state).copy()
    out = np.empty((n, n_v, S), np.float32)
    snaps = []
    want = set(int(m) for m in snap_at)
    for t in range(n):
        M = (M * _expf(g[t])[:, None, None]).astype(np.float32)
        kt, qt = k[t, kh], q[t, kh]  # (n_v, S)
        sums = dot32_reference(M, kt[:, None, :])  # (n_v, S): row j . k
        delta = ((v[t] - sums) * beta[t][:, None]).astype(np.float32)
        M = _fma(kt[:, None, :], delta[:, :, None], M)
        out[t] = (dot32_reference(M, qt[:, None, :]) * scale).astype(np.float32)
        if t + 1 in want:
            snaps.append(M.copy())
    snap_arr = np.stack([snaps[i] for i in range(len(snaps))]) if snaps else np.zeros((0,) + M.shape, np.float32)
    return out, M, snap_arr


# -- Numba kernels ---------------------------------------------------------------------------

@njit(**_JIT)
def _logf_kernel(x, out):
    for i in range(x.shape[0]):
        out[i] = math.log(x[i])  # float32 math.log lowers to the C library's logf


@njit(inline="always", **_JIT)
def _fma32(a, b, c):
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


@njit(inline="always", **_JIT)
def _dot32(a, b, S, lanes):
    """ggml_vec_dot_f32 (AVX2) of a[0:S] . b[0:S]; lanes: float32 scratch of 32."""
    for s in range(32):
        lanes[s] = np.float32(0.0)
    n32 = S - S % 32
    for c in range(0, n32, 32):
        for s in range(32):
            lanes[s] = _fma32(a[c + s], b[c + s], lanes[s])
    # per lane (s0 + s2) + (s1 + s3) (x[i] of 8 lanes), then lanes i and i + 4, then hadd twice
    x0 = np.float32(np.float32(lanes[0] + lanes[16]) + np.float32(lanes[8] + lanes[24]))
    x1 = np.float32(np.float32(lanes[1] + lanes[17]) + np.float32(lanes[9] + lanes[25]))
    x2 = np.float32(np.float32(lanes[2] + lanes[18]) + np.float32(lanes[10] + lanes[26]))
    x3 = np.float32(np.float32(lanes[3] + lanes[19]) + np.float32(lanes[11] + lanes[27]))
    x4 = np.float32(np.float32(lanes[4] + lanes[20]) + np.float32(lanes[12] + lanes[28]))
    x5 = np.float32(np.float32(lanes[5] + lanes[21]) + np.float32(lanes[13] + lanes[29]))
    x6 = np.float32(np.float32(lanes[6] + lanes[22]) + np.float32(lanes[14] + lanes[30]))
    x7 = np.float32(np.float32(lanes[7] + lanes[23]) + np.float32(lanes[15] + lanes[31]))
    h0 = np.float32(x0 + x4)
    h1 = np.float32(x1 + x5)
    h2 = np.float32(x2 + x6)
    h3 = np.float32(x3 + x7)
    total = np.float64(np.float32(np.float32(h0 + h1) + np.float32(h2 + h3)))
    for c in range(n32, S):
        total += np.float64(np.float32(a[c] * b[c]))
    return np.float32(total)


@njit(**_JIT)
def _delta_rule_kernel(q, k, v, g, beta, state, out, snap_at, snaps, h0, h1):
    n, n_k, S = q.shape
    scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(S)))
    lanes = np.empty(32, np.float32)
    delta = np.empty(S, np.float32)
    for h in range(h0, h1):
        kh = h % n_k
        M = state[h]
        si = 0
        for t in range(n):
            eg = np.float32(math.exp(g[t, h]))  # libm expf
            for j in range(S):
                for i in range(S):
                    M[j, i] = np.float32(M[j, i] * eg)
            kt = k[t, kh]
            qt = q[t, kh]
            b = beta[t, h]
            for j in range(S):
                delta[j] = np.float32(np.float32(v[t, h, j] - _dot32(M[j], kt, S, lanes)) * b)
            for j in range(S):
                d = delta[j]
                for i in range(S):
                    M[j, i] = _fma32(kt[i], d, M[j, i])
            for j in range(S):
                out[t, h, j] = np.float32(_dot32(M[j], qt, S, lanes) * scale)
            if si < snap_at.shape[0] and snap_at[si] == t + 1:
                snaps[si, h] = M
                si += 1


@njit(parallel=True, **_JIT)
def _delta_rule_rows_kernel(q, k, v, g, beta, state, out, snap_at, snaps, h0, h1):
    """_delta_rule_kernel's bits for S a multiple of 32, ROWS rows at a time in vector IR
    (kernels_cpu/delta_net_ir.py): a row stays in L1 across its four passes. Heads in one
    Numba parallel region (a decode step's 16 heads take ~60 us: a Python thread hand-off
    would cost more than the work)."""
    n, n_k, S = q.shape
    n_v = v.shape[1]
    scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(S)))
    chunks = S // 32
    qa, ka, va, oa, sa = q.ctypes.data, k.ctypes.data, v.ctypes.data, out.ctypes.data, state.ctypes.data
    for h in prange(h0, h1):
        kh = h % n_k
        m0 = sa + h * S * S * 4
        si = 0
        for t in range(n):
            eg = np.float32(math.exp(g[t, h]))  # libm expf
            kp = ka + (t * n_k + kh) * S * 4
            qp = qa + (t * n_k + kh) * S * 4
            row = (t * n_v + h) * S  # of v and out
            for j in range(0, S, ROWS):
                rows_step(m0 + j * S * 4, kp, qp, eg, va + (row + j) * 4, beta[t, h], scale, chunks,
                          oa + (row + j) * 4)
            if si < snap_at.shape[0] and snap_at[si] == t + 1:
                snaps[si, h] = state[h]
                si += 1


@njit(error_model="numpy", **_JIT)
def _conv_silu_kernel(inp, w_t, out, acc, c0, c1):
    """out[t, c] for channels c0..c1 of inp = window ++ x: an fma per tap in tap order
    (ggml_ssm_conv's `sumf += s * c`, contracted), then silu; channels innermost, one
    pass over a row per tap (measured: 4x faster than the taps innermost)."""
    K = w_t.shape[0]
    one = np.float32(1.0)
    for t in range(out.shape[0]):
        for c in range(c0, c1):
            acc[c] = np.float32(0.0)
        for i in range(K):
            src = inp[t + i]
            wi = w_t[i]
            for c in range(c0, c1):
                acc[c] = fma32(src[c], wi[c], acc[c])
        o = out[t]
        for c in range(c0, c1):
            a = acc[c]
            o[c] = np.float32(a / np.float32(one + ggml_expf_any(-a)))


@njit(**_JIT)
def _gates_kernel(beta_raw, alpha_raw, dt_bias, a, beta, g):
    one = np.float32(1.0)
    for t in range(beta_raw.shape[0]):
        for h in range(beta_raw.shape[1]):
            beta[t, h] = np.float32(one / np.float32(one + np.float32(math.exp(-beta_raw[t, h]))))
            x = np.float32(alpha_raw[t, h] + dt_bias[h])
            if x > np.float32(20.0):
                soft = x
            else:
                soft = np.float32(math.log(np.float32(one + np.float32(math.exp(x)))))
            g[t, h] = np.float32(soft * a[h])


@njit(**_JIT)
def _sigmoid_mul_kernel(x, gate, out):
    one = np.float32(1.0)
    for i in range(x.shape[0]):
        out[i] = np.float32(x[i] * np.float32(one / np.float32(one + np.float32(math.exp(-gate[i])))))


@njit(**_JIT)
def _l2_norm_kernel(x, eps_n, inv_sqrt_n, out):
    n = x.shape[1]
    for r in range(x.shape[0]):
        ss = 0.0
        for i in range(n):
            ss += np.float64(np.float32(x[r, i] * x[r, i]))
        mean = np.float32(ss / n)
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(mean + eps_n)))
        for i in range(n):
            out[r, i] = np.float32(np.float32(x[r, i] * scale) * inv_sqrt_n)


# -- entry points (what the family calls) ---------------------------------------------------

def _pieces(total: int, work: int) -> list[tuple[int, int]]:
    """Ranges of [0, total) for the worker threads when `work` is worth splitting."""
    n_threads = get_threads()
    if n_threads < 2 or total < 2 or work < (1 << 16):
        return [(0, total)]
    parts = min(n_threads, total)
    return [(i * total // parts, (i + 1) * total // parts) for i in range(parts)]


def _run(kernel, ranges, *args) -> None:
    if len(ranges) == 1:
        kernel(*args, *ranges[0])
        return
    list(worker_pool(len(ranges)).map(lambda r: kernel(*args, *r), ranges))


def gates(beta_raw, alpha_raw, dt_bias, a) -> tuple[np.ndarray, np.ndarray]:
    beta_raw, alpha_raw = np.ascontiguousarray(beta_raw, np.float32), np.ascontiguousarray(alpha_raw, np.float32)
    beta, g = np.empty_like(beta_raw), np.empty_like(beta_raw)
    _gates_kernel(beta_raw, alpha_raw, _f32(dt_bias), _f32(a), beta, g)
    return beta, g


def sigmoid_mul(x, gate) -> np.ndarray:
    """x * sigmoid(gate), elementwise (qwen35's gated attention output)."""
    x, gate = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(gate, np.float32)
    out = np.empty_like(x)
    _sigmoid_mul_kernel(x.reshape(-1), gate.reshape(-1), out.reshape(-1))
    return out


def l2_norm(x, eps: float) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = np.empty_like(rows)
    _l2_norm_kernel(rows, np.float32(np.float32(eps) / np.float32(n)),
                    np.float32(np.float32(1.0) / np.float32(math.sqrt(np.float32(n)))), out)
    return out.reshape(x.shape)


def _snap_array(snap_at) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(snap_at, dtype=np.int64).reshape(-1))


def conv_silu(window, x, w_t, snap_at=()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """conv_silu_reference's bits; w_t (d_conv, C) from conv_weight_t (the family caches it)."""
    x = np.ascontiguousarray(x, np.float32)
    window = np.ascontiguousarray(window, np.float32)
    w_t = np.ascontiguousarray(w_t, np.float32)
    W = window.shape[0]
    n, C = x.shape
    inp = np.concatenate([window, x])
    out = np.empty_like(x)
    _run(_conv_silu_kernel, _pieces(C, x.size * (W + 1)), inp, w_t, out, np.empty(C, np.float32))
    snaps = np.stack([inp[int(m):int(m) + W] for m in _snap_array(snap_at)]) if len(snap_at) else \
        np.zeros((0, W, C), np.float32)
    return out, inp[n:].copy(), snaps


def conv_weight_t(w) -> np.ndarray:
    """(C, d_conv) conv weights as the kernel reads them: (d_conv, C) float32, contiguous."""
    return np.ascontiguousarray(np.asarray(w, np.float32).T)


def delta_rule(q, k, v, g, beta, state, snap_at=()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The recurrence; `state` (n_v, S, S) float32 C-contiguous is updated in place and returned."""
    q, k, v = (np.ascontiguousarray(a, np.float32) for a in (q, k, v))
    g, beta = np.ascontiguousarray(g, np.float32), np.ascontiguousarray(beta, np.float32)
    assert state.dtype == np.float32 and state.flags.c_contiguous
    snap = _snap_array(snap_at)
    n, n_v, S = v.shape
    out = np.empty((n, n_v, S), np.float32)
    snaps = np.empty((len(snap),) + state.shape, np.float32)
    if S % 32 == 0:
        _delta_rule_rows_kernel(q, k, v, g, beta, state, out, snap, snaps, 0, n_v)
    else:
        _run(_delta_rule_kernel, _pieces(n_v, n * n_v * S * S), q, k, v, g, beta, state, out, snap, snaps)
    return out, state, snaps


class ReferenceOps:
    """The numpy references behind the same entry points (the reference backend uses them)."""

    @staticmethod
    def gates(beta_raw, alpha_raw, dt_bias, a):
        return gates_reference(beta_raw, alpha_raw, dt_bias, a)

    @staticmethod
    def sigmoid_mul(x, gate):
        return (_f32(x) * sigmoid_reference(gate)).astype(np.float32)

    @staticmethod
    def l2_norm(x, eps):
        return l2_norm_reference(x, eps)

    @staticmethod
    def conv_silu(window, x, w_t, snap_at=()):
        return conv_silu_reference(window, x, w_t, snap_at)

    @staticmethod
    def delta_rule(q, k, v, g, beta, state, snap_at=()):
        out, new, snaps = delta_rule_reference(q, k, v, g, beta, state, snap_at)
        state[...] = new
        return out, state, snaps


class KernelOps:
    """The Numba kernels (the CPU backend)."""

    gates = staticmethod(gates)
    sigmoid_mul = staticmethod(sigmoid_mul)
    l2_norm = staticmethod(l2_norm)
    conv_silu = staticmethod(conv_silu)
    delta_rule = staticmethod(delta_rule)


def run_layer(ops, state, i: int, qkv, b, a, dt_bias, ssm_a, w_t, eps: float, shape) -> np.ndarray:
    """One DeltaNet layer's recurrence on the host: gates, the short conv over the state's
    window, q/k L2-normed, the delta rule on the state; the state after the pass's snapshot
    points is handed to `state` (edgeinfer.kv.recurrent). qkv (n, conv_dim), b and a
    (n, n_v) are the layer's projections; returns (n, n_v, head_v_dim)."""
    n = qkv.shape[0]
    beta, g = ops.gates(b, a, dt_bias, ssm_a)
    snap_at = state.snap_at()
    xc, window, conv_snaps = ops.conv_silu(state.conv[i], qkv, w_t, snap_at)
    state.conv[i][...] = window
    kd = shape.key_dim
    q = ops.l2_norm(xc[:, :kd].reshape(n, shape.n_k_heads, shape.head_k_dim), eps)
    k = ops.l2_norm(xc[:, kd:2 * kd].reshape(n, shape.n_k_heads, shape.head_k_dim), eps)
    v = xc[:, 2 * kd:].reshape(n, shape.n_v_heads, shape.head_v_dim)
    out, _, ssm_snaps = ops.delta_rule(q, k, v, g, beta, state.ssm[i], snap_at)
    state.put_snapshots(i, conv_snaps, ssm_snaps)
    return out


def ops_for(backend_name: str):
    """The reference backend runs the numpy references; every other one the kernels."""
    return ReferenceOps if backend_name == "reference" else KernelOps
