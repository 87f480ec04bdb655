"""numpy twins of ggml_math, whole arrays at a time: llama.cpp's vector exp and horizontal sums for this CPU's build (the references)."""
from __future__ import annotations

import numpy as np

from . import ggml_math as gm

LANES = gm.LANES
SLOTS = gm.SLOTS


def _fma(a, b, c):
    """float32 fma: the product of two float32 is exact in float64, then the roundings."""
    return (np.asarray(a, np.float64) * b + c).astype(np.float32)


def expf_parts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml_v_expf's exponent n and polynomial j (AVX2: exp ~ 2^n (1 + j); AVX-512: 2^n j,
    the 1 rounded in with c1 b) for float32 x."""
    with np.errstate(invalid="ignore", over="ignore"):
        z = _fma(x, gm.LOG2E, gm.R)
        n = (z - gm.R).astype(np.float32)
        b = _fma(-n, gm.LN2_LO, _fma(-n, gm.LN2_HI, x))
        u = (b * b).astype(np.float32)
        last = _fma(gm.C1, b, np.float32(1.0)) if gm.AVX512 else (gm.C1 * b).astype(np.float32)
        j = _fma(_fma(_fma(gm.C5, b, gm.C4), u, _fma(gm.C3, b, gm.C2)), u, last)
    return n, j


def expf_any(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf over any finite float32 x. AVX2: 2^n (1 + j) rounded once for |n| <= 126
    (its fma), 2^n float32(1 + j) rounded again beyond; AVX-512: 2^n j rounded once (scalef);
    both 0 for n < -192 and inf for n > 192."""
    n, j = expf_parts(np.asarray(x, np.float32))
    with np.errstate(invalid="ignore", over="ignore"):
        nc = np.clip(n, -193, 193).astype(np.int32)
        if gm.AVX512:
            one_j = j.astype(np.float64)
        else:
            one_j = np.where(np.abs(n) <= 126, j.astype(np.float64) + 1.0,
                             (j + np.float32(1.0)).astype(np.float32).astype(np.float64))
        out = np.ldexp(one_j, nc).astype(np.float32)
    return np.where(n > 192, np.float32(np.inf), np.where(n < -192, np.float32(0.0), out)).astype(np.float32)


def expf_nonpositive(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf for x <= 0 (-inf -> 0) as the attention softmax kernel takes it (AVX2:
    results below 2^-126 are 0)."""
    if gm.AVX512:
        return expf_any(x)
    n, j = expf_parts(np.asarray(x, np.float32))
    with np.errstate(invalid="ignore", over="ignore"):
        tiny = ~(n >= -126.0)
        k = np.ldexp(np.float32(1.0), np.where(tiny, 0, n).astype(np.int32)).astype(np.float32)
        out = ((j + np.float32(1.0)).astype(np.float32) * k).astype(np.float32)
    return np.where(tiny, np.float32(0.0), out)


def hsum8(lanes: np.ndarray) -> np.ndarray:
    """The AVX horizontal sum of 8 float32 lanes (last axis): (0+4, 1+5, 2+6, 3+7), then
    (0+2, 1+3), then their sum."""
    t = lanes[..., :4] + lanes[..., 4:]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])


def hsum16(lanes: np.ndarray) -> np.ndarray:
    """_mm512_reduce_add_ps over 16 float32 lanes (last axis)."""
    h = lanes[..., :8] + lanes[..., 8:]
    return hsum8(h)


def hsum_vec(lanes: np.ndarray) -> np.ndarray:
    """The horizontal sum of one of ggml's vec_* vectors (last axis: LANES) on this build."""
    return hsum16(lanes) if gm.AVX512 else hsum8(lanes)


def reduce_slots(slots: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f16's reduction of its SLOTS float32 slots (last axis, as 4 x LANES):
    x = (s0 + s2) + (s1 + s3) per lane, then AVX2's GGML_F32x8_REDUCE (lanes i + 4 onto i,
    then (0 + 1) + (2 + 3)) or AVX-512's _mm512_reduce_add_ps."""
    s = slots.reshape(slots.shape[:-1] + (4, LANES))
    x = (s[..., 0, :] + s[..., 2, :]) + (s[..., 1, :] + s[..., 3, :])
    if gm.AVX512:
        return hsum16(x)
    t = x[..., :4] + x[..., 4:]
    return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])
