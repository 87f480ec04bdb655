"""ggml's float32 math as llama.cpp's x86 build for this CPU computes it: ggml_v_expf and the horizontal sums.

llama.cpp built natively for an AVX-512 CPU (AVX512F and DQ) runs its vector exp, SiLU,
softmax and F16/F32 dots 16 lanes wide with their own roundings; its AVX2 build 8 wide.
edgeinfer reproduces the build that matches the CPU it compiles for (`AVX512`, from the
Numba target's features, so a NUMBA_CPU_NAME build reproduces that target's llama.cpp):
- ggml_v_expf, AVX2: exp(x) = k + k j with k = 2^n, one fma (j without its 1);
  AVX-512: 1 + c1 b is rounded inside the polynomial (j512 ~ 1 + j), then scalef(j512, n).
- the softmax and variance sums: each vector's horizontal sum (AVX2's movehl/movehdup,
  `hsum8`; AVX-512's _mm512_reduce_add_ps, `hsum16`) added into a double.

The constants are ggml_v_expf's, as written there in hexadecimal; the numpy reference
(edgeinfer.backends.base) reads them from here. The compiled pieces inline into the attention
softmax (kv_attention.py) and the SiLU (ops.py).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from .ir_helpers import arithmetic_fence, target_features


def _avx512_build() -> bool:
    """Whether llama.cpp's build for the CPU Numba compiles for is its AVX-512 one
    (ggml's exp, SiLU and softmax take 16 lanes where AVX512F and AVX512DQ are there)."""
    return {"+avx512f", "+avx512dq"} <= target_features(cpu_target.target_context)


AVX512 = _avx512_build()
LANES = 16 if AVX512 else 8   # float32 lanes of ggml's vec_* loops (exp, SiLU, softmax, variance)
SLOTS = 4 * LANES             # ggml_vec_dot_f16's four accumulators of LANES: the slots of a dot

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


@intrinsic
def unfused(typingctx, x):
    """x (float32) through llvm.arithmetic.fence (ir_helpers.arithmetic_fence): the product
    keeps its own rounding."""
    sig = types.float32(types.float32)

    def codegen(context, builder, sig, args):
        return arithmetic_fence(builder, args[0])
    return sig, codegen


@intrinsic
def _fma_f32_ir(typingctx, a, b, c):
    """llvm.fma.f32: one rounding (vfmadd where the CPU has FMA, libm's fmaf elsewhere)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fn = builder.module.globals.get("llvm.fma.f32") or ir.Function(
            builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        return builder.call(fn, args)
    return sig, codegen


@njit(inline="always", **_JIT)
def fma_f32(a, b, c):
    """float32 fused multiply-add, one rounding, as ggml's vector fmas. (It was float64
    arithmetic, whose two roundings differ from one with probability ~2^-29, at half the
    vector width: ggml's exp in SiLU and softmax ran ~2x slower.)"""
    return _fma_f32_ir(np.float32(a), np.float32(b), np.float32(c))


@njit(inline="always", **_JIT)
def _expf_reduced(x):
    """ggml_v_expf's range reduction, both builds: the exponent n, the reduced argument b,
    and b * b."""
    z = fma_f32(x, LOG2E, R)
    n = np.float32(z - R)
    b = fma_f32(-n, LN2_LO, fma_f32(-n, LN2_HI, x))
    return n, b, np.float32(b * b)


@njit(inline="always", **_JIT)
def expf_parts(x):
    """ggml_v_expf's exponent n and polynomial j: exp(x) ~ 2^n * (1 + j)."""
    n, b, u = _expf_reduced(x)
    j = fma_f32(fma_f32(fma_f32(C5, b, C4), u, fma_f32(C3, b, C2)), u, np.float32(C1 * b))
    return n, j


@njit(inline="always", **_JIT)
def expf_parts512(x):
    """AVX-512 ggml_v_expf's exponent n and polynomial j512: exp(x) ~ 2^n * j512, where
    j512 holds the 1 (its last fma adds the polynomial to fma(c1, b, 1))."""
    n, b, u = _expf_reduced(x)
    j = fma_f32(fma_f32(fma_f32(C5, b, C4), u, fma_f32(C3, b, C2)), u, fma_f32(C1, b, np.float32(1.0)))
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
    """ggml_v_expf of this CPU's llama.cpp build for any finite float32 x (branch-free)."""
    if AVX512:
        return expf512_any(x)
    return expf256_any(x)


@njit(inline="always", **_JIT)
def expf512_any(x):
    """AVX-512 ggml_v_expf: scalef(j512, n), one rounding of 2^n * j512 (exact in float64;
    a subnormal or infinite result rounds there once); |n| > 192: 0 or inf."""
    n, j = expf_parts512(x)
    k = pow2_f64(np.int64(min(max(n, np.float32(-193.0)), np.float32(193.0))))
    r = np.float32(np.float64(j) * k)
    return np.float32(0.0) if n < -192.0 else (np.float32(np.inf) if n > 192.0 else r)


@njit(inline="always", **_JIT)
def expf256_any(x):
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


@njit(inline="always", **_JIT)
def hsum16(v, o):
    """_mm512_reduce_add_ps of v[o:o + 16]: the 256-bit halves, then the 128-bit ones,
    then (0 + 2) + (1 + 3)."""
    h = np.empty(4, np.float32)
    for i in range(4):
        h[i] = np.float32(np.float32(v[o + i] + v[o + i + 8]) + np.float32(v[o + i + 4] + v[o + i + 12]))
    return np.float32(np.float32(h[0] + h[2]) + np.float32(h[1] + h[3]))


@njit(inline="always", **_JIT)
def hsum_vec(v, o):
    """The horizontal sum of one of ggml's vec_* vectors, v[o:o + LANES], on this build."""
    if AVX512:
        return hsum16(v, o)
    return hsum8(v[o], v[o + 1], v[o + 2], v[o + 3], v[o + 4], v[o + 5], v[o + 6], v[o + 7])
