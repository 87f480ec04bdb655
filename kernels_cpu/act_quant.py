"""The 8-bit quantization of activations, as llama.cpp quantizes them before its integer dots.

Q8_0 blocks of 32 (the 32-element weight types) and Q8_K blocks of 256 with per-16 sums
(the K-quants and i-quants), for one vector (decode) or a prompt's rows, those of 16 or
more on every thread.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

_JIT = dict(cache=True, nogil=True)


@intrinsic
def _bits_to_f32(typingctx, u):
    """Reinterpret the low 32 bits of an integer as a float32."""
    def codegen(context, builder, sig, args):
        v = builder.trunc(args[0], ir.IntType(32)) if args[0].type.width > 32 else args[0]
        return builder.bitcast(v, ir.FloatType())
    return types.float32(u), codegen


@njit(inline="always", **_JIT)
def _abs_bits(bits, i):
    """|x[i]|'s bits as an int32 (bits: x viewed as int32), 0 for a NaN: non-negative floats
    order as their bits, so the largest magnitude is an integer max, which vectorizes (a
    float max reduction does not without fast-math), and a NaN never wins, as in ggml's
    `if (ax > amax)`."""
    a = bits[i] & np.int32(0x7FFFFFFF)
    return a if a <= np.int32(0x7F800000) else np.int32(0)


@njit(**_JIT)
def quantize_q8_0(x, xq, xd, xs, n32):
    """x (n,) f32 -> int8 xq (n,), per-32 scale xd (n/32,) and per-32 sum of xq xs (n/32,).

    As llama.cpp's AVX2 quantize_row_q8_0: d = amax/127 rounded to fp16, q = rint(x*127/amax).
    """
    bits = x.view(np.int32)
    for b in range(x.shape[0] // 32):
        top = np.int32(0)
        for k in range(n32):
            top = max(top, _abs_bits(bits, b * 32 + k))
        amax = _bits_to_f32(top)
        d = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        for k in range(32):   # the values, then their sum: one loop of both stays scalar
            xq[b * 32 + k] = np.int32(np.rint(x[b * 32 + k] * inv))
        s = np.int32(0)
        for k in range(n32):
            s += np.int32(xq[b * 32 + k])
        xd[b] = _round_f16(d)
        xs[b] = s


@njit(inline="always", **_JIT)
def _round_f16(v):
    """Round a non-negative float32 to the nearest fp16 value (Q8_0 stores d as fp16)."""
    if v == 0:
        return np.float32(0.0)
    e = np.int32(np.floor(np.log2(v)))
    e = max(e, np.int32(-14))
    step = np.float32(2.0) ** np.float32(e - 10)
    return np.float32(np.rint(v / step)) * step


@njit(**_JIT)
def quantize_q8_k(x, xq, xd, xs, n16):
    """x (n,) f32 -> int8 xq (n,), per-256 float scale xd (n/256,), per-16 sums xs (n/16,).

    As ggml's quantize_row_q8_K: the value of largest magnitude (the first of them) maps
    to -127, d = 1/iscale.
    """
    bits = x.view(np.int32)
    for b in range(x.shape[0] // 256):
        o = b * 256
        top = np.int32(0)
        for k in range(256):
            top = max(top, _abs_bits(bits, o + k))
        if top == 0:
            xd[b] = 0.0
            for k in range(256):
                xq[o + k] = 0
            for g in range(16):
                xs[b * 16 + g] = 0
            continue
        first = np.int32(256)   # the first of them: a min over indices, which vectorizes
        for k in range(256):
            first = min(first, np.int32(k) if _abs_bits(bits, o + k) == top else np.int32(256))
        iscale = np.float32(-127.0) / x[o + first]
        # the values, then the per-16 sums: one loop of both stays scalar (2.3 -> 1.1 ms
        # for 512 x 8192 on 2 threads)
        for k in range(256):
            xq[o + k] = min(np.int32(127), np.int32(np.rint(iscale * x[o + k])))
        for g in range(16):
            s = np.int32(0)
            for k in range(n16):
                s += np.int32(xq[o + g * 16 + k])
            xs[b * 16 + g] = s
        xd[b] = np.float32(1.0) / iscale


@njit(**_JIT)
def quantize_act(x, act_block):
    """x (n,) f32 -> (xq int8 (n,), xd f32 per block, xs int32 sums): Q8_0-style 32-blocks
    (xs per 32) for act_block 32, Q8_K-style 256-blocks (xs per 16) otherwise."""
    n = x.shape[0]
    xq = np.empty(n, np.int8)
    if act_block == 32:
        xd = np.empty(n // 32, np.float32)
        xs = np.empty(n // 32, np.int32)
        quantize_q8_0(x, xq, xd, xs, 32)
    else:
        xd = np.empty(n // 256, np.float32)
        xs = np.empty(n // 16, np.int32)
        quantize_q8_k(x, xq, xd, xs, 16)
    return xq, xd, xs


@njit(**_JIT)
def quantize_rows_q8_0(X, XQ, XD, XS):
    """quantize_q8_0 over the rows of X (n_tok, n)."""
    for t in range(X.shape[0]):
        quantize_q8_0(X[t], XQ[t], XD[t], XS[t], 32)


@njit(**_JIT)
def quantize_rows_q8_k(X, XQ, XD, XS):
    """quantize_q8_k over the rows of X (n_tok, n)."""
    for t in range(X.shape[0]):
        quantize_q8_k(X[t], XQ[t], XD[t], XS[t], 16)


# a prompt's rows on every thread: a 512 x 8192 input took 4.9 ms on one thread of a 2-core
# AVX-512 Xeon (8.9 before the integer max), 2.5 ms on two
PARALLEL_ROWS = 16   # rows from which the quantization takes a parallel region


@njit(parallel=True, **_JIT)
def quantize_rows_q8_0_parallel(X, XQ, XD, XS):
    for t in prange(X.shape[0]):
        quantize_q8_0(X[t], XQ[t], XD[t], XS[t], 32)


@njit(parallel=True, **_JIT)
def quantize_rows_q8_k_parallel(X, XQ, XD, XS):
    for t in prange(X.shape[0]):
        quantize_q8_k(X[t], XQ[t], XD[t], XS[t], 16)
