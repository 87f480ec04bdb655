"""ggml's float32 math as llama.cpp's AVX2 build computes it: ggml_v_expf and the 8-lane horizontal sum.

The constants are ggml_v_expf's, as written there in hexadecimal; the numpy reference
(edgeinfer.backends.base) reads them from here. The compiled pieces inline into the attention
softmax (kv_attention.py) and the SiLU (ops.py).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_JIT = dict(cache=True, nogil=True)  # no fastmath: the order of every float op matters here

R = np.float32(float.fromhex("0x1.8p23"))
LOG2E = np.float32(float.fromhex("0x1.715476p+0"))
LN2_HI = np.float32(float.fromhex("0x1.62e4p-1"))
LN2_LO = np.float32(float.fromhex("0x1.7f7d1cp-20"))
C5 = np.float32(float.fromhex("0x1.0e4020p-7"))
C4 = np.float32(float.fromhex("0x1.573e2ep-5"))
C3 = np.float32(float.fromhex("0x1.555e66p-3"))
C2 = np.float32(float.fromhex("0x1.fffdb6p-2"))
C1 = np.float32(float.fromhex("0x1.ffffecp-1"))


@njit(inline="always", **_JIT)
def fma_f32(a, b, c):
    # float32 FMA: a*b of two float32 is exact in float64, so only the final roundings
    # remain (float64 then float32; they differ from one rounding with probability ~2^-29)
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


@njit(inline="always", **_JIT)
def expf_parts(x):
    """ggml_v_expf's exponent n and polynomial j: exp(x) ~ 2^n * (1 + j)."""
    z = fma_f32(x, LOG2E, R)
    n = np.float32(z - R)
    b = fma_f32(-n, LN2_LO, fma_f32(-n, LN2_HI, x))
    u = np.float32(b * b)
    j = fma_f32(fma_f32(fma_f32(C5, b, C4), u, fma_f32(C3, b, C2)), u, np.float32(C1 * b))
    return n, j


@intrinsic
def pow2_f64(typingctx, n):
    """2.0 ** n for an int64 -1022 <= n <= 1023, from the exponent bits (vectorizes)."""
    sig = types.float64(types.int64)

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        e = builder.shl(builder.add(args[0], ir.Constant(i64, 1023)), ir.Constant(i64, 52))
        return builder.bitcast(e, ir.DoubleType())
    return sig, codegen


@njit(inline="always", **_JIT)
def ggml_expf_any(x):
    """ggml_v_expf (AVX2) for any finite float32 x, its three ranges: |n| <= 126,
    fma(j, k, k) with k = 2^n, one rounding of 2^n * (1 + j) (exact in float64);
    126 < |n| <= 192, two power-of-two factors, 1 + j rounded to float32 first and the
    last product rounding again (to a subnormal, or to inf); beyond, 0 or inf.
    Branch-free, so loops over it vectorize."""
    n, j = expf_parts(x)
    one_j = np.float64(j) + 1.0 if abs(n) <= 126.0 else np.float64(np.float32(j + np.float32(1.0)))
    k = pow2_f64(np.int64(min(max(n, np.float32(-193.0)), np.float32(193.0))))
    r = np.float32(one_j * k)
    return np.float32(0.0) if n < -192.0 else (np.float32(np.inf) if n > 192.0 else r)


@njit(inline="always", **_JIT)
def hsum8(a0, a1, a2, a3, a4, a5, a6, a7):
    # _mm256 -> _mm_add_ps(hi, lo) -> movehl add -> movehdup add_ss
    t0 = np.float32(a0 + a4)
    t1 = np.float32(a1 + a5)
    t2 = np.float32(a2 + a6)
    t3 = np.float32(a3 + a7)
    return np.float32(np.float32(t0 + t2) + np.float32(t1 + t3))
