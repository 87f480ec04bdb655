"""Float32 matrices in ggml's summation order: a mixture of experts' router picks its experts
from these dot products, and a last-bit difference there can pick another expert.

- Decode (one token): ggml_vec_dot_f32. GGML_F32_STEP (4 vectors of `lanes`) fused
  multiply-adds per step, the 4 accumulators reduced lane-wise as (0 + 2) + (1 + 3), then
  across lanes (AVX2: 128-bit halves, then hadd twice; AVX-512: _mm512_reduce_add_ps), the
  tail (n % STEP) added one product at a time.
- Prompts (two tokens or more): llamafile's tinyBLAS sgemm, which ggml calls for F32 x F32
  with n >= 2: one vector accumulator of `lanes` per output over k, then its horizontal sum.
`lanes` is 16 where the CPU has AVX-512 (ggml's build for it), else 8. The kernels compile
with LLVM's `contract` only (no reassociation): a * b + c becomes one fused multiply-add, as
GGML_F32_VEC_FMA is, and every sum keeps the order written here; the lanes are independent
chains, so LLVM still vectorises them.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange
from numba.core.registry import cpu_target

from edgeinfer.kernels_cpu.ggml_math import hsum8
from edgeinfer.kernels_cpu.ir_helpers import target_features

_JIT = dict(cache=True, nogil=True, fastmath={"contract"})


@functools.cache
def host_lanes() -> int:
    """float32 lanes of ggml's vectors on this CPU: 16 with AVX-512, else 8."""
    return 16 if "+avx512f" in target_features(cpu_target.target_context) else 8


@njit(inline="always", **_JIT)
def _hsum(v, lanes):
    """The horizontal sum of one vector: _mm512_reduce_add_ps, or AVX's two halves then hadd."""
    if lanes == 16:
        h8 = np.empty(8, np.float32)
        for i in range(8):
            h8[i] = v[i] + v[i + 8]
        h4 = np.empty(4, np.float32)
        for i in range(4):
            h4[i] = h8[i] + h8[i + 4]
        return np.float32((h4[0] + h4[2]) + (h4[1] + h4[3]))
    t = np.empty(4, np.float32)
    for i in range(4):
        t[i] = v[i] + v[i + 4]
    return np.float32((t[0] + t[1]) + (t[2] + t[3]))


@njit(inline="always", **_JIT)
def _hsum_sgemm(v, lanes):
    """tinyBLAS's hsum: AVX-512's reduce, or AVX's (lo + hi), movehl, movehdup (ggml_math.hsum8)."""
    if lanes == 16:
        return _hsum(v, lanes)
    return hsum8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7])


@njit(parallel=True, **_JIT)
def vec_dot_rows(w, x, out, lanes):
    """out[r] = ggml_vec_dot_f32(w[r], x) for every row; w (n_rows, n) float32."""
    n = x.shape[0]
    step = 4 * lanes
    body = n - n % step
    for r in prange(w.shape[0]):
        acc = np.zeros(step, np.float32)  # accumulator j's lane l is acc[j * lanes + l]
        wr = w[r]
        for i in range(0, body, step):
            wi, xi = wr[i:i + step], x[i:i + step]
            for q in range(step):  # independent chains: vectorised, each one fma a step
                acc[q] += wi[q] * xi[q]
        red = np.empty(lanes, np.float32)
        for l in range(lanes):
            red[l] = (acc[l] + acc[2 * lanes + l]) + (acc[lanes + l] + acc[3 * lanes + l])
        s = _hsum(red, lanes)
        for k in range(body, n):
            s += wr[k] * x[k]
        out[r] = s


@njit(parallel=True, **_JIT)
def sgemm_rows(w, X, out, lanes):
    """out[t, r] = tinyBLAS's dot of w[r] and X[t] (n % lanes == 0); w (n_rows, n), X (n_tok, n)."""
    n = X.shape[1]
    for r in prange(w.shape[0]):
        acc = np.empty(lanes, np.float32)
        for t in range(X.shape[0]):
            for l in range(lanes):
                acc[l] = 0.0
            for i in range(0, n, lanes):
                for l in range(lanes):
                    acc[l] += w[r, i + l] * X[t, i + l]
            out[t, r] = _hsum_sgemm(acc, lanes)


def matvec(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    vec_dot_rows(w, x, out, host_lanes())
    return out


def matmul(w: np.ndarray, X: np.ndarray, out: np.ndarray) -> np.ndarray:
    """ggml's F32 x F32 product for two tokens or more: tinyBLAS where k is a multiple of its
    vector, else ggml's vec_dot per token (its fallback)."""
    lanes = host_lanes()
    if X.shape[1] % lanes == 0:
        sgemm_rows(w, X, out, lanes)
    else:
        for t in range(X.shape[0]):
            vec_dot_rows(w, X[t], out[t], lanes)
    return out
