"""Unnormalized softmax rows for long non-causal attention (an image's patches), compiled.

    exp_rows(s, scale, sums): s[r] <- exp(s[r] * scale - max(s[r] * scale)), sums[r] <- its sum

One pass for the maximum and one for the weights, instead of numpy's six passes over a score
matrix far larger than the caches (scale, max, subtract, exp, a float64 sum, divide); the
division moves to the (n, head_dim) output, which is 57x smaller at 4096 patches.

exp is ggml_v_expf's polynomial (ggml_math's constants; on AVX-512 CPUs its AVX-512 build's,
whose polynomial holds the 1) on its |n| <= 126 range: the inputs
are <= 0, and those under -87 are clamped there (they weigh < 2^-125 against the row's
largest, 1.0). No reassociation reaches the exp (it would fold ggml's rounding trick
(x log2e + 1.5 2^23) - 1.5 2^23 away): LLVM vectorizes it 8 lanes at a time as written, and
only the row's sum, a separate loop over the row in L1, adds in 8 float32 partial sums.
The vision encoders' parity with libmtmd is held to relative tolerances, not bits
(tests/test_vision_*.py); tests/test_softmax_rows.py checks these against float64.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .ggml_math import AVX512, C1, C2, C3, C4, C5, LN2_HI, LN2_LO, LOG2E, R

NO_NANS = {"nnan", "ninf", "nsz"}      # what lets the exp loop vectorize, and nothing more
_SUM = {"nnan", "ninf", "nsz", "reassoc"}
_LOWEST = np.float32(-87.0)


@intrinsic
def _fma(typingctx, a, b, c):
    """A float32 fused multiply-add (one vfmadd where the CPU has FMA)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        mod = builder.module
        fn = mod.globals.get("llvm.fma.f32") or ir.Function(mod, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def _pow2(typingctx, n):
    """2.0 ** n as float32 for an int32 -126 <= n <= 127, from the exponent bits."""
    sig = types.float32(types.int32)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())
    return sig, codegen


@njit(inline="always", fastmath=NO_NANS, cache=True, nogil=True)
def exp_nonpositive(x):
    """exp(x) for x <= 0 (x < -87 taken as -87): ggml_v_expf's fast path."""
    x = max(x, _LOWEST)
    z = _fma(x, LOG2E, R)
    n = z - R
    b = _fma(-n, LN2_LO, _fma(-n, LN2_HI, x))
    u = b * b
    k = _pow2(np.int32(n))
    if AVX512:   # scalef(j512, n): k is a power of two, so the product is exact
        return _fma(_fma(_fma(C5, b, C4), u, _fma(C3, b, C2)), u, _fma(C1, b, np.float32(1.0))) * k
    j = _fma(_fma(_fma(C5, b, C4), u, _fma(C3, b, C2)), u, C1 * b)
    return _fma(j, k, k)


@njit(fastmath=_SUM, cache=True, nogil=True)
def _sum(row):
    acc = np.float32(0.0)
    for j in range(row.shape[0]):
        acc += row[j]
    return acc


@njit(fastmath=NO_NANS, cache=True, nogil=True)
def _exp_rows(s, scale, maxes, sums):
    n = s.shape[1]
    for r in range(s.shape[0]):
        row = s[r]
        m = maxes[r] * scale   # = max(row * scale): rounding is monotonic and scale > 0
        for j in range(n):
            row[j] = exp_nonpositive(row[j] * scale - m)
        sums[r] = _sum(row)


def exp_rows(s: np.ndarray, scale: np.float32, sums: np.ndarray) -> None:
    """s (rows, n) float32 C-contiguous, scale > 0: each row to its unnormalized softmax
    weights in place, their sums to sums (rows,). Releases the GIL. The row maxima come
    from numpy's SIMD reduction: Numba leaves a float max loop scalar (4x slower)."""
    _exp_rows(s, np.float32(scale), s.max(axis=1), sums)
