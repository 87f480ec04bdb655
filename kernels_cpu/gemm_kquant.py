"""Prompts on the 256-element types (Q2_K-Q6_K, IQ4_XS, IQ2_XXS-IQ3_S) without VNNI: 8 rows in lanes, each token's bytes broadcast.

Why: on AVX2-only CPUs a long prompt's K-quant products were dequantized to float32 tiles
for BLAS, which runs at the float FMA peak (~75 GFLOP/s a Zen 3 core). `vpmaddubsw` does
32 u8 x s8 products an instruction, twice the float rate, if the work around it is small:
- For each group of 8 rows and 256-element block, the rows are staged once into a ~3-4 KB
  scratch (`_stage_q4_k`, `_stage_q6_k`, ...): codes as unsigned bytes laid out [sub-block j]
  [step k][row r][4 bytes], so one 32-byte load holds elements 4k..4k+3 of sub-block j for
  all 8 rows, one row a 32-bit lane; the scales as i16 pairs a row, d (and dmin) as floats.
  Staging is paid once per block for every token of the tile.
- Per token (4 at a time for register reuse), bytes 4k..4k+3 of its sub-block are
  broadcast to all lanes from memory (the load ports are otherwise idle) against the
  staged codes: lane r sums row r's products. vpmaddubsw results add in i16 while they
  fit (Q4_K: 8 of them, at most 8 * 2 * 15 * 128 = 30720; Q6_K: 2, at most 2 * 2 * 63 * 128),
  then one vpmaddwd applies each row's scale. Q4_K's min term and Q6_K's -32 offset are
  vpmaddwd against the token's packed per-32 / per-16 sums (`pack_activations`).
- The other per-16 types follow Q6_K: Q3_K's codes are value + 4 (offset 4), Q2_K's min
  term is Q4_K's with per-16 mins. IQ4_XS's table values are signed, so it stages |v| and
  v and multiplies |v| by sign(x, v), one vpmaddwd (with the sub-block's scale) each.
- Q4_K: per block and token, the decode kernel's float work: acc += (d dx) I and accm +=
  (dmin (-dx)) M with the same exact integers I and M (dot_q4k_x8's llama.cpp-repacked-gemv
  order), so a long prompt's products have the decoded token's bits. Q6_K: one fma per
  block, acc += (d dx) I (the float GEMM it replaces did not match the decode bits either).
The activations are the Q8_K rows the decode path quantizes (quantize_rows_q8_k), stored
block-major so each block's tokens stream sequentially.

Measured on Zen 3 (AVX2), 512 tokens, 2 threads, against dequantize + BLAS in alternating
runs: Q4_K 14336 x 4096 206-211 vs 81-96 GFLOP/s, 4096 x 14336 199 vs 106. Q2_K, Q3_K and
IQ4_XS 8192 x 2048: 111-139 against 231-260 ms.
"""
from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from . import gemm_kquant_wide as wide, gemm_parallel
from .dot_iquant import BLOCK_BYTES as _IQ_BLOCK_BYTES, FACTOR as _IQ_FACTOR, SUB as _IQ_SUB, odd as _odd
from .dot_kquant import _q3k_scales, _q23k_codes, k_nibbles, q4k_block_bytes, q4k_qs32, q4k_scales_heads
from .dot_q32 import q32_values
from .ir_helpers import (F32T, I8, I16, I32, IRHelpers, c64, const_vec, counted_loop, mask, row_pointer, row_ptrs,
                         target_features, vec)
from .q8k_pack import pack_activations, pack_segments, warm_pack  # noqa: F401  (this GEMM's interface)
from .quant_kernels import IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q4_K_X8, Q5_K, Q6_K

# the i-quants but IQ1 (whose +-1/8 shifts would need a second sum per 8 values)
IQ_GEMM_TYPES = (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S)
GEMM_TYPES = (Q4_K, Q4_K_X8, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS) + IQ_GEMM_TYPES   # Q4_K_X8: repack.py's copy of a Q4_K matrix
GROUP_ROWS = 8           # rows a group: one per 32-bit lane
TOKENS = gemm_parallel.TOKENS_PAD   # tokens a step of the token loop (4; packed segments pad to it)
# scratch offsets (bytes): the codes, then Q4_K's scales, min pairs, d and dmin, or the
# per-16 types' (Q6_K, Q3_K, Q2_K) 16 scales, pairs (Q6_K, Q3_K: of scales, for the code
# offset; Q2_K: of mins), d and Q2_K's dmin; IQ4_XS: |values|, then the signed values,
# then its 8 scales and d; the i-quants as the per-16 types
_CODES, _SCALES, _MINS, _D, _DMIN = 0, 2048, 2304, 2432, 2464
_SCALES6, _PAIRS6, _D6, _DMIN6 = 2048, 2560, 2816, 2848
_SIGNS_XS, _SCALES_XS, _D_XS = 2048, 4096, 4352
SCRATCH_BYTES = 4384
ACC_COLS = 2 * GROUP_ROWS   # per token: acc (8 floats), then accm (8 floats)
TILE_TOKENS = 256           # tokens a staged block serves (a multiple of TOKENS)
# _gemm_rows' branches: every type here (matmul_rows); the drivers' copies keep only theirs
_HAS_Q4_K = _HAS_Q4_K_X8 = _HAS_Q5_K = _HAS_Q6_K = _HAS_Q3_K = _HAS_Q2_K = _HAS_IQ4_XS = True
_HAS_IQ2_XXS = _HAS_IQ2_XS = _HAS_IQ2_S = _HAS_IQ3_XXS = _HAS_IQ3_S = True
# value = code - offset (times the group's scale); the i-quants' values are within +-62
_CODE_OFFSET = {Q6_K: 32, Q3_K: 4, **{qt: 64 for qt in IQ_GEMM_TYPES}}
_JIT = dict(cache=True, nogil=True)
# 512-bit VNNI hosts: four row groups at a time take gemm_kquant_wide's 32-row products (the
# same bits; gemm_kquant_wide.enabled)
_WIDE = wide.enabled()
WIDE_TILE_TOKENS = 128      # tokens a wide staged block serves (acc: 256 bytes a token)


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


def _concat(b, vs):
    """8 vectors of one type -> one, vs[r] at lanes n r.. (n: their lane count)."""
    while len(vs) > 1:
        n = vs[0].type.count
        vs = [b.shuffle_vector(vs[2 * p], vs[2 * p + 1], mask(range(2 * n))) for p in range(len(vs) // 2)]
    return vs[0]


def _pairs_i16(b, allb, first, second, signed):
    """<16 x i16>, lanes 2r and 2r + 1: bytes 16r + first and 16r + second of allb, extended."""
    v = b.shuffle_vector(allb, allb, mask([16 * r + e for r in range(8) for e in (first, second)]))
    return (b.sext if signed else b.zext)(v, vec(I16, 16))


def _store_codes(h, sbase, j, per_row, at=_CODES):
    """Sub-block j's 32 codes of each row (<32 x i8> each) at their scratch places."""
    codes = _transpose8(h.b, [h.b.bitcast(v, vec(I32, 8)) for v in per_row])
    for k in range(8):
        _store(h, sbase, at + 256 * j + 32 * k, codes[k])


def _store_d(h, sbase, rows, off, at):
    """The rows' fp16 at byte `off` of their block as 8 floats at scratch byte `at`."""
    b = h.b
    v = ir.Constant(vec(I16, 8), ir.Undefined)
    for k, row in enumerate(rows):
        v = b.insert_element(v, h.load(row, off, I16), ir.Constant(I32, k))
    _store(h, sbase, at, h.f16_lanes(v))


def _stage_q4_k(h, rows, bi, sbase, x8=False, q5=False):
    """Q4_K (and Q5_K, q5: each code's fifth bit from qh) codes of sub-block j, 6-bit
    scales and mins as i16 pairs, d and dmin; value = d * sc_j * q - dmin * m_j."""
    b = h.b
    wo = b.mul(bi, c64(176 if q5 else q4k_block_bytes(x8)))
    qh = [h.load(row, b.add(wo, c64(16)), vec(I8, 32)) for row in rows] if q5 else None
    for c in range(4):
        if q5:   # qs at byte 48 (after qh)
            qs = [h.load(row, b.add(wo, c64(48 + 32 * c)), vec(I8, 32)) for row in rows]
        else:
            qs = [q4k_qs32(h, row, wo, c, x8) for row in rows]
        for hi in range(2):
            codes = [k_nibbles(h, q, hi) for q in qs]
            if q5:   # bit j of each qh byte is the fifth bit of sub-block j's element
                j = 2 * c + hi
                codes = [b.or_(v, b.shl(b.and_(b.lshr(bits, const_vec(I8, 32, j)), const_vec(I8, 32, 1)),
                                        const_vec(I8, 32, 4))) for v, bits in zip(codes, qh)]
            _store_codes(h, sbase, 2 * c + hi, codes)
    allsm = q4k_scales_heads(h, _concat(b, [h.load(row, wo, vec(I32, 4)) for row in rows]))   # 8 scales, 8 mins a row
    for j in range(8):
        _store(h, sbase, _SCALES + 32 * j, _pairs_i16(b, allsm, j, j, False))
    for i in range(4):
        _store(h, sbase, _MINS + 32 * i, _pairs_i16(b, allsm, 8 + 2 * i, 9 + 2 * i, False))
    _store_d(h, sbase, rows, wo, _D)
    _store_d(h, sbase, rows, b.add(wo, c64(2)), _DMIN)


def _stage_q6_k(h, rows, bi, sbase):
    """Codes q = ql nibble | (2 qh bits) << 4 (value d * scale * (q - 32)); 16 signed scales
    a row, one per 16 elements."""
    b = h.b
    wo = b.mul(bi, c64(210))
    for half in range(2):
        qh = [h.load(row, b.add(wo, c64(128 + 32 * half)), vec(I8, 32)) for row in rows]
        for part in range(4):
            per_row = []
            for row, qh_r in zip(rows, qh):
                ql = h.load(row, b.add(wo, c64(64 * half + 32 * (part % 2))), vec(I8, 32))
                hi2 = b.and_(b.lshr(qh_r, const_vec(I8, 32, 2 * part)), const_vec(I8, 32, 3))
                per_row.append(b.or_(k_nibbles(h, ql, part // 2), b.shl(hi2, const_vec(I8, 32, 4))))
            _store_codes(h, sbase, 4 * half + part, per_row)
    allsc = _concat(b, [h.load(row, b.add(wo, c64(192)), vec(I8, 16)) for row in rows])
    _store_scales16(h, sbase, allsc, allsc, True)
    _store_d(h, sbase, rows, b.add(wo, c64(208)), _D6)


def _store_scales16(h, sbase, allsc, allpairs, signed):
    """Per-16 types: 16 scales a row (<128 x i8>, row r at lanes 16r..) as i16 pairs, and
    pairs (2i, 2i + 1) of `allpairs` (the scales again, or Q2_K's mins)."""
    b = h.b
    for g in range(16):
        _store(h, sbase, _SCALES6 + 32 * g, _pairs_i16(b, allsc, g, g, signed))
    for i in range(8):
        _store(h, sbase, _PAIRS6 + 32 * i, _pairs_i16(b, allpairs, 2 * i, 2 * i + 1, signed))


def _stage_q23_k(h, rows, bi, sbase, three):
    """Q3_K codes value + 4 (0..7) and 16 signed scales; Q2_K codes 0..3, 16 scales and 16
    mins (value = d * sc_g * q - dmin * m_g) and dmin. Sub-block 4hh + j holds elements
    hh*128 + j*32 + (0..31) in order, as every other type's."""
    b = h.b
    wo = b.mul(bi, c64(110 if three else 84))
    for hh in range(2):
        for j in range(4):
            _store_codes(h, sbase, 4 * hh + j, [_q23k_codes(h, row, wo, hh, j, three) for row in rows])
    if three:
        allsc = _concat(b, [b.trunc(_q3k_scales(h, row, wo), vec(I8, 16)) for row in rows])
        _store_scales16(h, sbase, allsc, allsc, True)
        _store_d(h, sbase, rows, b.add(wo, c64(108)), _D6)
        return
    raw = _concat(b, [h.load(row, wo, vec(I8, 16)) for row in rows])
    _store_scales16(h, sbase, b.and_(raw, const_vec(I8, 128, 15)), b.lshr(raw, const_vec(I8, 128, 4)), False)
    _store_d(h, sbase, rows, b.add(wo, c64(80)), _D6)
    _store_d(h, sbase, rows, b.add(wo, c64(82)), _DMIN6)


def _stage_iq4_xs(h, rows, bi, sbase):
    """IQ4_XS: each sub-block's table values (signed) as |value| and value (vpmaddubsw
    takes |w| against sign(x, w)), its 8 signed 6-bit scales (ls - 32) as i16 pairs, d."""
    b = h.b
    wo = b.mul(bi, c64(136))
    for ib in range(8):   # sub-block ib: an IQ4_NL-style 16 bytes of nibbles at 8 + 16 ib
        vals = [q32_values(h, row, b.add(wo, c64(6 + 16 * ib)), IQ4_NL) for row in rows]
        _store_codes(h, sbase, ib, [h.abs_i8(v) for v in vals])
        _store_codes(h, sbase, ib, vals, _SIGNS_XS)
    heads = _concat(b, [h.load(row, wo, vec(I8, 8)) for row in rows])   # d, scales_h, scales_l
    sc = _iq4_xs_scales(h, heads, [(r, ib % 8) for r in range(8) for ib in range(16)])   # 8 scales, repeated
    for j in range(8):
        _store(h, sbase, _SCALES_XS + 32 * j, _pairs_i16(b, sc, j, j, True))
    _store_d(h, sbase, rows, wo, _D_XS)


def _iq4_xs_scales(h, heads, lane):
    """IQ4_XS's signed 6-bit scales (ls - 32) at the lanes `lane` lists as (row, sub-block),
    from the 8 head bytes (d, scales_h, scales_l) of each row in `heads`."""
    b = h.b
    n = len(lane)
    lo = b.lshr(b.shuffle_vector(heads, heads, mask([8 * r + 4 + ib // 2 for r, ib in lane])),
                const_vec(I8, n, [4 * (ib % 2) for _, ib in lane]))
    hi = b.lshr(b.shuffle_vector(heads, heads, mask([8 * r + 2 + ib // 4 for r, ib in lane])),
                const_vec(I8, n, [2 * (ib % 4) for _, ib in lane]))
    return b.sub(b.or_(b.and_(lo, const_vec(I8, n, 15)), b.shl(b.and_(hi, const_vec(I8, n, 3)), const_vec(I8, n, 4))),
                 const_vec(I8, n, 32))


def _stage_iq4_xs_wide(h, rows, bi, sbase):
    """IQ4_XS for the 32-row kernels, as the i-quants with a scale per 32 values: codes
    value + 128 (1..241, u8 for vpdpbusd; the offset taken back against the token's sums),
    each sub-block's scale twice in the per-16 layout, d."""
    b = h.b
    wo = b.mul(bi, c64(136))
    for ib in range(8):
        vals = [q32_values(h, row, b.add(wo, c64(6 + 16 * ib)), IQ4_NL) for row in rows]
        _store_codes(h, sbase, ib, [b.xor(v, const_vec(I8, 32, -128)) for v in vals])   # + 128 mod 256
    heads = _concat(b, [h.load(row, wo, vec(I8, 8)) for row in rows])
    sc = _iq4_xs_scales(h, heads, [(r, g // 2) for r in range(8) for g in range(16)])
    _store_scales16(h, sbase, sc, sc, True)
    _store_d(h, sbase, rows, wo, _D6)


def _stage_iq(h, rows, bi, sbase, qt):
    """An i-quant as a per-16 type: codes value + 64 (0..126: one vpmaddubsw a vpmaddwd,
    the offset taken back against the token's per-16 sums as Q6_K's), the odd multipliers
    2 s + 1 of each 16 values as its 16 scales, and d times the type's factor."""
    b = h.b
    wo = b.mul(bi, c64(_IQ_BLOCK_BYTES[qt]))
    scales = [ir.Constant(vec(I8, 16), ir.Undefined)] * GROUP_ROWS
    for ib in range(8):
        subs = [_IQ_SUB[qt](h, row, wo, ib) for row in rows]
        _store_codes(h, sbase, ib, [b.add(h.sign_i8(grid, signs), const_vec(I8, 32, 64)) for grid, signs, *_ in subs])
        for r, (_, _, lo, hi, _) in enumerate(subs):
            for half, ls in enumerate((lo, hi)):
                scales[r] = b.insert_element(scales[r], b.trunc(_odd(h, ls), I8), ir.Constant(I32, 2 * ib + half))
    allsc = _concat(b, scales)
    _store_scales16(h, sbase, allsc, allsc, False)
    d = ir.Constant(vec(F32T, 8), ir.Undefined)
    for r, row in enumerate(rows):
        d = b.insert_element(d, h.load_f16(row, wo), ir.Constant(I32, r))
    _store(h, sbase, _D6, b.fmul(d, const_vec(F32T, 8, _IQ_FACTOR[qt])))


def _make_stage(qt, wide_layout=False):
    """The staging intrinsic of type qt; wide_layout: IQ4_XS's for the 32-row kernels."""
    def codegen(context, builder, sig, args):
        w = context.make_array(sig.args[0])(context, builder, args[0])
        rows = row_ptrs(builder, w, builder.mul(args[1], c64(GROUP_ROWS)), GROUP_ROWS, qt == Q4_K_X8)
        s = context.make_array(sig.args[3])(context, builder, args[3])
        h, sbase = IRHelpers(builder, target_features(context)), builder.bitcast(s.data, I8.as_pointer())
        if qt == Q6_K:
            _stage_q6_k(h, rows, args[2], sbase)
        elif qt in (Q3_K, Q2_K):
            _stage_q23_k(h, rows, args[2], sbase, qt == Q3_K)
        elif qt == IQ4_XS:
            (_stage_iq4_xs_wide if wide_layout else _stage_iq4_xs)(h, rows, args[2], sbase)
        elif qt in IQ_GEMM_TYPES:
            _stage_iq(h, rows, args[2], sbase, qt)
        else:
            _stage_q4_k(h, rows, args[2], sbase, qt == Q4_K_X8, qt == Q5_K)
        return context.get_dummy_value()

    @intrinsic
    def stage_block(typingctx, w, g, bi, s):
        """Stage block bi of rows 8g..8g+7 into the scratch s (see the module doc)."""
        return types.void(w, g, bi, s), codegen
    return stage_block


def _q4_k_quad(h, sbase, xs, bs, q5=False):
    """One block of 4 tokens against staged Q4_K (q5: Q5_K) rows: ([I], [M]) <8 x i32> a
    token. Q4_K's codes <= 15 add 8 vpmaddubsw results in i16, Q5_K's <= 31 four."""
    b = h.b
    isum = [ir.Constant(vec(I32, 8), [0] * 8)] * TOKENS
    n16 = 4 if q5 else 8
    for j in range(8):
        sc = h.load(sbase, c64(_SCALES + 32 * j), vec(I16, 16))
        for k0 in range(0, 8, n16):
            s16 = [None] * TOKENS
            for k in range(k0, k0 + n16):
                wv = h.load(sbase, c64(_CODES + 256 * j + 32 * k), vec(I8, 32))
                for ti in range(TOKENS):
                    p = h.maddubs(wv, _bcast(h, xs[ti], 32 * j + 4 * k, I8))
                    s16[ti] = p if s16[ti] is None else b.add(s16[ti], p)
            isum = [b.add(isum[ti], h.madd_i16(s16[ti], sc)) for ti in range(TOKENS)]
    msum = [ir.Constant(vec(I32, 8), [0] * 8)] * TOKENS
    for i in range(4):
        mn = h.load(sbase, c64(_MINS + 32 * i), vec(I16, 16))
        msum = [b.add(msum[ti], h.madd_i16(mn, _bcast(h, bs[ti], 4 * i, I16))) for ti in range(TOKENS)]
    return isum, msum


def _per16_quad(h, sbase, xs, bs, qt):
    """One block of 4 tokens against staged per-16 rows: ([I], [M]) <8 x i32> a token.
    Q6_K, Q3_K: I = the exact sum_g scale_g * ((q - offset) . x)_g (two vpmaddubsw add in
    i16: <= 2 * 2*63*128), M None; the i-quants: the same with codes up to 126, so each
    vpmaddubsw goes to its own vpmaddwd; Q2_K: I = sum_g scale_g (q . x)_g, M = sum_g
    min_g sum_g(x)."""
    b = h.b
    isum = [ir.Constant(vec(I32, 8), [0] * 8)] * TOKENS
    pair = qt not in IQ_GEMM_TYPES
    for j in range(8):
        for kp in range(4):
            sc = h.load(sbase, c64(_SCALES6 + 32 * (2 * j + kp // 2)), vec(I16, 16))
            s16 = [None] * TOKENS
            for k in (2 * kp, 2 * kp + 1):
                wv = h.load(sbase, c64(_CODES + 256 * j + 32 * k), vec(I8, 32))
                for ti in range(TOKENS):
                    p = h.maddubs(wv, _bcast(h, xs[ti], 32 * j + 4 * k, I8))
                    if not pair:
                        isum[ti] = b.add(isum[ti], h.madd_i16(p, sc))
                    else:
                        s16[ti] = p if s16[ti] is None else b.add(s16[ti], p)
            if pair:
                isum = [b.add(isum[ti], h.madd_i16(s16[ti], sc)) for ti in range(TOKENS)]
    if qt == Q2_K:   # the min pairs against the token's per-16 sums
        msum = [ir.Constant(vec(I32, 8), [0] * 8)] * TOKENS
        for i in range(8):
            mp = h.load(sbase, c64(_PAIRS6 + 32 * i), vec(I16, 16))
            msum = [b.add(msum[ti], h.madd_i16(mp, _bcast(h, bs[ti], 16 + 4 * i, I16))) for ti in range(TOKENS)]
        return isum, msum
    shift = const_vec(I32, 8, _CODE_OFFSET[qt].bit_length() - 1)
    for i in range(8):    # minus offset * sum_g scale_g * (the token's sum over group g)
        sp = h.load(sbase, c64(_PAIRS6 + 32 * i), vec(I16, 16))
        isum = [b.sub(isum[ti], b.shl(h.madd_i16(sp, _bcast(h, bs[ti], 16 + 4 * i, I16)), shift))
                for ti in range(TOKENS)]
    return isum, None


def _iq4_xs_quad(h, sbase, xs):
    """One block of 4 tokens against staged IQ4_XS rows: [I] <8 x i32> a token, sum_j
    scale_j (v . x)_j with |v| . sign(x, v) (one vpmaddubsw a vpmaddwd: <= 2 * 127 * 127)."""
    b = h.b
    isum = [ir.Constant(vec(I32, 8), [0] * 8)] * TOKENS
    for j in range(8):
        sc = h.load(sbase, c64(_SCALES_XS + 32 * j), vec(I16, 16))
        for k in range(8):
            wv = h.load(sbase, c64(_CODES + 256 * j + 32 * k), vec(I8, 32))
            sw = h.load(sbase, c64(_SIGNS_XS + 256 * j + 32 * k), vec(I8, 32))
            for ti in range(TOKENS):
                p = h.maddubs(wv, h.sign_i8(_bcast(h, xs[ti], 32 * j + 4 * k, I8), sw))
                isum[ti] = b.add(isum[ti], h.madd_i16(p, sc))
    return isum


def _bcast(h, p, off, elem):
    """The 4 bytes at p + off in all 8 lanes (vpbroadcastd from memory), as i8 or i16 lanes."""
    v = h.splat(h.load(p, c64(off), I32), 8)
    return h.b.bitcast(v, vec(elem, 32 if elem == I8 else 16))


def _make_tokens(qt):
    def codegen(context, builder, sig, args):
        arrs = [context.make_array(ty)(context, builder, a) for ty, a in zip(sig.args[:4], args[:4])]
        s, xq, xd, xb = arrs
        acc = context.make_array(sig.args[6])(context, builder, args[6])
        bi, t_lo, t_hi = args[4], args[5], args[7]
        b = builder
        h = IRHelpers(b, target_features(context))
        i8p = I8.as_pointer()
        sbase = b.bitcast(s.data, i8p)

        # block-major activations: token t of block bi at bi * stride0 + t * stride1
        xrow, drow, brow = (row_pointer(b, a, bi) for a in (xq, xd, xb))
        arow = row_pointer(b, acc)
        per16 = qt in (Q6_K, Q3_K, Q2_K) or qt in IQ_GEMM_TYPES
        d = h.load(sbase, c64(_D6 if per16 else _D_XS if qt == IQ4_XS else _D), vec(F32T, 8))
        dmin = (h.load(sbase, c64(_DMIN6 if qt == Q2_K else _DMIN), vec(F32T, 8))
                if qt in (Q4_K, Q4_K_X8, Q5_K, Q2_K) else None)

        def quad(i, _):
            ts = [b.add(b.add(t_lo, i), c64(ti)) for ti in range(TOKENS)]
            xs, bs = [xrow(t) for t in ts], [brow(t) for t in ts]
            if per16:
                isum, msum = _per16_quad(h, sbase, xs, bs, qt)
            elif qt == IQ4_XS:
                isum, msum = _iq4_xs_quad(h, sbase, xs), None
            else:
                isum, msum = _q4_k_quad(h, sbase, xs, bs, qt == Q5_K)
            for ti in range(TOKENS):
                dx = h.load(drow(ts[ti]), c64(0), F32T)
                ap = arow(ts[ti])
                a = h.load(ap, c64(0), vec(F32T, 8))
                _store(h, ap, 0, h.fma(b.fmul(d, h.splat(dx, 8)), b.sitofp(isum[ti], vec(F32T, 8)), a))
                if msum is not None:
                    m = h.load(ap, c64(32), vec(F32T, 8))
                    m = h.fma(b.fmul(dmin, h.splat(b.fneg(dx), 8)), b.sitofp(msum[ti], vec(F32T, 8)), m)
                    _store(h, ap, 32, m)
            return []
        counted_loop(b, b.sub(t_hi, t_lo), TOKENS, [], quad, "kq_tok")
        return context.get_dummy_value()

    @intrinsic
    def tokens(typingctx, s, xq, xd, xb, bi, t_lo, acc, t_hi):
        """For tokens t_lo..t_hi (a multiple of TOKENS apart): acc[t] += block bi of the
        staged rows . token t (acc[t, :8] the scaled dots, acc[t, 8:] Q4_K's min terms)."""
        return types.void(s, xq, xd, xb, bi, t_lo, acc, t_hi), codegen
    return tokens


_stage_q4k, _stage_q4k_x8, _tokens_q4k = _make_stage(Q4_K), _make_stage(Q4_K_X8), _make_tokens(Q4_K)
_stage_q6k, _tokens_q6k = _make_stage(Q6_K), _make_tokens(Q6_K)
_stage_q5k, _tokens_q5k = _make_stage(Q5_K), _make_tokens(Q5_K)
_stage_q3k, _tokens_q3k = _make_stage(Q3_K), _make_tokens(Q3_K)
_stage_q2k, _tokens_q2k = _make_stage(Q2_K), _make_tokens(Q2_K)
_stage_iq4xs, _tokens_iq4xs = _make_stage(IQ4_XS), _make_tokens(IQ4_XS)
_stage_iq2xxs, _tokens_iq2xxs = _make_stage(IQ2_XXS), _make_tokens(IQ2_XXS)
_stage_iq2xs, _tokens_iq2xs = _make_stage(IQ2_XS), _make_tokens(IQ2_XS)
_stage_iq2s, _tokens_iq2s = _make_stage(IQ2_S), _make_tokens(IQ2_S)
_stage_iq3xxs, _tokens_iq3xxs = _make_stage(IQ3_XXS), _make_tokens(IQ3_XXS)
_stage_iq3s, _tokens_iq3s = _make_stage(IQ3_S), _make_tokens(IQ3_S)
_merge_q4k = wide.make_merge(wide.StagedLayout(_CODES, _SCALES, _MINS, _D, _DMIN, False, SCRATCH_BYTES))
_merge_per16 = wide.make_merge(wide.StagedLayout(_CODES, _SCALES6, _PAIRS6, _D6, _DMIN6, True, SCRATCH_BYTES))
_wide_q4k, _wide_q2k = wide.make_tokens("q4k"), wide.make_tokens("q2k")
_wide_q6k, _wide_q3k = wide.make_tokens("per16", _CODE_OFFSET[Q6_K]), wide.make_tokens("per16", _CODE_OFFSET[Q3_K])
_wide_iq = wide.make_tokens("per16", _CODE_OFFSET[IQ3_S])   # every i-quant's offset is 64
_wide_iq32 = wide.make_tokens("per32", _CODE_OFFSET[IQ3_S])  # one scale per 32 values (each staged twice)
_stage_iq4xs_wide, _wide_iq4xs = _make_stage(IQ4_XS, wide_layout=True), wide.make_tokens("per32", 128)


@njit(**_JIT)
def _wide_block(w, qt, g, bi, s4, sw, xq, xd, xb, t0, acc, t1):
    """Block bi of row groups g..g + 3 against tokens t0..t1 (gemm_kquant_wide)."""
    if _WIDE and _HAS_Q4_K and qt == Q4_K:
        for q in range(wide.GROUPS):
            _stage_q4k(w, g + q, bi, s4[q])
        _merge_q4k(s4, sw)
        _wide_q4k(sw, xq, xd, xb, bi, t0, acc, t1)
    elif _WIDE and _HAS_Q4_K_X8 and qt == Q4_K_X8:
        for q in range(wide.GROUPS):
            _stage_q4k_x8(w, g + q, bi, s4[q])
        _merge_q4k(s4, sw)
        _wide_q4k(sw, xq, xd, xb, bi, t0, acc, t1)
    elif _WIDE and _HAS_Q5_K and qt == Q5_K:
        for q in range(wide.GROUPS):
            _stage_q5k(w, g + q, bi, s4[q])
        _merge_q4k(s4, sw)
        _wide_q4k(sw, xq, xd, xb, bi, t0, acc, t1)
    elif _WIDE and _HAS_Q6_K and qt == Q6_K:
        for q in range(wide.GROUPS):
            _stage_q6k(w, g + q, bi, s4[q])
        _merge_per16(s4, sw)
        _wide_q6k(sw, xq, xd, xb, bi, t0, acc, t1)
    elif _WIDE and _HAS_Q3_K and qt == Q3_K:
        for q in range(wide.GROUPS):
            _stage_q3k(w, g + q, bi, s4[q])
        _merge_per16(s4, sw)
        _wide_q3k(sw, xq, xd, xb, bi, t0, acc, t1)
    elif _WIDE and _HAS_Q2_K and qt == Q2_K:
        for q in range(wide.GROUPS):
            _stage_q2k(w, g + q, bi, s4[q])
        _merge_per16(s4, sw)
        _wide_q2k(sw, xq, xd, xb, bi, t0, acc, t1)
    elif _WIDE and _HAS_IQ2_XXS and qt == IQ2_XXS:
        for q in range(wide.GROUPS):
            _stage_iq2xxs(w, g + q, bi, s4[q])
        _merge_per16(s4, sw)
        _wide_iq32(sw, xq, xd, xb, bi, t0, acc, t1)
    elif _WIDE and _HAS_IQ2_XS and qt == IQ2_XS:
        for q in range(wide.GROUPS):
            _stage_iq2xs(w, g + q, bi, s4[q])
        _merge_per16(s4, sw)
        _wide_iq(sw, xq, xd, xb, bi, t0, acc, t1)
    elif _WIDE and _HAS_IQ2_S and qt == IQ2_S:
        for q in range(wide.GROUPS):
            _stage_iq2s(w, g + q, bi, s4[q])
        _merge_per16(s4, sw)
        _wide_iq(sw, xq, xd, xb, bi, t0, acc, t1)
    elif _WIDE and _HAS_IQ3_XXS and qt == IQ3_XXS:
        for q in range(wide.GROUPS):
            _stage_iq3xxs(w, g + q, bi, s4[q])
        _merge_per16(s4, sw)
        _wide_iq32(sw, xq, xd, xb, bi, t0, acc, t1)
    elif _WIDE and _HAS_IQ3_S and qt == IQ3_S:
        for q in range(wide.GROUPS):
            _stage_iq3s(w, g + q, bi, s4[q])
        _merge_per16(s4, sw)
        _wide_iq32(sw, xq, xd, xb, bi, t0, acc, t1)
    elif _WIDE and _HAS_IQ4_XS and qt == IQ4_XS:
        for q in range(wide.GROUPS):
            _stage_iq4xs_wide(w, g + q, bi, s4[q])
        _merge_per16(s4, sw)
        _wide_iq4xs(sw, xq, xd, xb, bi, t0, acc, t1)


@njit(**_JIT)
def _gemm_wide(w, qt, g0, g1, xq, xd, xb, out):
    """_gemm_rows' groups g0..g1 in fours with the 32-row kernels where this CPU and type
    have them; returns the first group left for the 8-row kernel."""
    if not _WIDE:
        return g0
    n_tok = out.shape[0]
    nb, n_pad = xd.shape
    s4 = np.empty((wide.GROUPS, SCRATCH_BYTES), np.uint8)
    sw = np.empty(wide.SCRATCH_BYTES, np.uint8)
    acc = np.empty((n_pad, wide.ACC_COLS), np.float32)
    g = g0
    while g + wide.GROUPS <= g1:
        for t0 in range(0, n_pad, WIDE_TILE_TOKENS):
            t1 = min(t0 + WIDE_TILE_TOKENS, n_pad)
            acc[t0:t1] = 0.0
            for bi in range(nb):
                _wide_block(w, qt, g, bi, s4, sw, xq, xd, xb, t0, acc, t1)
            for t in range(t0, min(t1, n_tok)):
                for k in range(wide.ROWS):
                    out[t, GROUP_ROWS * g + k] = acc[t, k] + acc[t, wide.ROWS + k]
        g += wide.GROUPS
    return g


@njit(**_JIT)
def _gemm_rows(w, qt, g0, g1, xq, xd, xb, tile, out):
    """out[t, 8g + k] for row groups g0 <= g < g1 and every token of out, `tile` tokens at
    a time: each staged block serves that many tokens, and the tile's accumulators
    (64 bytes a token) stay in L1."""
    g0 = _gemm_wide(w, qt, g0, g1, xq, xd, xb, out)
    n_tok = out.shape[0]
    nb, n_pad = xd.shape
    s = np.empty(SCRATCH_BYTES, np.uint8)
    acc = np.empty((n_pad, ACC_COLS), np.float32)
    for t0 in range(0, n_pad, tile):
        t1 = min(t0 + tile, n_pad)
        for g in range(g0, g1):
            acc[t0:t1] = 0.0
            for bi in range(nb):
                if _HAS_Q4_K and qt == Q4_K:
                    _stage_q4k(w, g, bi, s)
                    _tokens_q4k(s, xq, xd, xb, bi, t0, acc, t1)
                elif _HAS_Q4_K_X8 and qt == Q4_K_X8:   # the same staged bytes from the interleaved copy
                    _stage_q4k_x8(w, g, bi, s)
                    _tokens_q4k(s, xq, xd, xb, bi, t0, acc, t1)
                elif _HAS_Q5_K and qt == Q5_K:
                    _stage_q5k(w, g, bi, s)
                    _tokens_q5k(s, xq, xd, xb, bi, t0, acc, t1)
                elif _HAS_Q6_K and qt == Q6_K:
                    _stage_q6k(w, g, bi, s)
                    _tokens_q6k(s, xq, xd, xb, bi, t0, acc, t1)
                elif _HAS_Q3_K and qt == Q3_K:
                    _stage_q3k(w, g, bi, s)
                    _tokens_q3k(s, xq, xd, xb, bi, t0, acc, t1)
                elif _HAS_Q2_K and qt == Q2_K:
                    _stage_q2k(w, g, bi, s)
                    _tokens_q2k(s, xq, xd, xb, bi, t0, acc, t1)
                elif _HAS_IQ4_XS and qt == IQ4_XS:
                    _stage_iq4xs(w, g, bi, s)
                    _tokens_iq4xs(s, xq, xd, xb, bi, t0, acc, t1)
                elif _HAS_IQ2_XXS and qt == IQ2_XXS:
                    _stage_iq2xxs(w, g, bi, s)
                    _tokens_iq2xxs(s, xq, xd, xb, bi, t0, acc, t1)
                elif _HAS_IQ2_XS and qt == IQ2_XS:
                    _stage_iq2xs(w, g, bi, s)
                    _tokens_iq2xs(s, xq, xd, xb, bi, t0, acc, t1)
                elif _HAS_IQ2_S and qt == IQ2_S:
                    _stage_iq2s(w, g, bi, s)
                    _tokens_iq2s(s, xq, xd, xb, bi, t0, acc, t1)
                elif _HAS_IQ3_XXS and qt == IQ3_XXS:
                    _stage_iq3xxs(w, g, bi, s)
                    _tokens_iq3xxs(s, xq, xd, xb, bi, t0, acc, t1)
                elif _HAS_IQ3_S and qt == IQ3_S:
                    _stage_iq3s(w, g, bi, s)
                    _tokens_iq3s(s, xq, xd, xb, bi, t0, acc, t1)
            for t in range(t0, min(t1, n_tok)):
                for k in range(GROUP_ROWS):
                    out[t, GROUP_ROWS * g + k] = acc[t, k] + acc[t, GROUP_ROWS + k]


@njit(inline="always", **_JIT)
def _segment(xq, xd, xb, p0, p1):
    """Packed rows p0..p1 of `pack_segments` output in the kernel's layout."""
    nb = xd.shape[1]
    n = p1 - p0
    return xq[p0:p1].reshape(nb, n, 256), xd[p0:p1].reshape(nb, n), xb[p0:p1].reshape(nb, n, 12)


def matmul_rows(w_raw: np.ndarray, qt: int, g0: int, g1: int, packed, out: np.ndarray) -> None:
    """Row groups g0..g1 (rows 8 g0 .. 8 g1) of out (n_tok, n_rows) = activations . w for
    a GEMM_TYPES matrix with rows % 8 == 0 and `pack_activations` output. Releases the GIL."""
    xq, xd, xb = packed
    _gemm_rows(w_raw, qt, g0, g1, xq, xd, xb, TILE_TOKENS, out)


# the parallel region over 1 to 3 matrices, per type set: DRIVERS.run(ws, qts, packed, outs, n_threads)
DRIVERS = gemm_parallel.Drivers(globals(), ("_wide_block", "_gemm_wide", "_gemm_rows"), {Q4_K: "Q4_K", Q4_K_X8: "Q4_K_X8", Q5_K: "Q5_K",
                                                           Q6_K: "Q6_K", Q3_K: "Q3_K", Q2_K: "Q2_K",
                                                           IQ4_XS: "IQ4_XS", IQ2_XXS: "IQ2_XXS", IQ2_XS: "IQ2_XS",
                                                           IQ2_S: "IQ2_S", IQ3_XXS: "IQ3_XXS", IQ3_S: "IQ3_S"},
                             TILE_TOKENS, "kquant_wide" if _WIDE else "kquant")
