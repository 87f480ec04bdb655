"""Compiled forms of kv_quant.py's per-token work on a quantized K/V cache: the Hadamard
rotation (fwht) and the q8_0 row quantizer (the CPU store's AVX2 one), bit for bit the numpy
functions there (tests/test_kv_quant.py holds them together).

Decode calls these a few times a layer on a handful of rows, where numpy's per-call cost
(a dozen small array ops each) was ~5% of a token of the 1B model.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .f16 import f16_bits_of, f16_round
from .hadamard_ir import ROWS, butterfly_rows

_JIT = dict(cache=True, nogil=True)  # no fastmath: the order of every float op matters here


@njit(**_JIT)
def _fwht_rows(y, n, inv):
    """In place on y (R, n) float32: y *= inv, then butterflies u + v, u - v for len = 1, 2, 4, ...

    Each element's ops are kv_quant.fwht's, in its order; only the loop nest differs. Blocks
    of ROWS rows go through a transposed scratch (element e of row r at e * ROWS + r), where the butterfly of elements i and i + len is one vector op over the rows (the
    short strides 1, 2, 4 of a row-wise loop do not vectorize): hadamard_ir.butterfly_rows."""
    w = ROWS
    t = np.zeros(n * w, np.float32)   # columns past a last partial block stay 0
    for r0 in range(0, y.shape[0], w):
        m = min(w, y.shape[0] - r0)
        for r in range(m):
            for e in range(n):
                t[e * w + r] = np.float32(y[r0 + r, e] * inv)
        length = 1
        while length < n:
            for b0 in range(0, n, 2 * length):
                for i in range(b0, b0 + length):
                    butterfly_rows(t, i * w, (i + length) * w)
            length *= 2
        for r in range(m):
            for e in range(n):
                y[r0 + r, e] = t[e * w + r]


@njit(inline="always", **_JIT)
def _block_q8_0(x, r, b):
    """Block b of row r: (d as float32, 127/amax or 0)."""
    amax = np.float32(0.0)
    for e in range(32):
        a = abs(x[r, 32 * b + e])
        if a > amax:
            amax = a
    d = np.float32(amax / np.float32(127.0))
    idv = np.float32(np.float32(127.0) / amax) if amax != 0 else np.float32(0.0)
    return d, idv


@njit(inline="always", **_JIT)
def _rotated(x, rot):
    """x (R, n) itself (rot 0), or a copy rotated as fwht(x, rot) rotates it: the store's
    rotation and its quantizer in one compiled call (a decode step makes three a layer)."""
    if rot == 0:
        return x
    y = x.copy()
    _fwht_rows(y.reshape(-1, rot), rot, np.float32(np.float32(1.0) / np.sqrt(np.float32(rot))))
    return y


def fwht(x: np.ndarray, n: int) -> np.ndarray:
    """As kv_quant.fwht (same bits), compiled: a rotated copy, x left as it was."""
    x = np.asarray(x, np.float32)
    return _rotated(np.ascontiguousarray(x).reshape(-1, n), n).reshape(x.shape)


@njit(**_JIT)
def _q8_0_rows(x, rot, out):
    """x (R, n) float32, rotated (rot: as _rotated) -> out (R, n // 32 * 34) raw q8_0 blocks
    (fp16 d, then 32 int8)."""
    x = _rotated(x, rot)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            d, idv = _block_q8_0(x, r, b)
            h = f16_bits_of(np.float32(d).view(np.uint32))
            o = 34 * b
            out[r, o] = np.uint8(h & np.uint32(255))
            out[r, o + 1] = np.uint8(h >> np.uint32(8))
            for e in range(32):
                out[r, o + 2 + e] = np.uint8(np.int8(np.rint(np.float32(x[r, 32 * b + e] * idv))) & 255)


@njit(**_JIT)
def _q8_0_split_rows(x, rot, qx, qd):
    """As _q8_0_rows, split: values into qx (R, n) int8, the fp16 scales as float32 into qd (R, n // 32)."""
    x = _rotated(x, rot)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            d, idv = _block_q8_0(x, r, b)
            qd[r, b] = f16_round(d)
            for e in range(32):
                qx[r, 32 * b + e] = np.int8(np.rint(np.float32(x[r, 32 * b + e] * idv)))


def _rows(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    if x.shape[-1] % 32:
        raise ValueError(f"K/V rows need a multiple of 32 values, got {x.shape[-1]}")
    return x.reshape(-1, x.shape[-1])


def quantize_q8_0(x: np.ndarray, rot: int = 0) -> np.ndarray:
    """As kv_quant.quantize_q8_0 (same bytes), compiled; of fwht(x, rot) where rot > 0."""
    x2 = _rows(x)
    out = np.empty((x2.shape[0], x2.shape[1] // 32 * 34), np.uint8)
    _q8_0_rows(x2, rot, out)
    return out.reshape(np.shape(x)[:-1] + (-1,))


def quantize_q8_0_split(x: np.ndarray, rot: int = 0):
    """Rows quantized as quantize_q8_0 (rot as there), as (int8 values (..., n), fp16 scales as
    float32 (..., n // 32))."""
    x2 = _rows(x)
    qx = np.empty(x2.shape, np.int8)
    qd = np.empty((x2.shape[0], x2.shape[1] // 32), np.float32)
    _q8_0_split_rows(x2, rot, qx, qd)
    lead = np.shape(x)[:-1]
    return qx.reshape(lead + (-1,)), qd.reshape(lead + (-1,))


@njit(inline="always", **_JIT)
def _signed_max(x, r, b):
    """Block b of row r's value of largest magnitude, the first such (ggml's `amax < fabsf(v)`
    scan): what q4_0, q5_0 and iq4_nl derive their scale from."""
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for e in range(32):
        v = x[r, 32 * b + e]
        if amax < abs(v):
            amax = abs(v)
            vmax = v
    return vmax


@njit(**_JIT)
def _q_offset_rows(x, rot, out, half):
    """quantize_row_q4_0_ref (half 8) / quantize_row_q5_0_ref (half 16) of x (R, n) into raw
    blocks: d = (the first value of largest magnitude) / -half, code = min(2 half - 1,
    trunc(x * id + half + 0.5)); q5_0 keeps each code's fifth bit in qh (a u32 before qs)."""
    x = _rotated(x, rot)
    top = 2 * half - 1
    bs = 18 if half == 8 else 22
    qs0 = 2 if half == 8 else 6
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            d = np.float32(_signed_max(x, r, b) / np.float32(-half))
            idv = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
            h = f16_bits_of(np.float32(d).view(np.uint32))
            o = bs * b
            out[r, o] = np.uint8(h & np.uint32(255))
            out[r, o + 1] = np.uint8(h >> np.uint32(8))
            qh = np.uint32(0)
            for j in range(16):
                c0 = min(top, np.int32(np.float32(np.float32(x[r, 32 * b + j] * idv) + np.float32(half + 0.5))))
                c1 = min(top, np.int32(np.float32(np.float32(x[r, 32 * b + 16 + j] * idv) + np.float32(half + 0.5))))
                out[r, o + qs0 + j] = np.uint8((c0 & 15) | ((c1 & 15) << 4))
                qh |= np.uint32((c0 >> 4) & 1) << np.uint32(j)
                qh |= np.uint32((c1 >> 4) & 1) << np.uint32(j + 16)
            if half == 16:
                for k in range(4):
                    out[r, o + 2 + k] = np.uint8((qh >> np.uint32(8 * k)) & np.uint32(255))


def quantize_q4_0(x: np.ndarray, rot: int = 0) -> np.ndarray:
    """As kv_quant.quantize_q4_0 (same bytes), compiled; of fwht(x, rot) where rot > 0."""
    return _quantize_offset(x, 8, rot)


def quantize_q5_0(x: np.ndarray, rot: int = 0) -> np.ndarray:
    """As kv_quant.quantize_q5_0 (same bytes), compiled; of fwht(x, rot) where rot > 0."""
    return _quantize_offset(x, 16, rot)


def _quantize_offset(x: np.ndarray, half: int, rot: int) -> np.ndarray:
    x2 = _rows(x)
    out = np.empty((x2.shape[0], x2.shape[1] // 32 * (18 if half == 8 else 22)), np.uint8)
    _q_offset_rows(x2, rot, out, half)
    return out.reshape(np.shape(x)[:-1] + (-1,))


_IQ4_NL_F32 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


@njit(inline="always", **_JIT)
def _iq4_nl_index(al, table):
    """ggml's best_index_int8 over the iq4_nl values: the nearest, the upper one on a tie."""
    if al <= table[0]:
        return 0
    if al >= table[15]:
        return 15
    mu = 1
    while mu < 15 and table[mu] <= al:
        mu += 1
    return mu - 1 if np.float32(al - table[mu - 1]) < np.float32(table[mu] - al) else mu


@njit(**_JIT)
def _iq4_nl_rows(x, rot, out, table):
    """quantize_row_iq4_nl_ref of x (R, n) into raw blocks (fp16 d, then 16 nibble bytes):
    d0 = (the first value of largest magnitude) / -127, each value's nearest table index of
    x / d0, then d = sum(w q x) / sum(w q q) with w = x^2 in element order (an all-zero block:
    d = 0 and zero codes), as kv_quant.quantize_iq4_nl."""
    x = _rotated(x, rot)
    codes = np.empty(32, np.int32)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            vmax = _signed_max(x, r, b)
            live = abs(vmax) >= np.float32(1e-15)
            d0 = np.float32(vmax / np.float32(-127.0)) if live else np.float32(0.0)
            inv = np.float32(np.float32(1.0) / d0) if d0 != 0 else np.float32(0.0)
            sumqx = np.float32(0.0)
            sumq2 = np.float32(0.0)
            for e in range(32):
                v = x[r, 32 * b + e]
                c = _iq4_nl_index(np.float32(inv * v), table)
                codes[e] = c if live else 0
                q = table[c]
                wq = np.float32(np.float32(v * v) * q)
                sumqx = np.float32(sumqx + np.float32(wq * v))
                sumq2 = np.float32(sumq2 + np.float32(wq * q))
            d = np.float32(sumqx / sumq2) if live and sumq2 > 0 else np.float32(0.0)
            h = f16_bits_of(np.float32(d).view(np.uint32))
            o = 18 * b
            out[r, o] = np.uint8(h & np.uint32(255))
            out[r, o + 1] = np.uint8(h >> np.uint32(8))
            for j in range(16):
                out[r, o + 2 + j] = np.uint8((codes[j] & 15) | ((codes[j + 16] & 15) << 4))


def quantize_iq4_nl(x: np.ndarray, rot: int = 0) -> np.ndarray:
    """As kv_quant.quantize_iq4_nl (same bytes), compiled; of fwht(x, rot) where rot > 0."""
    x2 = _rows(x)
    out = np.empty((x2.shape[0], x2.shape[1] // 32 * 18), np.uint8)
    _iq4_nl_rows(x2, rot, out, _IQ4_NL_F32)
    return out.reshape(np.shape(x)[:-1] + (-1,))
