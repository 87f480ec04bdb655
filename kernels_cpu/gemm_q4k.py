"""Long prompts on Q4_K weights without VNNI: 8 rows in lanes, each token's bytes broadcast.

Why: on AVX2-only CPUs a long prompt's Q4_K products were dequantized to float32 tiles for
BLAS, which runs at the float FMA peak (~75 GFLOP/s a Zen 3 core). `vpmaddubsw` does 32
u8 x s8 products a instruction, twice the float rate, if the work around it is small:
- For each group of 8 rows and 256-element block, the rows are staged once into a 2.5 KB
  scratch (`_stage`): codes as bytes laid out [sub-block j][step k][row r][4 bytes], so one
  32-byte load holds elements 4k..4k+3 of sub-block j for all 8 rows, one row a 32-bit lane;
  the sub-block scales as i16 pairs a row, the mins as (min 2i, min 2i+1) i16 pairs, d and
  dmin as floats. Staging is paid once per block for every token of the tile.
- Per token (`_tokens`, 4 at a time for register reuse), bytes 4k..4k+3 of its sub-block
  are broadcast to all lanes from memory (the load ports are otherwise idle) against the
  staged codes: lane r sums row r's products. Eight such vpmaddubsw results add in i16
  (a lane is at most 8 * 2 * 15 * 128 = 30720), then one vpmaddwd applies the sub-block's
  scales per row. The min term is one vpmaddwd per two sub-blocks against the token's
  per-32 activation sums, packed as i16 pairs (`pack_activations`).
- Per block and token, the same float work as the decode kernel's: acc += (d dx) I and
  accm += (dmin (-dx)) M with the same exact integers I and M (dot_q4k_x8's
  llama.cpp-repacked-gemv order). So a long prompt's products have the decoded token's
  bits: prefill, short prompts and decode agree exactly.
The activations are the Q8_K rows the decode path quantizes (quantize_rows_q8_k).
"""
from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from .dot_kquant import k_nibbles, q4k_qs32, q4k_scales_vec
from .ir_helpers import F32T, I8, I16, I32, IRHelpers, c64, counted_loop, mask, target_features, vec

GROUP_ROWS = 8           # rows a group: one per 32-bit lane
TOKENS = 4               # tokens a step of the token loop
_CODES, _SCALES, _MINS, _D, _DMIN = 0, 2048, 2304, 2432, 2464   # scratch offsets (bytes)
SCRATCH_BYTES = 2496
ACC_COLS = 2 * GROUP_ROWS   # per token: acc (8 floats), then accm (8 floats)
TILE_TOKENS = 256           # tokens a staged block serves (a multiple of TOKENS)
_JIT = dict(cache=True, nogil=True)


@functools.cache
def host_has_avx2() -> bool:
    """Whether the kernels compile for AVX2 (elsewhere the portable IR is exact but slow)."""
    return "+avx2" in target_features(cpu_target.target_context)


def _store(h, base, off, v):
    h.b.store(v, h.b.bitcast(h.ptr(base, c64(off)), v.type.as_pointer()), align=1)


def _transpose8(b, vs):
    """8 x <8 x i32> -> 8 x <8 x i32>, out[k] lane r = vs[r] lane k (unpack 32, unpack 64,
    then 128-bit halves: 24 shuffles)."""
    t = []
    for p in range(4):
        a, c = vs[2 * p], vs[2 * p + 1]
        t.append(b.shuffle_vector(a, c, mask([0, 8, 1, 9, 4, 12, 5, 13])))
        t.append(b.shuffle_vector(a, c, mask([2, 10, 3, 11, 6, 14, 7, 15])))
    # t[2p]: lanes (0, 1 | 4, 5) of rows 2p, 2p+1 interleaved; t[2p + 1]: lanes (2, 3 | 6, 7)
    u = []
    for q in range(2):   # rows 0-3, rows 4-7
        lo, hi = t[4 * q:4 * q + 2], t[4 * q + 2:4 * q + 4]
        for src in range(2):
            u.append(b.shuffle_vector(lo[src], hi[src], mask([0, 1, 8, 9, 4, 5, 12, 13])))
            u.append(b.shuffle_vector(lo[src], hi[src], mask([2, 3, 10, 11, 6, 7, 14, 15])))
    # u[4q + m]: elements m | m + 4 (m = 0..3) of rows 4q..4q+3
    out = [None] * 8
    for m in range(4):
        out[m] = b.shuffle_vector(u[m], u[4 + m], mask([0, 1, 2, 3, 8, 9, 10, 11]))
        out[m + 4] = b.shuffle_vector(u[m], u[4 + m], mask([4, 5, 6, 7, 12, 13, 14, 15]))
    return out


def _stage_codegen(context, builder, sig, args):
    w = context.make_array(sig.args[0])(context, builder, args[0])
    s = context.make_array(sig.args[3])(context, builder, args[3])
    g, bi = args[1], args[2]
    b = builder
    h = IRHelpers(b, target_features(context))
    i8p = I8.as_pointer()
    stride = cgutils.unpack_tuple(b, w.strides)[0]
    base = b.gep(b.bitcast(w.data, i8p), [b.mul(b.mul(g, c64(GROUP_ROWS)), stride)])
    rows = [b.gep(base, [b.mul(c64(k), stride)]) for k in range(GROUP_ROWS)]
    sbase = b.bitcast(s.data, i8p)
    wo = b.mul(bi, c64(144))
    for c in range(4):
        qs = [q4k_qs32(h, row, wo, c, False) for row in rows]
        for hi in range(2):
            j = 2 * c + hi
            codes = _transpose8(b, [b.bitcast(k_nibbles(h, q, hi), vec(I32, 8)) for q in qs])
            for k in range(8):
                _store(h, sbase, _CODES + 256 * j + 32 * k, codes[k])
    sms = [q4k_scales_vec(h, row, wo) for row in rows]            # 8 scales, 8 mins a row
    s16 = [b.shuffle_vector(sms[2 * p], sms[2 * p + 1], mask(range(32))) for p in range(4)]
    s32 = [b.shuffle_vector(s16[2 * p], s16[2 * p + 1], mask(range(64))) for p in range(2)]
    allsm = b.shuffle_vector(s32[0], s32[1], mask(range(128)))   # row r's bytes at 16 r
    for j in range(8):   # lanes 2r, 2r + 1: scale j of row r
        sc = b.shuffle_vector(allsm, allsm, mask([16 * r + j for r in range(8) for _ in range(2)]))
        _store(h, sbase, _SCALES + 32 * j, b.zext(sc, vec(I16, 16)))
    for i in range(4):   # lanes 2r, 2r + 1: mins 2i, 2i + 1 of row r
        mn = b.shuffle_vector(allsm, allsm, mask([16 * r + 8 + 2 * i + e for r in range(8) for e in range(2)]))
        _store(h, sbase, _MINS + 32 * i, b.zext(mn, vec(I16, 16)))
    dm = [h.load(row, wo, I32) for row in rows]                   # d | dmin << 16
    dmv = ir.Constant(vec(I32, 8), ir.Undefined)
    for k in range(8):
        dmv = b.insert_element(dmv, dm[k], ir.Constant(I32, k))
    dm16 = b.bitcast(dmv, vec(I16, 16))
    _store(h, sbase, _D, h.f16_lanes(b.shuffle_vector(dm16, dm16, mask(range(0, 16, 2)))))
    _store(h, sbase, _DMIN, h.f16_lanes(b.shuffle_vector(dm16, dm16, mask(range(1, 16, 2)))))
    return context.get_dummy_value()


@intrinsic
def _stage(typingctx, w, g, bi, s):
    """Stage block bi of rows 8g..8g+7 of a Q4_K matrix into the scratch s (see module doc)."""
    return types.void(w, g, bi, s), _stage_codegen


def _tokens_codegen(context, builder, sig, args):
    arrs = [context.make_array(ty)(context, builder, a) for ty, a in zip(sig.args[:4], args[:4])]
    s, xq, xd, xb = arrs
    acc = context.make_array(sig.args[6])(context, builder, args[6])
    bi, t_lo, t_hi = args[4], args[5], args[7]
    b = builder
    h = IRHelpers(b, target_features(context))
    i8p = I8.as_pointer()
    sbase = b.bitcast(s.data, i8p)

    def rows_of(arr, block_major):
        # block-major activations: token t of block bi at bi * stride0 + t * stride1
        strides = cgutils.unpack_tuple(b, arr.strides)
        base = b.bitcast(arr.data, i8p)
        if block_major:
            base = b.gep(base, [b.mul(bi, strides[0])])
        stride = strides[1] if block_major else strides[0]
        return lambda t: b.gep(base, [b.mul(t, stride)])
    xrow, drow, brow = (rows_of(a, True) for a in (xq, xd, xb))
    arow = rows_of(acc, False)
    d = h.load(sbase, c64(_D), vec(F32T, 8))
    dmin = h.load(sbase, c64(_DMIN), vec(F32T, 8))
    z16 = ir.Constant(vec(I16, 16), [0] * 16)
    z32 = ir.Constant(vec(I32, 8), [0] * 8)

    def bcast(p, off):   # the i32 at p + off in all 8 lanes (vpbroadcastd from memory)
        return h.splat(h.load(p, c64(off), I32), 8)

    def quad(i, _):
        ts = [b.add(b.add(t_lo, i), c64(ti)) for ti in range(TOKENS)]
        xs = [xrow(t) for t in ts]
        isum = [z32] * TOKENS
        for j in range(8):
            s16 = [z16] * TOKENS
            for k in range(8):
                wv = h.load(sbase, c64(_CODES + 256 * j + 32 * k), vec(I8, 32))
                for ti in range(TOKENS):
                    xv = b.bitcast(bcast(xs[ti], 32 * j + 4 * k), vec(I8, 32))
                    s16[ti] = b.add(s16[ti], h.maddubs(wv, xv))
            sc = h.load(sbase, c64(_SCALES + 32 * j), vec(I16, 16))
            isum = [b.add(isum[ti], h.madd_i16(s16[ti], sc)) for ti in range(TOKENS)]
        msum = [z32] * TOKENS
        for i2 in range(4):
            mn = h.load(sbase, c64(_MINS + 32 * i2), vec(I16, 16))
            for ti in range(TOKENS):
                bp = b.bitcast(bcast(brow(ts[ti]), 4 * i2), vec(I16, 16))
                msum[ti] = b.add(msum[ti], h.madd_i16(mn, bp))
        for ti in range(TOKENS):
            dx = h.load(drow(ts[ti]), c64(0), F32T)
            ap = arow(ts[ti])
            a = h.load(ap, c64(0), vec(F32T, 8))
            m = h.load(ap, c64(32), vec(F32T, 8))
            a = h.fma(b.fmul(d, h.splat(dx, 8)), b.sitofp(isum[ti], vec(F32T, 8)), a)
            m = h.fma(b.fmul(dmin, h.splat(b.fneg(dx), 8)), b.sitofp(msum[ti], vec(F32T, 8)), m)
            _store(h, ap, 0, a)
            _store(h, ap, 32, m)
        return []
    counted_loop(b, b.sub(t_hi, t_lo), TOKENS, [], quad, "q4k_tok")
    return context.get_dummy_value()


@intrinsic
def _tokens(typingctx, s, xq, xd, xb, bi, t_lo, acc, t_hi):
    """For tokens t_lo..t_hi (a multiple of TOKENS apart): acc[t] += block bi of the staged
    rows . token t (acc[t, :8] the scaled dots, acc[t, 8:] the min terms)."""
    return types.void(s, xq, xd, xb, bi, t_lo, acc, t_hi), _tokens_codegen


@njit(**_JIT)
def _gemm_rows(w, g0, g1, xq, xd, xb, tile, out):
    """out[t, 8g + k] for row groups g0 <= g < g1 and every token of out, `tile` tokens at
    a time: each staged block serves that many tokens, and the tile's accumulators
    (64 bytes a token) stay in L1."""
    n_tok = out.shape[0]
    nb, n_pad = xd.shape
    s = np.empty(SCRATCH_BYTES, np.uint8)
    acc = np.empty((n_pad, ACC_COLS), np.float32)
    for t0 in range(0, n_pad, tile):
        t1 = min(t0 + tile, n_pad)
        for g in range(g0, g1):
            acc[t0:t1] = 0.0
            for bi in range(nb):
                _stage(w, g, bi, s)
                _tokens(s, xq, xd, xb, bi, t0, acc, t1)
            for t in range(t0, min(t1, n_tok)):
                for k in range(GROUP_ROWS):
                    out[t, GROUP_ROWS * g + k] = acc[t, k] + acc[t, GROUP_ROWS + k]


def pack_activations(xq: np.ndarray, xd: np.ndarray, xs: np.ndarray):
    """Q8_K rows (quantize_activation_rows: xq (n, K) int8, xd (n, K/256), xs (n, K/16)
    sums of 16) -> the kernel's inputs, block-major (one block of every token side by
    side: the token loop reads each block's activations as one sequential stream), tokens
    padded to a multiple of TOKENS with zeros: xq (K/256, n_pad, 256), xd (K/256, n_pad),
    and xb (K/256, n_pad, 4) holding per block the per-32 sums as i16 pairs (2i, 2i + 1)
    in one int32 each."""
    n, k = xq.shape
    nb = k // 256
    n_pad = -(-n // TOKENS) * TOKENS
    s32 = xs.reshape(n, k // 32, 2).sum(axis=2, dtype=np.int32)     # |s| <= 32 * 128: i16
    xq_p = np.zeros((nb, n_pad, 256), np.int8)
    xq_p[:, :n] = xq.reshape(n, nb, 256).transpose(1, 0, 2)
    xd_p = np.zeros((nb, n_pad), np.float32)
    xd_p[:, :n] = xd.T
    xb = np.zeros((nb, n_pad, 4), np.int32)
    xb[:, :n] = s32.astype(np.int16).view(np.int32).reshape(n, nb, 4).transpose(1, 0, 2)
    return xq_p, xd_p, xb


def matmul_rows(w_raw: np.ndarray, g0: int, g1: int, packed, out: np.ndarray) -> None:
    """Row groups g0..g1 (rows 8 g0 .. 8 g1) of out (n_tok, n_rows) = activations . w for
    a Q4_K matrix with rows % 8 == 0 and `pack_activations` output. Releases the GIL."""
    xq, xd, xb = packed
    _gemm_rows(w_raw, g0, g1, xq, xd, xb, TILE_TOKENS, out)
