"""glibc's expf, inlined: the same bits as the C library's call, without the call.

ggml's CPU flash attention weighs every key with libm's expf (one call a key and head:
~4 ns each, a fifth of a quantized-cache decode step's attention at 4096 keys). glibc
(2.28 on) computes expf in double from a 32-entry table of 2^(i/32) and a cubic, the
ARM optimized-routines algorithm (sysdeps/ieee754/flt-32/e_expf.c); on x86-64 with FMA
it runs the build whose multiply-adds are fused (__expf_fma). `expf` below is that
build's arithmetic for finite x below 88 (larger ones overflow: not an attention
weight), written out so that it inlines into a kernel's loop, where independent keys'
exps overlap. tests/test_expf_glibc.py holds it equal to the library's expf over every
float32 in [-110, 88) on this machine.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_JIT = dict(cache=True, nogil=True)

# 2^(i/32) as double bits, each less i << 47, so that adding the reduction's integer k
# << 47 gives 2^(k/32) (the table of glibc's exp2f_data.c)
_TAB = np.array([
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
], dtype=np.uint64)
_N = 32
_INV_LN2_N = float.fromhex("0x1.71547652b82fep+0") * _N
_SHIFT = float.fromhex("0x1.8p+52")
_C0 = float.fromhex("0x1.c6af84b912394p-5") / _N / _N / _N
_C1 = float.fromhex("0x1.ebfce50fac4f3p-3") / _N / _N
_C2 = float.fromhex("0x1.62e42ff0c52d6p-1") / _N
_UNDERFLOW = np.float32(float.fromhex("-0x1.9fe368p6"))   # below: 0 (glibc's __math_uflowf)


@intrinsic
def fma_f64(typingctx, a, b, c):
    """a * b + c rounded once (llvm.fma.f64: vfmadd on an FMA CPU)."""
    sig = types.float64(types.float64, types.float64, types.float64)

    def codegen(context, builder, sig, args):
        d = ir.DoubleType()
        f = builder.module.declare_intrinsic("llvm.fma", [d], ir.FunctionType(d, [d, d, d]))
        return builder.call(f, args)
    return sig, codegen


@intrinsic
def _bits(typingctx, x):
    """The bits of a float64 as uint64."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.uint64(types.float64), codegen


@intrinsic
def _double(typingctx, u):
    """The float64 with these bits."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.uint64), codegen


@njit(inline="always", **_JIT)
def expf(x):
    """libm expf of a float32 x < 88 (NaN-free; -inf and x below -103.97 give 0)."""
    if x < _UNDERFLOW:
        return np.float32(0.0)
    xd = np.float64(x)
    # z = InvLn2N * xd has two uses, both adds: GCC fuses it into each (two fmas)
    kd = fma_f64(_INV_LN2_N, xd, _SHIFT)
    ki = _bits(kd)
    kd = kd - _SHIFT
    r = fma_f64(_INV_LN2_N, xd, -kd)
    t = _TAB[ki % np.uint64(_N)] + (ki << np.uint64(47))
    s = _double(t)
    zz = fma_f64(_C0, r, _C1)
    r2 = r * r
    y = fma_f64(_C2, r, 1.0)
    y = fma_f64(zz, r2, y)
    return np.float32(y * s)
