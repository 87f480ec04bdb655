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
conv window (d_conv - 1, C); conv input x (n, C); conv weight (C, d_conv).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

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


def conv_silu_reference(window: np.ndarray, x: np.ndarray, w: np.ndarray, snap_at=(),
                        fma: bool = CONV_FMA) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml_ssm_conv then ggml_silu: out[t, c] = silu(sum_i inp[t + i, c] * w[c, i]) over
    inp = window ++ x. Returns (out (n, C), the new window (d_conv - 1, C), the windows
    after each token count in snap_at (len, d_conv - 1, C))."""
    x, w = _f32(x), _f32(w)
    n, K = x.shape[0], w.shape[1]
    inp = np.concatenate([_f32(window), x])
    acc = np.zeros_like(x)
    for i in range(K):
        prod = inp[i:i + n] * w[:, i]
        acc = _fma(inp[i:i + n], w[:, i], acc) if fma else (acc + prod).astype(np.float32)
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


@njit(error_model="numpy", **_JIT)
def _conv_silu_kernel(window, x, w, out, new_window, snap_at, snaps, fma, c0, c1):
    n = x.shape[0]
    K = w.shape[1]
    W = K - 1
    for c in range(c0, c1):
        for t in range(n):
            acc = np.float32(0.0)
            for i in range(K):
                r = t + i  # row of window ++ x
                s = window[r, c] if r < W else x[r - W, c]
                if fma:
                    acc = _fma32(s, w[c, i], acc)
                else:
                    acc = np.float32(acc + np.float32(s * w[c, i]))
            out[t, c] = np.float32(acc / np.float32(np.float32(1.0) + ggml_expf_any(-acc)))
        for r in range(W):  # the last d_conv - 1 rows of window ++ x
            rr = n + r
            new_window[r, c] = window[rr, c] if rr < W else x[rr - W, c]
        for si in range(snap_at.shape[0]):
            m = snap_at[si]
            for r in range(W):
                rr = m + r
                snaps[si, r, c] = window[rr, c] if rr < W else x[rr - W, c]


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


def conv_silu(window, x, w, snap_at=()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = np.ascontiguousarray(x, np.float32)
    window = np.ascontiguousarray(window, np.float32)
    w = np.ascontiguousarray(w, np.float32)
    snap = _snap_array(snap_at)
    out = np.empty_like(x)
    new_window = np.empty_like(window)
    snaps = np.empty((len(snap),) + window.shape, np.float32)
    C = x.shape[1]
    _run(_conv_silu_kernel, _pieces(C, x.size * w.shape[1]), window, x, w, out, new_window, snap, snaps, CONV_FMA)
    return out, new_window, snaps


def delta_rule(q, k, v, g, beta, state, snap_at=()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The recurrence; `state` (n_v, S, S) float32 C-contiguous is updated in place and returned."""
    q, k, v = (np.ascontiguousarray(a, np.float32) for a in (q, k, v))
    g, beta = np.ascontiguousarray(g, np.float32), np.ascontiguousarray(beta, np.float32)
    assert state.dtype == np.float32 and state.flags.c_contiguous
    snap = _snap_array(snap_at)
    n, n_v, S = v.shape
    out = np.empty((n, n_v, S), np.float32)
    snaps = np.empty((len(snap),) + state.shape, np.float32)
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
    def conv_silu(window, x, w, snap_at=()):
        return conv_silu_reference(window, x, w, snap_at)

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


def ops_for(backend_name: str):
    """The reference backend runs the numpy references; every other one the kernels."""
    return ReferenceOps if backend_name == "reference" else KernelOps
