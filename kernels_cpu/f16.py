"""float32 <-> float16 conversions as compiled loops.

numpy converts float32 to float16 at ~6 ns an element and back at ~3 ns (scalar code);
a 255-token Gemma prefill converted ~40 M elements that way (GELU's table index, Q and
K/V for the BLAS attention): ~10% of the prefill. These loops give the same bits as
numpy's `astype` (round to nearest even, subnormals, overflow to inf, NaN stays NaN)
with integer and float32 ops that LLVM vectorizes on every x86 target.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .ir_helpers import IRHelpers, target_features
from .threads import piece_bounds, team_threads

_JIT = dict(cache=True, nogil=True)

@intrinsic
def f16_value(typingctx, bits):
    """The float32 value of F16 bits (uint16): vcvtph2ps where the CPU has F16C, which LLVM
    vectorizes in the loops below; integer ops elsewhere (exact either way)."""
    sig = types.float32(bits)

    def codegen(context, builder, sig, args):
        h = IRHelpers(builder, target_features(context))
        i16 = ir.IntType(16)
        return h.f16_value(builder.trunc(args[0], i16) if args[0].type != i16 else args[0])
    return sig, codegen


_MAGIC = np.float32(12582912.0)       # 1.5 * 2^23: adding it rounds a float32 < 2^22 to an integer (ties even)
_TWO_24 = np.float32(16777216.0)      # F16's smallest subnormal is 2^-24


def has_f16c() -> bool:
    """Whether the CPU Numba compiles for has F16C: the host's, unless NUMBA_CPU_NAME /
    NUMBA_CPU_FEATURES name another target (then only an explicit +f16c counts)."""
    from numba.core import config
    from llvmlite import binding

    if config.CPU_FEATURES is not None:
        return "+f16c" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME is not None and config.CPU_NAME != "host":
        return False
    return binding.get_host_cpu_features().get("f16c", False)


@njit(inline="always", **_JIT)
def f16_bits_of(x_bits):
    """F16 bits (as uint32) of the float32 whose bits are x_bits (uint32), ties to even."""
    sign = (x_bits >> np.uint32(16)) & np.uint32(0x8000)
    a = x_bits & np.uint32(0x7FFFFFFF)
    # normal range: drop 13 mantissa bits with round-half-even, rebias the exponent
    normal = (a + np.uint32(0x0FFF) + ((a >> np.uint32(13)) & np.uint32(1)) - np.uint32(0x38000000)) >> np.uint32(13)
    # subnormal range (|x| < 2^-14): the integer nearest |x| * 2^24, in float32
    f = np.float32(np.uint32(a).view(np.float32) * _TWO_24)
    sub = np.uint32(np.int32(np.float32(np.float32(f + _MAGIC) - _MAGIC)))
    nan = np.uint32(0x7E00) | ((a >> np.uint32(13)) & np.uint32(0x1FF))
    h = sub if a < np.uint32(0x38800000) else normal
    h = np.uint32(0x7C00) if a >= np.uint32(0x477FF000) else h     # rounds past 65504: inf
    h = nan if a > np.uint32(0x7F800000) else h
    return sign | h


@njit(inline="always", **_JIT)
def f16_round(x):
    """float32 x rounded to the nearest F16 value, as float32."""
    return f16_value(np.uint16(f16_bits_of(np.float32(x).view(np.uint32))))


@njit(**_JIT)
def _to_f16_bits_kernel(x_bits, out):
    for i in range(x_bits.shape[0]):
        out[i] = np.uint16(f16_bits_of(x_bits[i]))


@njit(**_JIT)
def _round_f16_kernel(x, out):
    for i in range(x.shape[0]):
        out[i] = f16_round(x[i])


@njit(**_JIT)
def _f16_to_f32_kernel(bits, out):
    for i in range(bits.shape[0]):
        out[i] = f16_value(bits[i])


@njit(parallel=True, **_JIT)
def _round_f16_team(x, out, nt):
    for p in prange(nt):
        lo, hi = piece_bounds(x.shape[0], nt, p, 64)
        _round_f16_kernel(x[lo:hi], out[lo:hi])


@njit(parallel=True, **_JIT)
def _f16_to_f32_team(bits, out, nt):
    for p in prange(nt):
        lo, hi = piece_bounds(bits.shape[0], nt, p, 64)
        _f16_to_f32_kernel(bits[lo:hi], out[lo:hi])


def to_f16_bits(x: np.ndarray) -> np.ndarray:
    """x (float32, any shape) -> the uint16 bits of x.astype(float16)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.uint16)
    _to_f16_bits_kernel(x.reshape(-1).view(np.uint32), out.reshape(-1))
    return out


def round_f16(x: np.ndarray) -> np.ndarray:
    """x.astype(float16).astype(float32) for float32 x."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.float32)
    nt = team_threads(x.size)
    if nt == 1:
        _round_f16_kernel(x.reshape(-1), out.reshape(-1))
    else:
        _round_f16_team(x.reshape(-1), out.reshape(-1), nt)
    return out


def f16_to_f32(h: np.ndarray) -> np.ndarray:
    """h (float16, any shape) -> float32, h.astype(float32)."""
    h = np.ascontiguousarray(h)
    if h.dtype != np.float16:
        raise TypeError(f"expected float16, got {h.dtype}")
    out = np.empty(h.shape, np.float32)
    nt = team_threads(h.size)
    if nt == 1:
        _f16_to_f32_kernel(h.reshape(-1).view(np.uint16), out.reshape(-1))
    else:
        _f16_to_f32_team(h.reshape(-1).view(np.uint16), out.reshape(-1), nt)
    return out


def warm_team_kernels() -> None:
    """Compile (or load) round_f16's and f16_to_f32's parallel twins on a few values."""
    x = np.ones(256, np.float32)
    _round_f16_team(x, np.empty_like(x), 2)
    _f16_to_f32_team(x.astype(np.float16).view(np.uint16), np.empty_like(x), 2)
