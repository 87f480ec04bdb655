"""Plain Numba kernels over GGUF blocks: block dequantization and per-row integer dot
products for every type (the 8-bit activation quantizers: act_quant.py).

The F16/BF16 row dequantizer is used directly (their products: matvec_half_ir.py,
bf16_ggml.py, and f32_ggml.py for F32); the quantized dots and dequantization are the
straightforward second implementation that the IR kernels (dispatch.py) are tested against
(and what EDGEINFER_PLAIN_KERNELS=1 runs).

Layouts follow ggml-quants.c. Inner loops take their length at run time (`n16`,
`n32`): a literal `range(32)` is fully unrolled before LLVM vectorizes and stays
scalar.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import iq_tables as _tb
# the activation quantizers live in act_quant.py; their names stay importable from here
from .act_quant import (PARALLEL_ROWS, _bits_to_f32, _round_f16, quantize_act, quantize_q8_0,  # noqa: F401
                        quantize_q8_k, quantize_rows_q8_0, quantize_rows_q8_0_parallel, quantize_rows_q8_k,
                        quantize_rows_q8_k_parallel)

# GGML type ids (gguf.GGMLQuantizationType values), as plain ints for Numba.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16, MXFP4 = 10, 11, 12, 13, 14, 20, 23, 30, 39
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M = 16, 17, 18, 19, 21, 22, 29
# Not a GGML type: Q4_K with its rows interleaved in groups of 8 (kernels_cpu/repack.py),
# a copy the CPU backend makes at load for the fast kernels only.
Q4_K_X8 = 1012

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int8)
# E2M1 values doubled (ggml's kvalues_mxfp4): the block scale is E8M0 halved to match
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_POW2 = np.array([2.0 ** (e - 25) for e in range(32)], dtype=np.float32)   # fp16 exponent e -> 2^(e-15-10)
_JIT = dict(cache=True, nogil=True)
# reassociation lets LLVM vectorize float sums; no nnan/ninf: -inf and NaN must keep meaning
_FAST = {"reassoc", "contract"}


@njit(inline="always", **_JIT)
def f16(lo, hi):
    """IEEE half (two little-endian bytes) -> float32."""
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = np.float32(m) * np.float32(5.960464477539063e-08)
    elif e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(m + 1024) * _POW2[e]
    return -v if h & 0x8000 else v


@njit(inline="always", **_JIT)
def e8m0_half(e):
    """An MXFP4 block's E8M0 scale byte -> 2^(e-128) as float32 (ggml_e8m0_to_fp32_half:
    the bits 0x00200000 << e for the two denormals e < 2, else exponent field e - 1)."""
    u = np.uint32(e)
    return _bits_to_f32(np.uint32(0x00200000) << u if u < 2 else (u - np.uint32(1)) << np.uint32(23))


@njit(inline="always", **_JIT)
def scale_min_k4(w, r, o, j):
    """6-bit (scale, min) of sub-block j from the 12 packed bytes at w[r, o:o+12] (Q4_K / Q5_K)."""
    if j < 4:
        return np.int32(w[r, o + j] & 63), np.int32(w[r, o + j + 4] & 63)
    sc = np.int32(w[r, o + j + 4] & 0xF) | (np.int32(w[r, o + j - 4] >> 6) << 4)
    mn = np.int32(w[r, o + j + 4] >> 4) | (np.int32(w[r, o + j] >> 6) << 4)
    return sc, mn


@njit(inline="always", **_JIT)
def scale_q3k(w, r, o, k):
    """Signed 6-bit scale k (0..15) from the 12 packed bytes at w[r, o:o+12] (Q3_K)."""
    lo = np.int32(w[r, o + k] & 0xF) if k < 8 else np.int32(w[r, o + k - 8] >> 4)
    hi = (np.int32(w[r, o + 8 + (k & 3)]) >> (2 * (k >> 2))) & 3
    return (lo | (hi << 4)) - 32


@njit(inline="always", **_JIT)
def scale_iq4xs(w, r, o, ib):
    """Signed 6-bit scale of sub-block ib from an IQ4_XS block starting at byte o."""
    sh = np.int32(w[r, o + 2]) | (np.int32(w[r, o + 3]) << 8)
    lo = (np.int32(w[r, o + 4 + (ib >> 1)]) >> (4 * (ib & 1))) & 0xF
    return (lo | (((sh >> (2 * ib)) & 3) << 4)) - 32


# ----------------------------------------------------------------------------- dequantization

@njit(**_JIT)
def _dequant_row(w, wi8, qt, r, y, n16, n32):
    """Dequantize row r of raw weights w (u8) / wi8 (same bytes as int8) into y (n_cols,) f32."""
    n = y.shape[0]
    if qt < 64 and _IQ_BYTES[qt] > 0:
        _dequant_row_iq(w, qt, r, y)
    if qt == F32:
        for k in range(n):
            y[k] = _bits_to_f32(np.uint32(w[r, 4 * k]) | (np.uint32(w[r, 4 * k + 1]) << 8)
                                | (np.uint32(w[r, 4 * k + 2]) << 16) | (np.uint32(w[r, 4 * k + 3]) << 24))
    elif qt == F16:
        for k in range(n):
            y[k] = f16(w[r, 2 * k], w[r, 2 * k + 1])
    elif qt == BF16:
        for k in range(n):
            y[k] = _bf16(w[r, 2 * k], w[r, 2 * k + 1])
    elif qt == Q4_0 or qt == Q4_1 or qt == Q5_0 or qt == Q5_1 or qt == IQ4_NL:
        bs = 18 if (qt == Q4_0 or qt == IQ4_NL) else (20 if qt == Q4_1 else (22 if qt == Q5_0 else 24))
        for b in range(n // 32):
            o = b * bs
            d = f16(w[r, o], w[r, o + 1])
            m = np.float32(0.0)
            qo = o + 2
            qh = np.int32(0)
            if qt == Q4_1 or qt == Q5_1:
                m = f16(w[r, o + 2], w[r, o + 3])
                qo = o + 4
            if qt == Q5_0 or qt == Q5_1:
                qh = (np.int32(w[r, qo]) | (np.int32(w[r, qo + 1]) << 8) | (np.int32(w[r, qo + 2]) << 16)
                      | (np.int32(w[r, qo + 3]) << 24))
                qo += 4
            for k in range(16):
                lo = np.int32(w[r, qo + k] & 0xF)
                hi = np.int32(w[r, qo + k] >> 4)
                if qt == IQ4_NL:
                    y[b * 32 + k] = d * np.float32(KVALUES_IQ4NL[lo])
                    y[b * 32 + k + 16] = d * np.float32(KVALUES_IQ4NL[hi])
                    continue
                if qt == Q5_0 or qt == Q5_1:
                    lo |= ((qh >> k) & 1) << 4
                    hi |= ((qh >> (k + 16)) & 1) << 4
                if qt == Q4_0:
                    lo -= 8
                    hi -= 8
                elif qt == Q5_0:
                    lo -= 16
                    hi -= 16
                y[b * 32 + k] = d * np.float32(lo) + m
                y[b * 32 + k + 16] = d * np.float32(hi) + m
    elif qt == Q8_0:
        for b in range(n // 32):
            o = b * 34
            d = f16(w[r, o], w[r, o + 1])
            for k in range(n32):
                y[b * 32 + k] = d * np.float32(wi8[r, o + 2 + k])
    elif qt == MXFP4:
        for b in range(n // 32):
            o = b * 17
            d = e8m0_half(w[r, o])
            for k in range(n16):
                v = np.int32(w[r, o + 1 + k])
                y[b * 32 + k] = np.float32(KVALUES_MXFP4[v & 0xF]) * d
                y[b * 32 + k + 16] = np.float32(KVALUES_MXFP4[v >> 4]) * d
    elif qt == Q2_K:
        for b in range(n // 256):
            o = b * 84
            d = f16(w[r, o + 80], w[r, o + 81])
            dmin = f16(w[r, o + 82], w[r, o + 83])
            for g in range(16):            # g = h*8 + j*2 + (l >= 16)
                h, j, l0 = g >> 3, (g >> 1) & 3, (g & 1) * 16
                sc = np.int32(w[r, o + g])
                dl = d * np.float32(sc & 0xF)
                ml = dmin * np.float32(sc >> 4)
                for l in range(l0, l0 + 16):
                    q = (np.int32(w[r, o + 16 + h * 32 + l]) >> (2 * j)) & 3
                    y[b * 256 + h * 128 + j * 32 + l] = dl * np.float32(q) - ml
    elif qt == Q3_K:
        for b in range(n // 256):
            o = b * 110
            d = f16(w[r, o + 108], w[r, o + 109])
            for g in range(16):
                h, j, l0 = g >> 3, (g >> 1) & 3, (g & 1) * 16
                dl = d * np.float32(scale_q3k(w, r, o + 96, g))
                bit = 1 << (h * 4 + j)
                for l in range(l0, l0 + 16):
                    q = (np.int32(w[r, o + 32 + h * 32 + l]) >> (2 * j)) & 3
                    if not (np.int32(w[r, o + l]) & bit):
                        q -= 4
                    y[b * 256 + h * 128 + j * 32 + l] = dl * np.float32(q)
    elif qt == Q4_K or qt == Q5_K:
        bs = 144 if qt == Q4_K else 176
        qs0 = 16 if qt == Q4_K else 48
        for b in range(n // 256):
            o = b * bs
            d = f16(w[r, o], w[r, o + 1])
            dmin = f16(w[r, o + 2], w[r, o + 3])
            for j in range(8):
                c, hi = j >> 1, j & 1
                sc, mn = scale_min_k4(w, r, o + 4, j)
                dl = d * np.float32(sc)
                ml = dmin * np.float32(mn)
                for l in range(32):
                    q = (np.int32(w[r, o + qs0 + c * 32 + l]) >> (4 * hi)) & 0xF
                    if qt == Q5_K:
                        q |= ((np.int32(w[r, o + 16 + l]) >> j) & 1) << 4
                    y[b * 256 + j * 32 + l] = dl * np.float32(q) - ml
    elif qt == Q6_K:
        for b in range(n // 256):
            o = b * 210
            d = f16(w[r, o + 208], w[r, o + 209])
            for h in range(2):
                for gq in range(4):
                    for l in range(32):
                        v = np.int32(w[r, o + h * 64 + (gq & 1) * 32 + l])
                        v = (v & 0xF) if gq < 2 else (v >> 4)
                        v |= ((np.int32(w[r, o + 128 + h * 32 + l]) >> (2 * gq)) & 3) << 4
                        sc = np.float32(wi8[r, o + 192 + h * 8 + gq * 2 + (l >> 4)])
                        y[b * 256 + h * 128 + gq * 32 + l] = d * sc * np.float32(v - 32)
    elif qt == IQ4_XS:
        for b in range(n // 256):
            o = b * 136
            d = f16(w[r, o], w[r, o + 1])
            for ib in range(8):
                dl = d * np.float32(scale_iq4xs(w, r, o, ib))
                for k in range(16):
                    v = np.int32(w[r, o + 8 + ib * 16 + k])
                    y[b * 256 + ib * 32 + k] = dl * np.float32(KVALUES_IQ4NL[v & 0xF])
                    y[b * 256 + ib * 32 + k + 16] = dl * np.float32(KVALUES_IQ4NL[v >> 4])


@njit(inline="always", **_JIT)
def _bf16(lo, hi):
    return _bits_to_f32((np.uint32(lo) << 16) | (np.uint32(hi) << 24))


@njit(parallel=True, **_JIT)
def dequantize_rows_kernel(w, wi8, qt, rows, out):
    """out[i] = dequantized row rows[i] of w; out (len(rows), n_cols) f32."""
    for i in prange(rows.shape[0]):
        _dequant_row(w, wi8, qt, rows[i], out[i], 16, 32)


# ----------------------------------------------------------------------------- integer row dots

@njit(**_JIT)
def _dot_row_q32(w, wi8, qt, r, xq, xd, xs, n16, n32):
    """Row r of a 32-block type (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL/MXFP4) dotted with Q8_0 activations."""
    nb = xd.shape[0]
    acc = np.float32(0.0)
    if qt == Q8_0:
        for b in range(nb):
            o = b * 34
            s = np.int32(0)
            for k in range(n32):
                s += np.int32(wi8[r, o + 2 + k]) * np.int32(xq[b * 32 + k])
            acc += f16(w[r, o], w[r, o + 1]) * xd[b] * np.float32(s)
        return acc
    if qt == MXFP4:
        for b in range(nb):
            o = b * 17
            s = np.int32(0)
            for k in range(n16):
                v = np.int32(w[r, o + 1 + k])
                s += (np.int32(KVALUES_MXFP4[v & 0xF]) * np.int32(xq[b * 32 + k])
                      + np.int32(KVALUES_MXFP4[v >> 4]) * np.int32(xq[b * 32 + 16 + k]))
            acc += xd[b] * e8m0_half(w[r, o]) * np.float32(s)
        return acc
    bs = 18 if (qt == Q4_0 or qt == IQ4_NL) else (20 if qt == Q4_1 else (22 if qt == Q5_0 else 24))
    for b in range(nb):
        o = b * bs
        d = f16(w[r, o], w[r, o + 1])
        qo = o + 2
        if qt == Q4_1 or qt == Q5_1:
            qo = o + 4
        s = np.int32(0)
        if qt == IQ4_NL:
            for k in range(n16):
                v = np.int32(w[r, qo + k])
                s += (np.int32(KVALUES_IQ4NL[v & 0xF]) * np.int32(xq[b * 32 + k])
                      + np.int32(KVALUES_IQ4NL[v >> 4]) * np.int32(xq[b * 32 + 16 + k]))
        elif qt == Q4_0 or qt == Q4_1:
            for k in range(n16):
                v = np.int32(w[r, qo + k])
                s += (v & 0xF) * np.int32(xq[b * 32 + k]) + (v >> 4) * np.int32(xq[b * 32 + 16 + k])
        else:
            qh = (np.int32(w[r, qo]) | (np.int32(w[r, qo + 1]) << 8) | (np.int32(w[r, qo + 2]) << 16)
                  | (np.int32(w[r, qo + 3]) << 24))
            for k in range(n16):
                v = np.int32(w[r, qo + 4 + k])
                lo = (v & 0xF) | (((qh >> k) & 1) << 4)
                hi = (v >> 4) | (((qh >> (k + 16)) & 1) << 4)
                s += lo * np.int32(xq[b * 32 + k]) + hi * np.int32(xq[b * 32 + 16 + k])
        dd = d * xd[b]
        if qt == Q4_0:
            acc += dd * np.float32(s - 8 * xs[b])
        elif qt == Q5_0:
            acc += dd * np.float32(s - 16 * xs[b])
        elif qt == IQ4_NL:
            acc += dd * np.float32(s)
        else:   # Q4_1 / Q5_1: d*q + m
            m = f16(w[r, o + 2], w[r, o + 3])
            acc += dd * np.float32(s) + m * xd[b] * np.float32(xs[b])
    return acc


@njit(**_JIT)
def _dot_row_qk(w, wi8, qt, r, xq, xd, xs, n16, n32):
    """Row r of a 256-block type (Q2_K..Q6_K, IQ4_XS) dotted with Q8_K activations."""
    nb = xd.shape[0]
    acc = np.float32(0.0)
    for b in range(nb):
        x0 = b * 256
        if qt == Q4_K or qt == Q5_K:
            o = b * (144 if qt == Q4_K else 176)
            qs0 = o + (16 if qt == Q4_K else 48)
            isum = np.int32(0)
            msum = np.int32(0)
            for j in range(8):
                sc, mn = scale_min_k4(w, r, o + 4, j)
                msum += mn * (xs[b * 16 + 2 * j] + xs[b * 16 + 2 * j + 1])
                c, sh = (j >> 1) * 32, 4 * (j & 1)
                s = np.int32(0)
                if qt == Q4_K:
                    for l in range(n32):
                        s += ((np.int32(w[r, qs0 + c + l]) >> sh) & 0xF) * np.int32(xq[x0 + j * 32 + l])
                else:
                    for l in range(n32):
                        q = ((np.int32(w[r, qs0 + c + l]) >> sh) & 0xF) | (((np.int32(w[r, o + 16 + l]) >> j) & 1) << 4)
                        s += q * np.int32(xq[x0 + j * 32 + l])
                isum += sc * s
            d = f16(w[r, o], w[r, o + 1]) * xd[b]
            dmin = f16(w[r, o + 2], w[r, o + 3]) * xd[b]
            acc += d * np.float32(isum) - dmin * np.float32(msum)
        elif qt == Q6_K:
            o = b * 210
            isum = np.int32(0)
            for h in range(2):
                for gq in range(4):
                    sh = 4 * (gq >> 1)
                    for half in range(2):
                        s = np.int32(0)
                        base = half * 16
                        for l in range(n16):
                            ll = base + l
                            v = (np.int32(w[r, o + h * 64 + (gq & 1) * 32 + ll]) >> sh) & 0xF
                            v |= ((np.int32(w[r, o + 128 + h * 32 + ll]) >> (2 * gq)) & 3) << 4
                            s += v * np.int32(xq[x0 + h * 128 + gq * 32 + ll])
                        g = h * 8 + gq * 2 + half
                        isum += np.int32(wi8[r, o + 192 + g]) * (s - 32 * xs[b * 16 + h * 8 + gq * 2 + half])
            acc += f16(w[r, o + 208], w[r, o + 209]) * xd[b] * np.float32(isum)
        elif qt == Q2_K:
            o = b * 84
            isum = np.int32(0)
            msum = np.int32(0)
            for g in range(16):
                h, j, l0 = g >> 3, (g >> 1) & 3, (g & 1) * 16
                sc = np.int32(w[r, o + g])
                msum += (sc >> 4) * xs[b * 16 + g]
                s = np.int32(0)
                for l in range(n16):
                    q = (np.int32(w[r, o + 16 + h * 32 + l0 + l]) >> (2 * j)) & 3
                    s += q * np.int32(xq[x0 + h * 128 + j * 32 + l0 + l])
                isum += (sc & 0xF) * s
            d = f16(w[r, o + 80], w[r, o + 81]) * xd[b]
            dmin = f16(w[r, o + 82], w[r, o + 83]) * xd[b]
            acc += d * np.float32(isum) - dmin * np.float32(msum)
        elif qt == Q3_K:
            o = b * 110
            isum = np.int32(0)
            for g in range(16):
                h, j, l0 = g >> 3, (g >> 1) & 3, (g & 1) * 16
                bit = 1 << (h * 4 + j)
                s = np.int32(0)
                for l in range(n16):
                    q = (np.int32(w[r, o + 32 + h * 32 + l0 + l]) >> (2 * j)) & 3
                    q -= 4 * (1 - min(np.int32(w[r, o + l0 + l]) & bit, 1))
                    s += q * np.int32(xq[x0 + h * 128 + j * 32 + l0 + l])
                isum += scale_q3k(w, r, o + 96, g) * s
            acc += f16(w[r, o + 108], w[r, o + 109]) * xd[b] * np.float32(isum)
        else:  # IQ4_XS
            o = b * 136
            isum = np.int32(0)
            for ib in range(8):
                s = np.int32(0)
                for k in range(n16):
                    v = np.int32(w[r, o + 8 + ib * 16 + k])
                    s += (np.int32(KVALUES_IQ4NL[v & 0xF]) * np.int32(xq[x0 + ib * 32 + k])
                          + np.int32(KVALUES_IQ4NL[v >> 4]) * np.int32(xq[x0 + ib * 32 + 16 + k]))
                isum += scale_iq4xs(w, r, o, ib) * s
            acc += f16(w[r, o], w[r, o + 1]) * xd[b] * np.float32(isum)
    return acc


# ----------------------------------------------------------------------------- i-quants
# The straightforward reading of ggml's block_iq* layouts (dot_iquant.py holds ggml's order):
# each 32-value group decoded into signed integers, then summed.
_G_IQ2XXS, _G_IQ2XS, _G_IQ2S, _G_IQ1S = _tb.IQ2XXS_GRID, _tb.IQ2XS_GRID, _tb.IQ2S_GRID, _tb.IQ1S_GRID
_G_IQ3XXS, _G_IQ3S, _KSIGNS = _tb.IQ3XXS_GRID, _tb.IQ3S_GRID, _tb.KSIGNS_IQ2XS
_IQ_BYTES = np.zeros(64, np.int64)   # type id -> block bytes of the i-quants, else 0
_IQ_BYTES[[IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M]] = [66, 74, 82, 98, 110, 50, 56]


@njit(inline="always", **_JIT)
def _u16(w, r, o):
    return np.int32(w[r, o]) | (np.int32(w[r, o + 1]) << 8)


@njit(inline="always", **_JIT)
def _u32(w, r, o):
    return np.int64(_u16(w, r, o)) | (np.int64(_u16(w, r, o + 2)) << 16)


@njit(inline="always", **_JIT)
def _grid_byte(g, j):
    return np.int32((np.uint64(g) >> np.uint64(8 * j)) & np.uint64(255))


@njit(**_JIT)
def _iq_block_d(w, r, o, qt):
    if qt != IQ1_M:
        return f16(w[r, o], w[r, o + 1])
    bits = ((_u16(w, r, o + 48) >> 12) | ((_u16(w, r, o + 50) >> 8) & 0xF0) | ((_u16(w, r, o + 52) >> 4) & 0xF00)
            | (_u16(w, r, o + 54) & 0xF000))
    return f16(bits & 255, bits >> 8)


@njit(**_JIT)
def _iq_group(w, r, o, qt, ib, vals, shifts):
    """Decode 32-value group ib of the i-quant block at byte o of row r: vals[0:32] the
    signed integer values, shifts[0:4] IQ1's +-1 per 8 values; returns the raw scales of
    values 0-15 and 16-31."""
    for k in range(4):
        shifts[k] = 1
    if qt == IQ2_XXS or qt == IQ3_XXS:
        aux = _u32(w, r, o + 2 + 8 * ib + 4) if qt == IQ2_XXS else _u32(w, r, o + 66 + 4 * ib)
        for l in range(4):
            sg = np.int32(_KSIGNS[(aux >> (7 * l)) & 127])
            for j in range(8):
                if qt == IQ2_XXS:
                    v = _grid_byte(_G_IQ2XXS[w[r, o + 2 + 8 * ib + l]], j)
                else:
                    v = _grid_byte(_G_IQ3XXS[w[r, o + 2 + 8 * ib + 2 * l + j // 4]], j % 4)
                vals[8 * l + j] = -v if (sg >> j) & 1 else v
        ls = np.int32(aux >> 28)
        return ls, ls
    if qt == IQ2_XS or qt == IQ2_S:
        for l in range(4):
            if qt == IQ2_XS:
                q = _u16(w, r, o + 2 + 8 * ib + 2 * l)
                g = _G_IQ2XS[q & 511]
                sg = np.int32(_KSIGNS[q >> 9])
            else:
                qh = np.int32(w[r, o + 66 + ib])
                g = _G_IQ2S[np.int32(w[r, o + 2 + 4 * ib + l]) | ((qh << (8 - 2 * l)) & 0x300)]
                sg = np.int32(w[r, o + 34 + 4 * ib + l])
            for j in range(8):
                v = _grid_byte(g, j)
                vals[8 * l + j] = -v if (sg >> j) & 1 else v
        sc = np.int32(w[r, o + (66 if qt == IQ2_XS else 74) + ib])
        return sc & 15, sc >> 4
    if qt == IQ3_S:
        qh = np.int32(w[r, o + 66 + ib])
        for l in range(4):
            sg = np.int32(w[r, o + 74 + 4 * ib + l])
            for j in range(8):
                k = 2 * l + j // 4
                g = _G_IQ3S[np.int32(w[r, o + 2 + 8 * ib + k]) | (((qh >> k) & 1) << 8)]
                v = _grid_byte(g, j % 4)
                vals[8 * l + j] = -v if (sg >> j) & 1 else v
        ls = (np.int32(w[r, o + 106 + ib // 2]) >> (4 * (ib % 2))) & 15
        return ls, ls
    if qt == IQ1_S:
        qh = _u16(w, r, o + 34 + 2 * ib)
        for l in range(4):
            g = _G_IQ1S[np.int32(w[r, o + 2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)]
            for j in range(8):
                v = _grid_byte(g, j)
                vals[8 * l + j] = v - 256 if v > 127 else v
            shifts[l] = -1 if qh & 0x8000 else 1
        ls = (qh >> 12) & 7
        return ls, ls
    # IQ1_M
    for l in range(4):
        qh = np.int32(w[r, o + 32 + 2 * ib + l // 2])
        hi = (qh << (8 if l % 2 == 0 else 4)) & 0x700
        g = _G_IQ1S[np.int32(w[r, o + 4 * ib + l]) | hi]
        for j in range(8):
            v = _grid_byte(g, j)
            vals[8 * l + j] = v - 256 if v > 127 else v
        shifts[l] = -1 if qh & (0x08 if l % 2 == 0 else 0x80) else 1
    sc = _u16(w, r, o + 48 + 2 * (ib // 2))
    return (sc >> (6 * (ib % 2))) & 7, (sc >> (6 * (ib % 2) + 3)) & 7


@njit(**_JIT)
def _dot_row_iq(w, qt, r, xq, xd):
    """Row r of an i-quant type dotted with Q8_K activations: every value's integer product
    with its odd multiplier 2 s + 1, summed per block, scaled by d * dx and the type's factor."""
    vals = np.empty(32, np.int32)
    shifts = np.empty(4, np.int32)
    bs = _IQ_BYTES[qt]
    factor = np.float32(0.125) if (qt == IQ2_XXS or qt == IQ2_XS or qt == IQ2_S) else (
        np.float32(0.25) if qt == IQ3_XXS else np.float32(1.0))
    acc = np.float32(0.0)
    for b in range(xd.shape[0]):
        o = b * bs
        isum = np.int64(0)
        ssum = np.int64(0)
        for ib in range(8):
            lo, hi = _iq_group(w, r, o, qt, ib, vals, shifts)
            for k in range(32):
                m = 2 * (lo if k < 16 else hi) + 1
                x = np.int64(xq[b * 256 + 32 * ib + k])
                isum += m * vals[k] * x
                ssum += m * shifts[k // 8] * x
        t = factor * np.float32(isum)
        if qt == IQ1_S or qt == IQ1_M:
            t += np.float32(0.125) * np.float32(ssum)
        acc += _iq_block_d(w, r, o, qt) * xd[b] * t
    return acc


@njit(**_JIT)
def _dequant_row_iq(w, qt, r, y):
    vals = np.empty(32, np.int32)
    shifts = np.empty(4, np.int32)
    bs = _IQ_BYTES[qt]
    for b in range(y.shape[0] // 256):
        o = b * bs
        d = _iq_block_d(w, r, o, qt)
        for ib in range(8):
            lo, hi = _iq_group(w, r, o, qt, ib, vals, shifts)
            for k in range(32):
                ls = lo if k < 16 else hi
                if qt == IQ2_XXS or qt == IQ2_XS or qt == IQ2_S or qt == IQ3_XXS:
                    db = d * (np.float32(0.5) + np.float32(ls)) * np.float32(0.5 if qt == IQ3_XXS else 0.25)
                    y[b * 256 + 32 * ib + k] = db * np.float32(vals[k])
                elif qt == IQ3_S:
                    y[b * 256 + 32 * ib + k] = d * np.float32(2 * ls + 1) * np.float32(vals[k])
                else:
                    shift = np.float32(0.125) * np.float32(shifts[k // 8])
                    y[b * 256 + 32 * ib + k] = d * np.float32(2 * ls + 1) * (np.float32(vals[k]) + shift)


@njit(parallel=True, **_JIT)
def matvec_q_kernel(w, wi8, qt, xq, xd, xs, out, n16, n32):
    """out[r] = row r of w . (8-bit activations xq/xd/xs), for every quantized type.
    """
    if qt < 64 and _IQ_BYTES[qt] > 0:
        for r in prange(out.shape[0]):
            out[r] = _dot_row_iq(w, qt, r, xq, xd)
    elif qt == Q2_K or qt == Q3_K or qt == Q4_K or qt == Q5_K or qt == Q6_K or qt == IQ4_XS:
        for r in prange(out.shape[0]):
            out[r] = _dot_row_qk(w, wi8, qt, r, xq, xd, xs, n16, n32)
    else:
        for r in prange(out.shape[0]):
            out[r] = _dot_row_q32(w, wi8, qt, r, xq, xd, xs, n16, n32)


@njit(parallel=True, **_JIT)
def dequantize_half_rows_kernel(wh, is_bf16, rows, out):
    """out[i] = row rows[i] of F16/BF16 weights given as uint16 (n_rows, n_cols)."""
    for i in prange(rows.shape[0]):
        r = rows[i]
        if is_bf16:
            for k in range(out.shape[1]):
                out[i, k] = _bf16_u16(wh[r, k])
        else:
            for k in range(out.shape[1]):
                v = wh[r, k]
                out[i, k] = f16(v & 0xFF, v >> 8)


@njit(inline="always", **_JIT)
def _bf16_u16(v):
    return _bits_to_f32(np.uint32(v) << 16)
