"""Numpy references for the i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S.

Each block (256 values) is unpacked into one integer form: the signed grid value of every
element `g`, the odd integer multiplier of every 16 elements `m` (2 * scale + 1), the
block's fp16 scale `d` and, for IQ1, the sign of the +-1/8 shift of every 8 elements.
From it:
- `dequantize` as ggml's dequantize_row_* rounds, bit for bit;
- `vec_dot` as ggml's AVX2 ggml_vec_dot_*_q8_K sums: each block's exact integer products
  in 8 lanes (lane L holds elements 4L..4L+3 of every 32), one float fma per lane and
  block, then the AVX horizontal sum times the type's constant. Every x86 build of
  llama.cpp runs these AVX2 loops (there are no AVX-512 ones), so one order serves both.

Slow and plain: tests and debugging only. Layouts: ggml-common.h's block_iq*.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import iq_tables as tb
from .quant_kernels import IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS

BLOCK_BYTES = {IQ2_XXS: 66, IQ2_XS: 74, IQ2_S: 82, IQ3_XXS: 98, IQ3_S: 110, IQ1_S: 50, IQ1_M: 56}
# the factor ggml's vec_dot multiplies the lanes' sum by (its scales are (2 s + 1) / 8 ...)
DOT_FACTOR = {IQ2_XXS: 0.125, IQ2_XS: 0.125, IQ2_S: 0.125, IQ3_XXS: 0.25, IQ3_S: 1.0, IQ1_S: 1.0, IQ1_M: 1.0}
DELTA = np.float32(0.125)   # IQ1S_DELTA, IQ1M_DELTA


@dataclass
class Unpacked:
    g: np.ndarray            # (N, 256) int32: signed grid values
    m: np.ndarray            # (N, 16) int32: odd multiplier of each 16 values
    d: np.ndarray            # (N,) float32: the block's scale
    delta: np.ndarray | None  # IQ1: (N, 32) int32, +1 / -1 per 8 values


def _grid8(table, idx):
    """(..., k) indices into a 64-bit grid -> (..., 8k) values (uint8 bytes)."""
    return table[idx].astype("<u8").view(np.uint8).reshape(*idx.shape[:-1], -1)


def _grid4(table, idx):
    """(..., k) indices into a 32-bit grid -> (..., 4k) values (uint8 bytes)."""
    return table[idx].astype("<u4").view(np.uint8).reshape(*idx.shape[:-1], -1)


def _sign_bits(sign_bytes: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., 8k) +1 / -1, bit j of byte i for element 8i + j."""
    bits = (sign_bytes[..., None] >> np.arange(8, dtype=np.uint8)) & 1
    return (1 - 2 * bits.astype(np.int32)).reshape(*sign_bytes.shape[:-1], -1)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _u16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u2").astype(np.int64)


def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4").astype(np.int64)


def _per16(m32: np.ndarray) -> np.ndarray:
    """(N, 8) multipliers of 32 values -> (N, 16)."""
    return np.repeat(m32, 2, axis=1)


def unpack(qt: int, blocks: np.ndarray) -> Unpacked:
    """(N, type size) uint8 blocks of type qt -> their integer form."""
    B = np.asarray(blocks, np.uint8).reshape(-1, BLOCK_BYTES[qt])
    n = B.shape[0]
    delta = None
    if qt == IQ2_XXS:
        d = _f16(B[:, 0:2])
        aux = _u32(B[:, 2:66]).reshape(n, 8, 2)
        g = _grid8(tb.IQ2XXS_GRID, B[:, 2:66].reshape(n, 8, 8)[:, :, :4].astype(np.int64))
        sidx = (aux[:, :, 1:2] >> (7 * np.arange(4))) & 127
        s = _sign_bits(tb.KSIGNS_IQ2XS[sidx])
        m = _per16(2 * (aux[:, :, 1] >> 28) + 1)
    elif qt in (IQ2_XS, IQ2_S):
        d = _f16(B[:, 0:2])
        if qt == IQ2_XS:
            q = _u16(B[:, 2:66]).reshape(n, 8, 4)
            g = _grid8(tb.IQ2XS_GRID, q & 511)
            s = _sign_bits(tb.KSIGNS_IQ2XS[q >> 9])
            sc = B[:, 66:74].astype(np.int64)
        else:
            qh = B[:, 66:74].astype(np.int64)
            idx = B[:, 2:34].reshape(n, 8, 4).astype(np.int64) | ((qh[:, :, None] << (8 - 2 * np.arange(4))) & 0x300)
            g = _grid8(tb.IQ2S_GRID, idx)
            s = _sign_bits(B[:, 34:66].reshape(n, 8, 4))
            sc = B[:, 74:82].astype(np.int64)
        m = np.stack([2 * (sc & 15) + 1, 2 * (sc >> 4) + 1], axis=2).reshape(n, 16)
    elif qt == IQ3_XXS:
        d = _f16(B[:, 0:2])
        g = _grid4(tb.IQ3XXS_GRID, B[:, 2:66].reshape(n, 8, 8).astype(np.int64))
        aux = _u32(B[:, 66:98])
        s = _sign_bits(tb.KSIGNS_IQ2XS[(aux[:, :, None] >> (7 * np.arange(4))) & 127])
        m = _per16(2 * (aux >> 28) + 1)
    elif qt == IQ3_S:
        d = _f16(B[:, 0:2])
        qh = B[:, 66:74].astype(np.int64)[:, :, None]
        qs = B[:, 2:66].reshape(n, 8, 4, 2).astype(np.int64)
        l2 = 2 * np.arange(4)
        idx = np.stack([qs[..., 0] | ((qh << (8 - l2)) & 256), qs[..., 1] | ((qh << (7 - l2)) & 256)], axis=3)
        g = _grid4(tb.IQ3S_GRID, idx.reshape(n, 8, 8))
        s = _sign_bits(B[:, 74:106].reshape(n, 8, 4))
        sc = B[:, 106:110].astype(np.int64)
        m = _per16(2 * np.stack([sc & 15, sc >> 4], axis=2).reshape(n, 8) + 1)
    elif qt == IQ1_S:
        d = _f16(B[:, 0:2])
        qh = _u16(B[:, 34:50])
        idx = B[:, 2:34].reshape(n, 8, 4).astype(np.int64) | (((qh[:, :, None] >> (3 * np.arange(4))) & 7) << 8)
        g = _grid8(tb.IQ1S_GRID, idx).view(np.int8).reshape(n, 256).astype(np.int32)
        m = _per16(2 * ((qh >> 12) & 7) + 1)
        delta = np.repeat(np.where(qh & 0x8000, -1, 1), 4, axis=1).astype(np.int32)
        return Unpacked(g, m.astype(np.int32), d, delta)
    elif qt == IQ1_M:
        sc = _u16(B[:, 48:56])
        bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
        d = bits.astype(np.uint16).view(np.float16).astype(np.float32)
        qh = B[:, 32:48].reshape(n, 8, 2).astype(np.int64)
        qs = B[:, 0:32].reshape(n, 8, 4).astype(np.int64)
        hi = np.stack([(qh[..., 0] << 8), (qh[..., 0] << 4), (qh[..., 1] << 8), (qh[..., 1] << 4)], axis=2) & 0x700
        g = _grid8(tb.IQ1S_GRID, qs | hi).view(np.int8).reshape(n, 256).astype(np.int32)
        shifts = np.array([0, 3, 6, 9])
        m = (2 * ((np.repeat(sc[:, :4], 4, axis=1) >> np.tile(shifts, 4)) & 7) + 1)
        dbits = np.stack([qh[..., 0] & 0x08, qh[..., 0] & 0x80, qh[..., 1] & 0x08, qh[..., 1] & 0x80], axis=2)
        delta = np.where(dbits.reshape(n, 32) != 0, -1, 1).astype(np.int32)
        return Unpacked(g, m.astype(np.int32), d, delta)
    else:
        raise ValueError(f"not an i-quant type id: {qt}")
    g = g.reshape(n, 256).astype(np.int32) * s.reshape(n, 256)
    return Unpacked(g, m.astype(np.int32), d, delta)


def grid_indices(qt: int, blocks: np.ndarray) -> np.ndarray:
    """Every grid index the blocks hold (for tests that must see the whole table)."""
    B = np.asarray(blocks, np.uint8).reshape(-1, BLOCK_BYTES[qt])
    n = B.shape[0]
    if qt == IQ2_XXS:
        return B[:, 2:66].reshape(n, 8, 8)[:, :, :4].ravel()
    if qt == IQ2_XS:
        return (_u16(B[:, 2:66]) & 511).ravel()
    if qt == IQ2_S:
        qh = B[:, 66:74].astype(np.int64)
        return (B[:, 2:34].reshape(n, 8, 4) | ((qh[:, :, None] << (8 - 2 * np.arange(4))) & 0x300)).ravel()
    if qt == IQ3_XXS:
        return B[:, 2:66].ravel()
    if qt == IQ3_S:
        qh = B[:, 66:74].astype(np.int64)[:, :, None]
        return (B[:, 2:66].reshape(n, 8, 8) | (((qh >> np.arange(8)) & 1) << 8)).ravel()
    if qt == IQ1_S:
        qh = _u16(B[:, 34:50])
        return (B[:, 2:34].reshape(n, 8, 4) | (((qh[:, :, None] >> (3 * np.arange(4))) & 7) << 8)).ravel()
    qh = B[:, 32:48].reshape(n, 8, 2).astype(np.int64)
    hi = np.stack([(qh[..., 0] << 8), (qh[..., 0] << 4), (qh[..., 1] << 8), (qh[..., 1] << 4)], axis=2) & 0x700
    return (B[:, 0:32].reshape(n, 8, 4) | hi).ravel()


def dequantize(qt: int, w_raw: np.ndarray) -> np.ndarray:
    """(n_rows, row_bytes) -> (n_rows, n_cols) float32 as ggml's dequantize_row_* rounds."""
    n_rows = w_raw.shape[0]
    u = unpack(qt, w_raw)
    m = np.repeat(u.m, 16, axis=1).astype(np.float32)
    d = u.d[:, None]
    if qt in (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS):   # d * (0.5 + s) * 1/4 (IQ3_XXS: 1/2), then * value
        db = (d * (np.float32(0.5) * m)) * np.float32(0.5 if qt == IQ3_XXS else 0.25)
        y = db * u.g.astype(np.float32)
    elif qt == IQ3_S:
        y = (d * m) * u.g.astype(np.float32)
    else:   # IQ1: d * (2 s + 1) * (value + shift)
        shift = np.repeat(u.delta, 8, axis=1).astype(np.float32) * DELTA
        y = (d * m) * (u.g.astype(np.float32) + shift)
    return y.astype(np.float32).reshape(n_rows, -1)


def _fma32(a, b, c):
    """a * b + c rounded once to float32."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def _hsum8(a: np.ndarray) -> np.ndarray:
    t = a[..., :4] + a[..., 4:]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])


def _lanes(vals: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(R, nb, 256) exact products, (R, nb, 16) multipliers -> (R, nb, 8) lane sums:
    lane L holds elements 4L..4L+3 of every 32, each 16 times its multiplier."""
    p = vals.reshape(*vals.shape[:2], 8, 8, 4).sum(axis=4)            # (R, nb, sub, lane)
    mm = np.repeat(m.reshape(*m.shape[:2], 8, 2), 4, axis=3)            # lanes 0-3: first 16
    return (p * mm).sum(axis=2)


def vec_dot(qt: int, w_raw: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """Each row . Q8_K activations (xq int8 (n,), xd float32 (n/256,), xs int32 per-16 sums),
    in ggml's AVX2 order (IQ1_S's scalar `accum1 += d * sumi1` compiled to an fma, as the
    oracle's build does)."""
    R = w_raw.shape[0]
    nb = xd.shape[0]
    u = unpack(qt, w_raw)
    g = u.g.reshape(R, nb, 256).astype(np.int64)
    m = u.m.reshape(R, nb, 16).astype(np.int64)
    q8 = np.asarray(xq, np.int64).reshape(1, nb, 256)
    d = (u.d.reshape(R, nb) * np.asarray(xd, np.float32)[None]).astype(np.float32)
    lanes = _lanes(g * q8, m)
    acc = np.zeros((R, 8), np.float32)
    acc2 = np.zeros((R, 8), np.float32)
    acc1 = np.zeros(R, np.float32)
    for b in range(nb):
        acc = _fma32(d[:, b, None], lanes[:, b].astype(np.float32), acc)
        if qt == IQ1_M:
            dl = np.repeat(u.delta.reshape(R, nb, 32)[:, b], 8, axis=1).astype(np.int64)
            l2 = _lanes((dl * q8[:, b])[:, None], m[:, b, None])[:, 0]
            acc2 = _fma32(d[:, b, None], l2.astype(np.float32), acc2)
        elif qt == IQ1_S:
            bs = np.asarray(xs, np.int64).reshape(nb, 16)[b].reshape(8, 2).sum(axis=1)   # per-32 sums
            s1 = (bs[None] * u.delta.reshape(R, nb, 32)[:, b, ::4] * m[:, b, ::2]).sum(axis=1)
            acc1 = _fma32(d[:, b], s1.astype(np.float32), acc1)
    out = _hsum8(acc)
    if qt == IQ1_S:
        return (out + DELTA * acc1).astype(np.float32)
    if qt == IQ1_M:
        return (out + DELTA * _hsum8(acc2)).astype(np.float32)
    return (np.float32(DOT_FACTOR[qt]) * out).astype(np.float32)
