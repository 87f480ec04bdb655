"""Float kernels around the matmuls: RMSNorm, rotary embedding, causal attention.

Semantics follow edgeinfer.backend.Backend's numpy ops (and llama.cpp): the numpy
references live in reference.py and tests/test_kernels_ops.py compares the two.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .threads import apply_threads

_JIT = dict(cache=True, nogil=True)
# reassociation lets LLVM vectorize float sums; no nnan/ninf: -inf and NaN must keep meaning
_FAST = {"reassoc", "contract"}
ROPE_MODES = {"normal": 0, "neox": 1}


@njit(parallel=True, **_JIT)
def _rms_norm_kernel(x, w, eps, out):
    n = x.shape[1]
    for i in prange(x.shape[0]):
        ss = 0.0
        for k in range(n):
            ss += np.float64(x[i, k]) * np.float64(x[i, k])
        scale = np.float32(1.0 / math.sqrt(ss / n + eps))
        for k in range(n):
            out[i, k] = x[i, k] * scale * w[k]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """x * w / sqrt(mean(x^2) + eps) over the last axis; x (..., n) f32, w (n,) f32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.shape != (x.shape[-1],):
        raise ValueError(f"weight shape {w.shape} does not match rows of {x.shape[-1]}")
    if out is None:
        out = np.empty_like(x)
    apply_threads()
    _rms_norm_kernel(x.reshape(-1, x.shape[-1]), w, float(eps), out.reshape(-1, x.shape[-1]))
    return out


@njit(parallel=True, **_JIT)
def _rope_kernel(x, positions, n_dims, inv_freq, neox):
    half = n_dims // 2
    for t in prange(x.shape[0]):
        for i in range(half):
            theta = np.float64(positions[t]) * inv_freq[i]
            c = np.float32(math.cos(theta))
            s = np.float32(math.sin(theta))
            ia = i if neox else 2 * i
            ib = i + half if neox else 2 * i + 1
            for h in range(x.shape[1]):
                a = x[t, h, ia]
                b = x[t, h, ib]
                x[t, h, ia] = a * c - b * s
                x[t, h, ib] = a * s + b * c


@njit(**_JIT)
def _rope_cache_kernel(positions, n_dims, base, freq_scale, ff, cos, sin):
    theta_scale = math.pow(np.float32(base), np.float32(-2.0) / np.float32(n_dims))  # powf
    for t in range(positions.shape[0]):
        theta = np.float32(positions[t])
        for i in range(n_dims // 2):
            th = np.float32(freq_scale * (theta / ff[i]))
            cos[t, i] = math.cos(th)  # float32 math.cos/sin call the C library's cosf/sinf
            sin[t, i] = math.sin(th)
            theta = np.float32(theta * theta_scale)


def rope_cache(positions, n_dims: int, base: float, freq_scale: float = 1.0,
               freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (n_pos, n_dims/2) float32 of every rotated pair, as ggml computes them:
    theta runs through float32 products by powf(base, -2/n_dims) from the position, and
    cosf/sinf of the C library (not correctly rounded, so float64 math differs in the
    last bit). Large positions lose accuracy exactly as llama.cpp's do."""
    positions = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    half = n_dims // 2
    ff = np.ones(half, np.float32) if freq_factors is None else np.ascontiguousarray(freq_factors, np.float32)
    cos = np.empty((positions.shape[0], half), np.float32)
    sin = np.empty_like(cos)
    _rope_cache_kernel(positions, int(n_dims), np.float32(base), np.float32(freq_scale), ff, cos, sin)
    return cos, sin


def rope_inv_freq(n_dims: int, freq_base: float, freq_scale: float = 1.0,
                  freq_factors: np.ndarray | None = None) -> np.ndarray:
    """theta_i / position for each rotated pair i: freq_scale * base^(-2i/n_dims) / factor_i (float64)."""
    inv = float(freq_base) ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, np.float64)
    return inv * float(freq_scale)


def rope_inplace(x: np.ndarray, positions, freq_base: float, mode: str = "normal", n_dims: int | None = None,
                 freq_scale: float = 1.0, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """Rotate the first n_dims (default: all) of each head in place; x (n_tok, n_heads, head_dim) f32.

    mode "normal": pairs (2i, 2i+1) (llama); "neox": pairs (i, i + n_dims/2) (qwen2, gemma3, neox).
    """
    if x.dtype != np.float32 or x.ndim != 3 or not x.flags.c_contiguous:
        raise ValueError("x must be a C-contiguous float32 (n_tok, n_heads, head_dim) array")
    n_dims = x.shape[2] if n_dims is None else int(n_dims)
    positions = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    if positions.shape[0] != x.shape[0]:
        raise ValueError(f"{positions.shape[0]} positions for {x.shape[0]} tokens")
    apply_threads()
    _rope_kernel(x, positions, n_dims, rope_inv_freq(n_dims, freq_base, freq_scale, freq_factors),
                 ROPE_MODES[mode] == 1)
    return x


@njit(parallel=True, fastmath=_FAST, **_JIT)
def _attention_kernel(q, k, v, kpos, qpos, scale, window, softcap, out):
    n_tok, n_head, hd = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    hdv = v.shape[2]
    for job in prange(n_tok * n_head):
        t = job // n_head
        h = job % n_head
        g = h // group
        o = out[t, h]
        o[:] = 0.0
        m = -np.inf
        lsum = np.float32(0.0)
        p_t = qpos[t]
        for s in range(k.shape[0]):
            if kpos[s] > p_t or (window > 0 and p_t - kpos[s] >= window):
                continue
            sc = np.float32(0.0)
            for d in range(hd):
                sc += q[t, h, d] * k[s, g, d]
            sc *= scale
            if softcap > 0:
                sc = softcap * np.tanh(sc / softcap)
            if sc > m:      # online softmax: rescale what was summed under the old maximum
                corr = np.float32(math.exp(m - sc)) if m > -np.inf else np.float32(0.0)
                lsum = lsum * corr + np.float32(1.0)
                for d in range(hdv):
                    o[d] = o[d] * corr + v[s, g, d]
                m = sc
            else:
                p = np.float32(math.exp(sc - m))
                lsum += p
                for d in range(hdv):
                    o[d] += p * v[s, g, d]
        if lsum > 0:
            inv = np.float32(1.0) / lsum
            for d in range(hdv):
                o[d] *= inv


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, kpos, qpos, scale: float, window: int = 0,
              softcap: float = 0.0, out: np.ndarray | None = None) -> np.ndarray:
    """Causal GQA attention with an online softmax -> (n_tok, n_head, hd_v) f32.

    q (n_tok, n_head, hd), k (S, n_kv_head, hd), v (S, n_kv_head, hd_v) float32 (the cache's
    layer_view), kpos (S,) positions of the cached keys, qpos (n_tok,) positions of the
    queries. A query at p sees keys with kpos <= p and, if window > 0, p - kpos < window.
    softcap > 0 applies softcap * tanh(score / softcap) (Gemma 2). A query that sees no
    key gets zeros.
    """
    q = np.ascontiguousarray(q, dtype=np.float32)
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"bad attention shapes q {q.shape} k {k.shape} v {v.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k.shape[1]} kv heads")
    kpos = np.ascontiguousarray(kpos, dtype=np.int64)
    qpos = np.ascontiguousarray(qpos, dtype=np.int64)
    if out is None:
        out = np.empty((q.shape[0], q.shape[1], v.shape[2]), np.float32)
    apply_threads()
    _attention_kernel(q, k, v, kpos, qpos, np.float32(scale), int(window), np.float32(softcap), out)
    return out
