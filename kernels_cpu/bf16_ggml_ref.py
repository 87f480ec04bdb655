"""numpy reference of bf16_ggml: ggml's BF16 products for each llama.cpp build, one float op
at a time (a vdpbf16ps lane as Intel documents it)."""
from __future__ import annotations

import numpy as np

F = np.float32


def to_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16 on an array: round to nearest even, a NaN made quiet."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r[nan] = ((u[nan] >> 16) | 64).astype(np.uint16)
    return r


def widen(u: np.ndarray) -> np.ndarray:
    """BF16 bits -> float32 values (exact)."""
    return (np.asarray(u, np.uint16).astype(np.uint32) << 16).view(np.float32)


def dpbf16(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One vdpbf16ps: acc (16,) float32; a, b (32,) BF16 bits. Lane i adds the product of
    its odd pair, rounds, then that of its even pair (products exact in float32)."""
    pa, pb = widen(a).reshape(16, 2), widen(b).reshape(16, 2)
    acc = (acc + pa[:, 1] * pb[:, 1]).astype(F)
    return (acc + pa[:, 0] * pb[:, 0]).astype(F)


def hsum16(v: np.ndarray) -> F:
    """_mm512_reduce_add_ps: the 256-bit halves, the 128-bit ones, then (0 + 2) + (1 + 3)."""
    h = (v[:8] + v[8:]).astype(F)
    h = (h[:4] + h[4:]).astype(F)
    return F(F(h[0] + h[2]) + F(h[1] + h[3]))


def hsum8(v: np.ndarray) -> F:
    """AVX's hi + lo, movehl, movehdup."""
    t = (v[:4] + v[4:]).astype(F)
    return F(F(t[0] + t[2]) + F(t[1] + t[3]))


def _fma(a, b, c):
    return (a.astype(np.float64) * b + c).astype(F)   # a * b exact in double: one rounding


def vec_dot(w: np.ndarray, xb: np.ndarray, build: str) -> F:
    """ggml_vec_dot_bf16(w, xb) (both BF16 bits) on `build` ("bf16", "avx512" or "avx2")."""
    n = len(xb)
    step = 64 if build == "bf16" else 32
    body = n - n % step
    wf, xf = widen(w), widen(xb)
    if build == "bf16":
        c = [np.zeros(16, F), np.zeros(16, F)]
        for i in range(0, body, 64):
            for j in range(2):
                c[j] = dpbf16(c[j], w[i + 32 * j:i + 32 * j + 32], xb[i + 32 * j:i + 32 * j + 32])
        s = float(hsum16(c[0])) + float(hsum16(c[1]))
    elif build == "avx512":
        c = [np.zeros(16, F), np.zeros(16, F)]
        for i in range(0, body, 32):
            for j in range(2):
                c[j] = _fma(wf[i + 16 * j:i + 16 * j + 16], xf[i + 16 * j:i + 16 * j + 16], c[j])
        s = float(hsum16(c[0])) + float(hsum16(c[1]))
    else:
        c = [np.zeros(8, F) for _ in range(4)]
        for i in range(0, body, 32):
            for j in range(4):
                c[j] = _fma(wf[i + 8 * j:i + 8 * j + 8], xf[i + 8 * j:i + 8 * j + 8], c[j])
        s = float(hsum8(((c[0] + c[2]).astype(F) + (c[1] + c[3]).astype(F)).astype(F)))
    for k in range(body, n):
        s += float(F(wf[k] * xf[k]))
    return F(s)


def sgemm_dot(w: np.ndarray, xb: np.ndarray, build: str) -> F:
    """tinyBLAS's dot of one row and one token (both BF16 bits; n a multiple of its step)."""
    if build == "bf16":
        c = np.zeros(16, F)
        for i in range(0, len(xb), 32):
            c = dpbf16(c, w[i:i + 32], xb[i:i + 32])
        return hsum16(c)
    lanes = 16 if build == "avx512" else 8
    c = np.zeros(lanes, F)
    wf, xf = widen(w), widen(xb)
    for i in range(0, len(xb), lanes):
        c = _fma(wf[i:i + lanes], xf[i:i + lanes], c)
    return hsum16(c) if lanes == 16 else hsum8(c)


def mul_mat(w: np.ndarray, X: np.ndarray, build: str) -> np.ndarray:
    """ggml_mul_mat(w (rows, n) BF16 bits, X (n_tok, n) float32) -> (n_tok, rows)."""
    xb = to_bf16(X)
    step = {"bf16": 32, "avx512": 16, "avx2": 8}[build]
    sgemm = X.shape[0] >= 2 and X.shape[1] % step == 0 and w.shape[0] % 4 == 0
    dot = sgemm_dot if sgemm else vec_dot
    return np.array([[dot(w[r], xb[t], build) for r in range(w.shape[0])] for t in range(X.shape[0])], F)
