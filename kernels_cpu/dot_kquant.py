"""Row dots and row dequantization for the 256-element K-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS.

Per super-block, the sub-blocks' integer dots are scaled by their 6- or 4-bit scales in
i32 lanes (vpmaddwd), then one fma with d * dx: ggml_vec_dot's order. Q4_K matrices with
rows in eights take the four-rows-in-lanes kernels of dot_q4k_x8.py instead.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .dot_q32 import KVALUES_IQ4NL, nibbles32
from .ir_helpers import (F32T, I8, I16, I32, X8_BLOCK, IRHelpers, array_ptrs, c64, const_vec, counted_loop,
                         make_deq_intrinsic, make_row_intrinsic, make_tokens_intrinsic, mask, prefetch_row_streams,
                         row_loop, store, target_features, vec, ROWS)


def q4k_block_bytes(x8: bool) -> int:
    return X8_BLOCK if x8 else 144


def q4k_qs32(h, wrow, wo, c, x8):
    """qs bytes 32c..32c+32 of the Q4_K block at wrow + wo, in either layout: <32 x i8>."""
    b = h.b
    if not x8:
        return h.load(wrow, b.add(wo, c64(16 + 32 * c)), vec(I8, 32))
    lo = h.load(wrow, b.add(wo, c64(128 + 256 * c)), vec(I8, 16))
    hi = h.load(wrow, b.add(wo, c64(256 + 256 * c)), vec(I8, 16))
    return b.shuffle_vector(lo, hi, mask(range(32)))


def q4k_scales_vec(h, wrow, wo):
    """The 12 packed scale bytes -> <16 x i8>: 8 scales, then 8 mins (ggml's utmp trick
    on one <4 x i32> instead of scalar registers)."""
    b = h.b
    v = h.load(wrow, b.add(wo, c64(4)), vec(I32, 4))     # u0 u1 u2 (+4 bytes of qs)
    c = lambda x: const_vec(I32, 4, x)  # noqa: E731
    a = b.and_(v, c(0x3F3F3F3F))                                       # t0 t2 . .
    hi2 = b.shl(b.and_(b.lshr(v, c(6)), c(0x03030303)), c(4))          # from u0, u1
    u2 = b.shuffle_vector(v, v, mask([2, 2, 2, 2]))
    lo4 = b.and_(b.lshr(u2, const_vec(I32, 4, [0, 4, 0, 0])), c(0x0F0F0F0F))
    t13 = b.or_(lo4, hi2)                                              # t1 t3 . .
    return b.bitcast(b.shuffle_vector(a, t13, mask([0, 4, 1, 5])), vec(I8, 16))


def q4k_scales_heads(h, v):
    """n rows' 16-byte heads as <4n x i32> (row k's dm u0 u1 u2 in lanes 4k..4k+3) ->
    <16n x i8>: row k's 8 scales then 8 mins at bytes 16k.. (q4k_scales_vec's decode on
    all the rows at once)."""
    b = h.b
    n4 = v.type.count
    rows = range(n4 // 4)
    c = lambda x: const_vec(I32, n4, x)  # noqa: E731
    a = b.and_(v, c(0x3F3F3F3F))                                         # . t0 t2 .
    hi2 = b.shl(b.and_(b.lshr(v, c(6)), c(0x03030303)), c(4))            # . from u0, u1 .
    u2 = b.shuffle_vector(v, v, mask([4 * k + 3 for k in rows for _ in range(4)]))
    lo4 = b.and_(b.lshr(u2, c([0, 0, 4, 0] * len(rows))), c(0x0F0F0F0F))
    t13 = b.or_(lo4, hi2)                                                # . t1 t3 .
    pick = [i for k in rows for i in (4 * k + 1, n4 + 4 * k + 1, 4 * k + 2, n4 + 4 * k + 2)]
    return b.bitcast(b.shuffle_vector(a, t13, mask(pick)), vec(I8, 4 * n4))


def _q4k_scales(h, wrow, wo):
    """12 packed bytes -> (<8 x i32> scales, <8 x i32> mins)."""
    b = h.b
    sm = q4k_scales_vec(h, wrow, wo)
    return (b.zext(b.shuffle_vector(sm, sm, mask(range(8))), vec(I32, 8)),
            b.zext(b.shuffle_vector(sm, sm, mask(range(8, 16))), vec(I32, 8)))


def _q45k_isum(h, wrow, wo, xq, xo, sm, five):
    """Q4_K / Q5_K block: <8 x i32> of sum_j scale_j * (q_j . x_j), sub-block j's 32 products
    pairwise-summed (vpmaddubsw) then scaled and paired (vpmaddwd): the lanes of
    ggml_vec_dot_q4_K / q5_K. sm: q4k_scales_vec's bytes, or (32 of them) those bytes in
    both 128-bit halves."""
    b = h.b
    qs0 = 48 if five else 16
    qh = h.load(wrow, b.add(wo, c64(16)), vec(I8, 32)) if five else None
    sc2 = sm if sm.type.count == 32 else b.shuffle_vector(sm, sm, mask(list(range(16)) * 2))   # scales in both lanes
    isum = ir.Constant(vec(I32, 8), [0] * 8)
    for c in range(4):
        q = h.load(wrow, b.add(wo, c64(qs0 + 32 * c)), vec(I8, 32))
        for hi in range(2):
            j = 2 * c + hi
            v = k_nibbles(h, q, hi)
            if five:     # bit j of qh[l] is the 5th bit of element l of sub-block j
                hb = b.and_(b.lshr(qh, const_vec(I8, 32, j)), const_vec(I8, 32, 1))
                v = b.or_(v, b.shl(hb, const_vec(I8, 32, 4)))
            xv = h.load(xq, b.add(xo, c64(32 * j)), vec(I8, 32))
            p16 = h.maddubs(v, xv)                               # pairs <= 2*31*128
            isum = b.add(isum, h.madd_i16(p16, h.bcast_u8_as_i16(sc2, j)))
    return isum


def _make_body_q45_k(five: bool):
    """Q4_K / Q5_K block dot in ggml_vec_dot's order (Q4_K matrices with rows % 8 == 0
    take `_q4_k_rows4_lanes`)."""
    bs = 176 if five else 144

    def body(h, wrow, xq, xd, xs, bi, acc):
        b = h.b
        wo = b.mul(bi, c64(bs))
        dx = h.load(xd, b.mul(bi, c64(4)), F32T)
        d = b.fmul(h.load_f16(wrow, wo), dx)
        dmin = b.fmul(h.load_f16(wrow, b.add(wo, c64(2))), dx)
        sm = q4k_scales_vec(h, wrow, wo)
        mn = b.zext(b.shuffle_vector(sm, sm, mask(range(8, 16))), vec(I32, 8))
        bs32 = h.pairs(h.load(xs, b.mul(bi, c64(64)), vec(I32, 16)))     # per-32 sums of x
        msum = b.mul(mn, bs32)
        isum = _q45k_isum(h, wrow, wo, xq, b.mul(bi, c64(256)), sm, five)
        if five:
            acc = h.fma(h.splat(d, 8), b.sitofp(isum, vec(F32T, 8)), acc)
            return h.fma(h.splat(b.fneg(dmin), 8), b.sitofp(msum, vec(F32T, 8)), acc)
        acc, accm = acc
        # Q4_K as llama.cpp's vec_dot: min terms summed in pairs into a separate <4 x float>
        acc = h.fma(h.splat(d, 8), b.sitofp(isum, vec(F32T, 8)), acc)
        accm = h.fma(h.splat(b.fneg(dmin), 4), b.sitofp(h.pairs(msum), vec(F32T, 4)), accm)
        return acc, accm
    return body


def k_nibbles(h, q, hi):
    b = h.b
    return b.and_(q, const_vec(I8, 32, 15)) if hi == 0 else b.lshr(q, const_vec(I8, 32, 4))


def _iq4xs_scale(h, wrow, wo, ib):
    """Signed scale (ls - 32) of sub-block ib of an IQ4_XS block, as i16."""
    b = h.b
    sh = b.zext(h.load(wrow, b.add(wo, c64(2)), I16), I32)
    sl = b.zext(h.load(wrow, b.add(wo, c64(4 + ib // 2)), I8), I32)
    lo = b.and_(b.lshr(sl, ir.Constant(I32, 4 * (ib % 2))), ir.Constant(I32, 15))
    hi = b.shl(b.and_(b.lshr(sh, ir.Constant(I32, 2 * ib)), ir.Constant(I32, 3)), ir.Constant(I32, 4))
    return b.trunc(b.sub(b.or_(lo, hi), ir.Constant(I32, 32)), I16)


def _body_iq4_xs(h, wrow, xq, xd, xs, bi, acc):
    b = h.b
    wo = b.mul(bi, c64(136))
    d = b.fmul(h.load_f16(wrow, wo), h.load(xd, b.mul(bi, c64(4)), F32T))
    xo = b.mul(bi, c64(256))
    isum = ir.Constant(vec(I32, 8), [0] * 8)
    for ib in range(8):
        v = h.lut16(nibbles32(h, h.load(wrow, b.add(wo, c64(8 + 16 * ib)), vec(I8, 16))), KVALUES_IQ4NL)
        xv = h.load(xq, b.add(xo, c64(32 * ib)), vec(I8, 32))
        p16 = h.maddubs(h.abs_i8(v), h.sign_i8(xv, v))              # pairs <= 2*127*127
        isum = b.add(isum, h.madd_i16(p16, h.splat(_iq4xs_scale(h, wrow, wo, ib), 16)))
    return h.fma(h.splat(d, 8), b.sitofp(isum, vec(F32T, 8)), acc)


def _q6_k_values(h, ql0, ql1, qh, gq):
    """Unsigned 6-bit values (0..63) of quarter gq of a Q6_K half-block, as <32 x i8>."""
    b = h.b
    ql = ql0 if gq & 1 == 0 else ql1
    low = b.and_(ql, const_vec(I8, 32, 15)) if gq < 2 else b.lshr(ql, const_vec(I8, 32, 4))
    # bits 2gq, 2gq+1 of qh moved to bits 4, 5: one shift and one mask
    sh = 4 - 2 * gq
    hq = qh if sh == 0 else (b.shl(qh, const_vec(I8, 32, sh)) if sh > 0 else b.lshr(qh, const_vec(I8, 32, -sh)))
    return b.or_(low, b.and_(hq, const_vec(I8, 32, 0x30)))


def _q6_k_isum_512(h, wrow, wo, xq, xo, sc16):
    """The scaled products of one Q6_K block, two quarters per 512-bit vector (AVX512-BW):
    <8 x i32> equal to the 256-bit loop's lanes summed (exact integers: the same bits).
    A 64-byte load holds ql for quarters gq and gq + 1; qh is loaded into both halves and
    shifted per half; one word permute gives the four 16-element groups' scales."""
    b = h.b
    v64, v32i16, v16i32 = vec(I8, 64), vec(I16, 32), vec(I32, 16)
    isum = ir.Constant(v16i32, [0] * 16)
    for hh in range(2):
        ql = h.load(wrow, b.add(wo, c64(64 * hh)), v64)                 # quarters 0, 1 (ql0 ql1)
        qh32 = h.load(wrow, b.add(wo, c64(128 + 32 * hh)), vec(I8, 32))
        qh = b.shuffle_vector(qh32, qh32, mask(list(range(32)) * 2))
        for pq in range(2):                  # quarters 2pq (low half) and 2pq + 1 (high half)
            low = b.and_(ql, const_vec(I8, 64, 15)) if pq == 0 else b.lshr(ql, const_vec(I8, 64, 4))
            # bits 2gq, 2gq + 1 of qh to bits 4, 5 (gq = 0..3: shifts 4, 2, 0, -2), in 16-bit
            # lanes (one vpsllvw / vpsrlvw; x86 has no per-byte shift): the bits that cross
            # into the neighbouring byte land outside the 0x30 mask
            qh16 = b.bitcast(qh, v32i16)
            if pq == 0:
                hq = b.shl(qh16, const_vec(I16, 32, [4] * 16 + [2] * 16))
            else:
                hq = b.lshr(qh16, const_vec(I16, 32, [0] * 16 + [2] * 16))
            q = b.or_(low, b.and_(b.bitcast(hq, v64), const_vec(I8, 64, 0x30)))
            xv = h.load(xq, b.add(xo, c64(hh * 128 + pq * 64)), v64)
            p16 = h.x86("llvm.x86.avx512.pmaddubs.w.512", v32i16, [q, xv])   # pairs <= 2*63*128
            g = 8 * hh + 4 * pq                  # the four groups of 16 in this vector
            sc = b.shuffle_vector(sc16, sc16, mask([g + k for k in range(4) for _ in range(8)]))
            isum = b.add(isum, h.x86("llvm.x86.avx512.pmaddw.d.512", v16i32, [p16, sc]))
    return b.add(h.half(isum, 0), h.half(isum, 1))


def _body_q6_k(h, wrow, xq, xd, xs, bi, acc):
    b = h.b
    wo = b.mul(bi, c64(210))
    d = b.fmul(h.load_f16_splat(wrow, b.add(wo, c64(208)), 8), h.splat(h.load(xd, b.mul(bi, c64(4)), F32T), 8))
    sc16 = b.sext(h.load(wrow, b.add(wo, c64(192)), vec(I8, 16)), vec(I16, 16))
    bs16 = h.narrow_i32_i16(h.load(xs, b.mul(bi, c64(64)), vec(I32, 16)))   # |sums| <= 16*128
    # lane k: 32 * (sc_2k * sum_2k(x) + sc_2k+1 * sum_2k+1(x)), as llama.cpp's q8sclsub
    isum = b.sub(ir.Constant(vec(I32, 8), [0] * 8), b.shl(h.madd_i16(sc16, bs16), const_vec(I32, 8, 5)))
    xo = b.mul(bi, c64(256))
    if h.avx512bw:
        isum = b.add(isum, _q6_k_isum_512(h, wrow, wo, xq, xo, sc16))
        return h.fma(d, b.sitofp(isum, vec(F32T, 8)), acc)
    # scales as i16 with both 128-bit halves holding the same 8: one vpshufb per group pair
    sc_lo = b.shuffle_vector(sc16, sc16, mask(list(range(8)) * 2))
    sc_hi = b.shuffle_vector(sc16, sc16, mask(list(range(8, 16)) * 2))
    for hh in range(2):
        qh = h.load(wrow, b.add(wo, c64(128 + 32 * hh)), vec(I8, 32))
        ql0 = h.load(wrow, b.add(wo, c64(64 * hh)), vec(I8, 32))
        ql1 = h.load(wrow, b.add(wo, c64(64 * hh + 32)), vec(I8, 32))
        src = sc_lo if hh == 0 else sc_hi
        for gq in range(4):
            q = _q6_k_values(h, ql0, ql1, qh, gq)
            xv = h.load(xq, b.add(xo, c64(hh * 128 + gq * 32)), vec(I8, 32))
            p16 = h.maddubs(q, xv)              # pairs <= 2*63*128; lanes 0..7: group g, 8..15: g+1
            g = gq * 2                          # within this half's 8 scales
            isum = b.add(isum, h.madd_i16(p16, h.pick_i16_halves(src, g, g + 1)))
    return h.fma(d, b.sitofp(isum, vec(F32T, 8)), acc)


def _q3k_scales(h, wrow, wo):
    """16 signed 6-bit Q3_K scales from the 12 bytes at wo + 96, as <16 x i32> (ggml's aux trick)."""
    b = h.b
    a0 = h.load(wrow, b.add(wo, c64(96)), I32)
    a1 = h.load(wrow, b.add(wo, c64(100)), I32)
    tmp = h.load(wrow, b.add(wo, c64(104)), I32)
    c = lambda v: ir.Constant(I32, v)  # noqa: E731
    k1, k2 = c(0x03030303), c(0x0F0F0F0F)
    s2 = b.or_(b.and_(b.lshr(a0, c(4)), k2), b.shl(b.and_(b.lshr(tmp, c(4)), k1), c(4)))
    s3 = b.or_(b.and_(b.lshr(a1, c(4)), k2), b.shl(b.and_(b.lshr(tmp, c(6)), k1), c(4)))
    s0 = b.or_(b.and_(a0, k2), b.shl(b.and_(tmp, k1), c(4)))
    s1 = b.or_(b.and_(a1, k2), b.shl(b.and_(b.lshr(tmp, c(2)), k1), c(4)))
    v = ir.Constant(vec(I32, 4), [0] * 4)
    for i, t in enumerate((s0, s1, s2, s3)):
        v = b.insert_element(v, t, ir.Constant(I32, i))
    return b.sub(b.zext(b.bitcast(v, vec(I8, 16)), vec(I32, 16)), const_vec(I32, 16, 32))


def _q23k_codes(h, wrow, wo, hh, j, three):
    """Unsigned codes of elements hh*128 + j*32 + (0..31): Q2_K 0..3; Q3_K value + 4 (0..7)."""
    b = h.b
    qs0 = 32 if three else 16
    q = h.load(wrow, b.add(wo, c64(qs0 + 32 * hh)), vec(I8, 32))
    v = b.and_(b.lshr(q, const_vec(I8, 32, 2 * j)), const_vec(I8, 32, 3))
    if three:   # hmask bit set: value = q, else q - 4; code = value + 4
        hm = h.load(wrow, wo, vec(I8, 32))
        bit = b.and_(b.lshr(hm, const_vec(I8, 32, 4 * hh + j)), const_vec(I8, 32, 1))
        v = b.or_(v, b.shl(bit, const_vec(I8, 32, 2)))
    return v


def _make_body_q23_k(three: bool):
    bs = 110 if three else 84

    def body(h, wrow, xq, xd, xs, bi, acc):
        b = h.b
        wo = b.mul(bi, c64(bs))
        dx = h.load(xd, b.mul(bi, c64(4)), F32T)
        bsums = h.load(xs, b.mul(bi, c64(64)), vec(I32, 16))
        if three:
            sc = _q3k_scales(h, wrow, wo)
            d = b.fmul(h.load_f16(wrow, b.add(wo, c64(108))), dx)
            # codes are value + 4: subtract 4 * sc_g * sum_g(x)
            isum = b.sub(ir.Constant(vec(I32, 8), [0] * 8),
                         b.mul(h.pairs(b.mul(sc, bsums)), const_vec(I32, 8, 4)))
        else:
            raw = b.zext(h.load(wrow, wo, vec(I8, 16)), vec(I32, 16))
            sc = b.and_(raw, const_vec(I32, 16, 15))
            msum = h.pairs(b.mul(b.lshr(raw, const_vec(I32, 16, 4)), bsums))
            d = b.fmul(h.load_f16(wrow, b.add(wo, c64(80))), dx)
            dmin = b.fmul(h.load_f16(wrow, b.add(wo, c64(82))), dx)
            isum = ir.Constant(vec(I32, 8), [0] * 8)
        sc16 = b.trunc(sc, vec(I16, 16))
        xo = b.mul(bi, c64(256))
        for hh in range(2):
            for j in range(4):
                v = _q23k_codes(h, wrow, wo, hh, j, three)
                xv = h.load(xq, b.add(xo, c64(hh * 128 + j * 32)), vec(I8, 32))
                p16 = h.maddubs(v, xv)                     # lanes 0..7: group g, 8..15: group g+1
                g = hh * 8 + j * 2
                isum = b.add(isum, h.madd_i16(p16, b.shuffle_vector(sc16, sc16, mask([g] * 8 + [g + 1] * 8))))
        acc = h.fma(h.splat(d, 8), b.sitofp(isum, vec(F32T, 8)), acc)
        if not three:
            acc = h.fma(h.splat(b.fneg(dmin), 8), b.sitofp(msum, vec(F32T, 8)), acc)
        return acc
    return body


def _make_deq_q23_k(three: bool):
    bs = 110 if three else 84

    def body(h, wrow, yrow, bi):
        b = h.b
        wo = b.mul(bi, c64(bs))
        if three:
            d = h.load_f16(wrow, b.add(wo, c64(108)))
            dsc = b.fmul(b.sitofp(_q3k_scales(h, wrow, wo), vec(F32T, 16)), h.splat(d, 16))
            msc = ir.Constant(vec(F32T, 16), [0.0] * 16)
            off = 4
        else:
            raw = b.zext(h.load(wrow, wo, vec(I8, 16)), vec(I32, 16))
            d = h.load_f16(wrow, b.add(wo, c64(80)))
            dmin = h.load_f16(wrow, b.add(wo, c64(82)))
            dsc = b.fmul(b.sitofp(b.and_(raw, const_vec(I32, 16, 15)), vec(F32T, 16)), h.splat(d, 16))
            msc = b.fmul(b.sitofp(b.lshr(raw, const_vec(I32, 16, 4)), vec(F32T, 16)), h.splat(b.fneg(dmin), 16))
            off = 0
        yo = b.mul(bi, c64(1024))
        for hh in range(2):
            for j in range(4):
                v = _q23k_codes(h, wrow, wo, hh, j, three)
                f = b.sitofp(b.sub(b.zext(v, vec(I32, 32)), const_vec(I32, 32, off)), vec(F32T, 32))
                g = hh * 8 + j * 2
                m = mask([g] * 16 + [g + 1] * 16)
                y = h.fma(f, b.shuffle_vector(dsc, dsc, m), b.shuffle_vector(msc, msc, m))
                store(h, yrow, b.add(yo, c64(4 * (hh * 128 + j * 32))), y)
    return body


def make_deq_q45_k(five: bool, x8: bool = False):
    bs, qs0 = (176, 48) if five else (q4k_block_bytes(x8), 16)

    def body(h, wrow, yrow, bi):
        b = h.b
        wo = b.mul(bi, c64(bs))
        d = h.load_f16(wrow, wo)
        dmin = h.load_f16(wrow, b.add(wo, c64(2)))
        sc, mn = _q4k_scales(h, wrow, wo)
        dsc = b.fmul(b.sitofp(sc, vec(F32T, 8)), h.splat(d, 8))
        msc = b.fmul(b.sitofp(mn, vec(F32T, 8)), h.splat(b.fneg(dmin), 8))
        qh = h.load(wrow, b.add(wo, c64(16)), vec(I8, 32)) if five else None
        yo = b.mul(bi, c64(1024))
        for c in range(4):
            if five:
                q = h.load(wrow, b.add(wo, c64(qs0 + 32 * c)), vec(I8, 32))
            else:
                q = q4k_qs32(h, wrow, wo, c, x8)
            for hi in range(2):
                j = 2 * c + hi
                v = k_nibbles(h, q, hi)
                if five:
                    hb = b.and_(b.lshr(qh, const_vec(I8, 32, j)), const_vec(I8, 32, 1))
                    v = b.or_(v, b.shl(hb, const_vec(I8, 32, 4)))
                f = b.uitofp(v, vec(F32T, 32))
                ds = b.shuffle_vector(dsc, dsc, mask([j] * 32))
                ms = b.shuffle_vector(msc, msc, mask([j] * 32))
                store(h, yrow, b.add(yo, c64(128 * j)), h.fma(f, ds, ms))
    return body


def _deq_iq4_xs(h, wrow, yrow, bi):
    b = h.b
    wo = b.mul(bi, c64(136))
    d = h.load_f16(wrow, wo)
    yo = b.mul(bi, c64(1024))
    for ib in range(8):
        v = h.lut16(nibbles32(h, h.load(wrow, b.add(wo, c64(8 + 16 * ib)), vec(I8, 16))), KVALUES_IQ4NL)
        dl = b.fmul(d, b.sitofp(_iq4xs_scale(h, wrow, wo, ib), F32T))
        store(h, yrow, b.add(yo, c64(128 * ib)), b.fmul(b.sitofp(v, vec(F32T, 32)), h.splat(dl, 32)))


def _deq_q6_k(h, wrow, yrow, bi):
    b = h.b
    wo = b.mul(bi, c64(210))
    d = h.load_f16(wrow, b.add(wo, c64(208)))
    dsc = b.fmul(b.sitofp(h.load(wrow, b.add(wo, c64(192)), vec(I8, 16)), vec(F32T, 16)), h.splat(d, 16))
    yo = b.mul(bi, c64(1024))
    for hh in range(2):
        qh = h.load(wrow, b.add(wo, c64(128 + 32 * hh)), vec(I8, 32))
        ql0 = h.load(wrow, b.add(wo, c64(64 * hh)), vec(I8, 32))
        ql1 = h.load(wrow, b.add(wo, c64(64 * hh + 32)), vec(I8, 32))
        for gq in range(4):
            q = _q6_k_values(h, ql0, ql1, qh, gq)
            f = b.sitofp(b.sub(b.zext(q, vec(I32, 32)), const_vec(I32, 32, 32)), vec(F32T, 32))
            g = hh * 8 + gq * 2
            ds = b.shuffle_vector(dsc, dsc, mask([g] * 16 + [g + 1] * 16))
            store(h, yrow, b.add(yo, c64(4 * (hh * 128 + gq * 32))), b.fmul(f, ds))


row_q4_k = make_row_intrinsic(_make_body_q45_k(False), with_mins=True)
row_q5_k = make_row_intrinsic(_make_body_q45_k(True))
row_q6_k = make_row_intrinsic(_body_q6_k)
rows_q6_k = make_row_intrinsic(_body_q6_k, nrows=ROWS, block_bytes=210)   # prefetch: AVX-512 hosts only
row_iq4_xs = make_row_intrinsic(_body_iq4_xs)
row_q2_k = make_row_intrinsic(_make_body_q23_k(False))
row_q3_k = make_row_intrinsic(_make_body_q23_k(True))
# a short batch's tokens, four a row (dispatch._dot_rows_tokens): each the row kernel's bits
tok_q4_k = make_tokens_intrinsic(_make_body_q45_k(False), with_mins=True)
tok_q5_k = make_tokens_intrinsic(_make_body_q45_k(True))
tok_q6_k = make_tokens_intrinsic(_body_q6_k, block_bytes=210)
tok_iq4_xs = make_tokens_intrinsic(_body_iq4_xs)
tok_q2_k = make_tokens_intrinsic(_make_body_q23_k(False))
tok_q3_k = make_tokens_intrinsic(_make_body_q23_k(True))


deq_row_q4_k = make_deq_intrinsic(256, make_deq_q45_k(False))
deq_row_q5_k = make_deq_intrinsic(256, make_deq_q45_k(True))
deq_row_q6_k = make_deq_intrinsic(256, _deq_q6_k)
deq_row_iq4_xs = make_deq_intrinsic(256, _deq_iq4_xs)
deq_row_q2_k = make_deq_intrinsic(256, _make_deq_q23_k(False))
deq_row_q3_k = make_deq_intrinsic(256, _make_deq_q23_k(True))


# ----------------------------------------------------------------------------- Q5_K four rows (AVX2)
# Each row keeps ggml_vec_dot_q5_K's lanes and order (_q45k_isum on its own 32-byte
# vectors); what is per row besides goes in pairs or fours: the heads load two rows a
# vector and decode once a pair (q4k_scales_heads), the 4 rows' d and dmin
# take one fp16 conversion and one multiply by [dx, -dx], the min sums one vpshufb and one
# vpmaddwd a row. 420 instead of 453 instructions (352 instead of 375 vector-pipe uops) a
# block of 4 rows, 24.0 instead of 24.8 cycles a row (llvm-mca, znver3); old and new
# alternating in one process, 2 threads: 6-9% more L2-resident GB/s. Dot_q4k_x8's two rows
# a vector measured no faster here: a row's i32 lane i holds elements 4i..4i+3 of each
# sub-block, so a sub-block's two 16-byte pieces feed different lanes and cannot add in
# i16 before vpmaddwd, and joining the pieces costs what the shared vpshufb saves.

def _q5_k_rows4_block_256(h, wrows, xq, xd, xs, bi, accs):
    """One block of four Q5_K rows on AVX2, accs their <8 x float> accumulators: the same
    i32 lanes and fmas per row as _make_body_q45_k(True)'s body, so the same bits."""
    b = h.b
    wo = b.mul(bi, c64(176))
    heads = []
    for m in range(2):
        lo, hi = (h.load(w, wo, vec(I32, 4)) for w in wrows[2 * m:2 * m + 2])
        heads.append(b.shuffle_vector(lo, hi, mask(range(8))))
    sms = [q4k_scales_heads(h, v) for v in heads]     # [a's scales, mins | b's]
    # a row's 16 bytes in both halves (vpermq)
    rsm = [b.shuffle_vector(sms[k // 2], sms[k // 2], mask(list(range(16 * (k % 2), 16 * (k % 2) + 16)) * 2))
           for k in range(4)]
    # per-32 activation sums as i32 (|s| <= 32*128: its low i16 is s, times a 0 high i16)
    bs16 = b.bitcast(h.pairs(h.load(xs, b.mul(bi, c64(64)), vec(I32, 16))), vec(I16, 16))
    mn_idx = const_vec(I8, 32, [v for i in range(8) for v in (8 + i, -128, -128, -128)])
    dm16 = b.bitcast(b.shuffle_vector(heads[0], heads[1], mask([0, 4, 8, 12])), vec(I16, 8))  # d, dmin of rows 0-3
    dx = h.load(xd, b.mul(bi, c64(4)), F32T)
    dx8 = h.splat(dx, 8)
    dd = b.fmul(h.f16_lanes(dm16), b.shuffle_vector(dx8, b.fneg(dx8), mask([0, 9] * 4)))
    xo = b.mul(bi, c64(256))
    out = []
    for k in range(4):
        isum = _q45k_isum(h, wrows[k], wo, xq, xo, rsm[k], True)
        mn = b.bitcast(h.x86("llvm.x86.avx2.pshuf.b", vec(I8, 32), [rsm[k], mn_idx]), vec(I16, 16))
        msum = h.madd_i16(mn, bs16)                    # min_i * s_i, exact
        acc = h.fma(b.shuffle_vector(dd, dd, mask([2 * k] * 8)), b.sitofp(isum, vec(F32T, 8)), accs[k])
        out.append(h.fma(b.shuffle_vector(dd, dd, mask([2 * k + 1] * 8)), b.sitofp(msum, vec(F32T, 8)), acc))
    return out


def _q5_k_rows4_pairs(context, builder, sig, args):
    (wrows, xq, xd, xs), nb = array_ptrs(context, builder, sig, args, ROWS)
    h = IRHelpers(builder, target_features(context))
    zero = ir.Constant(vec(F32T, 8), [0.0] * 8)
    def block(bi, accs):
        prefetch_row_streams(h, wrows, bi, 176)   # as the quartered Q6_K rows (row_loop)
        return _q5_k_rows4_block_256(h, wrows, xq, xd, xs, bi, accs)
    fin = counted_loop(builder, nb, 1, [zero] * 4, block, "q5k4")
    return [h.hsum_f32(v) for v in fin]


_body_q5_k = _make_body_q45_k(True)


@intrinsic
def rows_q5_k(typingctx, w, r, xq, xd, xs, step):
    """Rows r, r+step, r+2*step, r+3*step of a Q5_K matrix as a tuple, each in
    ggml_vec_dot_q5_K's order: on AVX2 _q5_k_rows4_block_256, elsewhere one
    row_loop body per row."""
    sig = types.UniTuple(types.float32, ROWS)(w, r, xq, xd, xs, step)

    def codegen(context, builder, sig, args):
        if "+avx2" in target_features(context):
            sums = _q5_k_rows4_pairs(context, builder, sig, args)
        else:
            sums = row_loop(context, builder, sig, args, _body_q5_k, False, ROWS)
        return context.make_tuple(builder, sig.return_type, sums)
    return sig, codegen
