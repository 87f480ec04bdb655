"""Row dots and row dequantization for the 32-element block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL.

Each type's block body is emitted as IR (ir_helpers.py): per block, u8 x s8 products
summed in pairs to i16 (vpmaddubsw), then to i32 (vpmaddwd), one fma with the float
scales into the row's <8 x float> accumulator: ggml_vec_dot's order. The same value
extraction writes float rows for the prefill GEMM.
"""
from __future__ import annotations

from llvmlite import ir

from .ir_helpers import (F32T, I8, I16, I32, as_i8, c64, const_vec, make_deq_intrinsic, make_row_intrinsic,
                         make_tokens_intrinsic, mask, store, vec, ROWS, WIDE_TOKENS_A_ROW)
from .quant_kernels import IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0


def _body_q8_0(h, wrow, xq, xd, xs, bi, acc, d=None):
    """d: the block's scale product, when the loop formed it (ir_helpers.group_scales)."""
    b = h.b
    wo = b.mul(bi, c64(34))
    if d is None:
        d = _scale_product(h, wrow, wo, h.load(xd, b.mul(bi, c64(4)), F32T))
    wv = h.load(wrow, b.add(wo, c64(2)), vec(I8, 32))
    xv = h.load(xq, b.mul(bi, c64(32)), vec(I8, 32))
    # |w| (u8) . sign(w)*x (s8): products are the same, and vpmaddubsw takes u8 x s8
    # pairs: |w|*|x| <= 128*127, two of them < 2^15, so vpdpbusd's lane sums (VNNI: one
    # instruction for the two) are the same integers
    aw, sx = h.abs_i8(wv), h.sign_i8(xv, wv)
    if h.vnni:
        s = h.dpbusd(const_vec(I32, 8, 0), aw, sx)
    else:
        s = h.madd_i16(h.maddubs(aw, sx), const_vec(I16, 16, 1))
    return h.fma(d, b.sitofp(s, vec(F32T, 8)), acc)


def nibbles32(h, q16):
    """<16 x i8> packed nibbles -> <32 x i8>: low nibbles then high nibbles. With AVX2 from
    one 16-byte broadcast, a per-half dword shift (vpsrlvd) and one mask: 3 instructions,
    not 5 (AVX2 has no byte shift; the shuffle port was MXFP4's decode bottleneck)."""
    b = h.b
    if h.avx2:
        both = b.bitcast(b.shuffle_vector(q16, q16, mask(list(range(16)) * 2)), vec(I32, 8))
        return b.and_(b.bitcast(b.lshr(both, const_vec(I32, 8, [0] * 4 + [4] * 4)), vec(I8, 32)),
                      const_vec(I8, 32, 15))
    lo = b.and_(q16, const_vec(I8, 16, 15))
    hi = b.lshr(q16, const_vec(I8, 16, 4))
    return b.shuffle_vector(lo, hi, mask(range(32)))


def _qh_bits(h, qh32, value):
    """Bit k of the i32 qh -> `value` in byte k of a <32 x i8> (0 elsewhere)."""
    b = h.b
    if h.avx512bw:   # qh is a mask register already: kmovd + one zero-masked move
        return b.select(b.bitcast(qh32, vec(ir.IntType(1), 32)), const_vec(I8, 32, value), const_vec(I8, 32, 0))
    qb = b.bitcast(qh32, vec(I8, 4))
    spread = b.shuffle_vector(qb, qb, mask([k // 8 for k in range(32)]))
    bit = b.and_(spread, const_vec(I8, 32, [1 << (k % 8) for k in range(32)]))
    return b.select(b.icmp_unsigned("!=", bit, const_vec(I8, 32, 0)), const_vec(I8, 32, value),
                    const_vec(I8, 32, 0))


KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# 32-element block types: (bytes per block, has min m, has 5th bits qh, offset subtracted, non-linear table)
Q32 = {
    Q4_0: (18, False, False, 8, False), Q4_1: (20, True, False, 0, False),
    Q5_0: (22, False, True, 16, False), Q5_1: (24, True, True, 0, False),
    IQ4_NL: (18, False, False, 0, True),
}


def q32_values(h, wrow, wo, qt):
    """The 32 quant values of a 32-element block at byte wo as <32 x i8>: unsigned codes
    (value = d * (code - offset) + m), or signed table values for IQ4_NL."""
    b = h.b
    bs, has_min, has_qh, offset, table = Q32[qt]
    qo = 4 if has_min else 2
    qs = b.add(wo, c64(qo + (4 if has_qh else 0)))
    q = nibbles32(h, h.load(wrow, qs, vec(I8, 16)))
    if has_qh:
        q = b.or_(q, _qh_bits(h, h.load(wrow, b.add(wo, c64(qo)), I32), 16))
    if table:
        q = h.lut16(q, KVALUES_IQ4NL)
    return q


def code_offset(qt) -> int:
    """What q32_codes' unsigned codes add to a type's signed values (IQ4_NL: its table
    values + 128; 0 for the types with a min)."""
    return 128 if Q32[qt][4] else Q32[qt][3]


def q32_codes(h, wrow, wo, qt):
    """A 32-element block's unsigned codes as <32 x i8> (value = d * (code - offset) + m;
    IQ4_NL: its table value + 128): nibbles from one 16-byte broadcast and a per-half word
    shift, qh's bits through a mask register (_qh_bits)."""
    b = h.b
    bs, has_min, has_qh, offset, table = Q32[qt]
    qo = 4 if has_min else 2
    raw = h.load(wrow, b.add(wo, c64(qo + (4 if has_qh else 0))), vec(I8, 16))
    both = b.bitcast(b.shuffle_vector(raw, raw, mask(list(range(16)) * 2)), vec(I16, 16))
    q = b.and_(b.bitcast(b.lshr(both, const_vec(I16, 16, [0] * 8 + [4] * 8)), vec(I8, 32)),
               const_vec(I8, 32, 15))                    # low nibbles, then high ones
    if has_qh:
        q = b.or_(q, _qh_bits(h, h.load(wrow, b.add(wo, c64(qo)), I32), 16))
    if table:
        q = h.lut16(q, [as_i8(v + 128) for v in KVALUES_IQ4NL])
    return q


def _q32_isum_vnni(h, wrow, wo, qt, xv):
    """A 32-element block's <8 x i32> lane sums (products 4i..4i+3) where 256-bit vpdpbusd
    exists: the exact integers of the vpmaddubsw + vpmaddwd path below, with one vpdpbusd
    of unsigned codes (code = weight + offset) started from -offset * (x summed in fours),
    a second vpdpbusd on the activations alone. The two replace abs, sign, vpmaddubsw and
    vpmaddwd; in the four-rows loop (_make_body_q32_rows) the rows share the start. IQ4_NL's
    table values go in as value + 128 (1..241) (q32_codes)."""
    b = h.b
    offset = code_offset(qt)
    q = q32_codes(h, wrow, wo, qt)
    start = const_vec(I32, 8, 0)
    if offset:
        start = b.sub(start, h.dpbusd(start, const_vec(I8, 32, as_i8(offset)), xv))
    return h.dpbusd(start, q, xv)


def _scale_product(h, wrow, wo, dx):
    """The block's fp16 scale at wo times dx, in all 8 lanes."""
    b = h.b
    if h.f16c:
        # formed in all lanes (vpbroadcastw + vcvtph2ps): the same product, and the tokens
        # of a several-tokens loop share the conversion (load_f16's inline vmovd is not
        # merged: one conversion a token)
        return b.fmul(h.load_f16_splat(wrow, wo, 8), h.splat(dx, 8))
    return h.splat(b.fmul(h.load_f16(wrow, wo), dx), 8)


def _make_body_q32(qt):
    bs, has_min, has_qh, offset, table = Q32[qt]

    def body(h, wrow, xq, xd, xs, bi, acc, d=None):
        b = h.b
        wo = b.mul(bi, c64(bs))
        dx = h.load(xd, b.mul(bi, c64(4)), F32T)
        xv = h.load(xq, b.mul(bi, c64(32)), vec(I8, 32))
        if d is None:       # (else formed by the loop: ir_helpers.group_scales)
            d = _scale_product(h, wrow, wo, dx)
        if h.vnni and h.f16c:
            s = _q32_isum_vnni(h, wrow, wo, qt, xv)
        else:
            q = q32_values(h, wrow, wo, qt)
            if offset:  # the signed value q - offset in each lane, as llama.cpp's tinyBLAS does
                q = b.sub(q, const_vec(I8, 32, offset))
            if table or offset:  # signed x signed: |q| . sign(q)*x, pairs <= 2*127*127
                p16 = h.maddubs(h.abs_i8(q), h.sign_i8(xv, q))
            else:       # codes <= 31: pairs <= 2*31*128
                p16 = h.maddubs(q, xv)
            s = h.madd_i16(p16, const_vec(I16, 16, 1))
        if has_min:
            xsum = h.load(xs, b.mul(bi, c64(4)), I32)
        acc = h.fma(d, b.sitofp(s, vec(F32T, 8)), acc)
        if has_min:  # + m * dx * sum(x), in lane 0
            mt = b.fmul(b.fmul(h.load_f16(wrow, b.add(wo, c64(2))), dx), b.sitofp(xsum, F32T))
            acc = b.fadd(acc, b.insert_element(ir.Constant(vec(F32T, 8), [0.0] * 8), mt, ir.Constant(I32, 0)))
        return acc
    return body


def offset_pairs(h, xv, offset):
    """offset * (x summed in pairs) as <16 x i16> (vpmaddubsw): what the offset of unsigned
    codes takes off a block's vpmaddubsw pairs, before they widen to i32 lanes. In a loop
    over several rows one block's x is the same for all of them, and LLVM computes this
    once."""
    return h.maddubs(const_vec(I8, 32, offset), xv)


def _make_body_q32_rows(qt):
    """The AVX2 body of `_make_body_q32` for the several-rows loop (`rows_*`): the same lane
    integers (so the same bits) from the unsigned codes, maddubs(code, x) - offset * (x
    in pairs) in i16, the second term shared by the loop's rows: no abs and sign a row."""
    bs, has_min, has_qh, offset, table = Q32[qt]
    assert not table   # codes <= 31 and offsets <= 16: every vpmaddubsw pair fits i16

    def body(h, wrow, xq, xd, xs, bi, acc):
        b = h.b
        wo = b.mul(bi, c64(bs))
        dx = h.load(xd, b.mul(bi, c64(4)), F32T)
        xv = h.load(xq, b.mul(bi, c64(32)), vec(I8, 32))
        # d * dx formed in all lanes (vpbroadcastw + vcvtph2ps, no false dependency): the same product
        d = b.fmul(h.load_f16_splat(wrow, wo, 8), h.splat(dx, 8))
        if h.vnni:   # one vpdpbusd from the offset's start, which the loop's rows share
            s = _q32_isum_vnni(h, wrow, wo, qt, xv)
        else:
            p16 = h.maddubs(q32_values(h, wrow, wo, qt), xv)   # codes <= 31: pairs <= 2 * 31 * 128
            if offset:   # pairs - offset pairs: |difference| <= 2 * 31 * 128, exact in i16
                p16 = b.sub(p16, offset_pairs(h, xv, offset))
            s = h.madd_i16(p16, const_vec(I16, 16, 1))
        acc = h.fma(d, b.sitofp(s, vec(F32T, 8)), acc)
        if has_min:  # + m * dx * sum(x), in lane 0
            xsum = h.load(xs, b.mul(bi, c64(4)), I32)
            mt = b.fmul(b.fmul(h.load_f16(wrow, b.add(wo, c64(2))), dx), b.sitofp(xsum, F32T))
            acc = b.fadd(acc, b.insert_element(ir.Constant(vec(F32T, 8), [0.0] * 8), mt, ir.Constant(I32, 0)))
        return acc
    return body


def _deq_q8_0(h, wrow, yrow, bi):
    b = h.b
    wo = b.mul(bi, c64(34))
    q = b.sitofp(h.load(wrow, b.add(wo, c64(2)), vec(I8, 32)), vec(F32T, 32))
    store(h, yrow, b.mul(bi, c64(128)), b.fmul(q, h.splat(h.load_f16(wrow, wo), 32)))


def _make_deq_q32(qt):
    bs, has_min, has_qh, offset, table = Q32[qt]

    def body(h, wrow, yrow, bi):
        b = h.b
        wo = b.mul(bi, c64(bs))
        q = q32_values(h, wrow, wo, qt)
        if table:
            f = b.sitofp(q, vec(F32T, 32))
        else:
            f = b.sitofp(b.sub(b.zext(q, vec(I32, 32)), const_vec(I32, 32, offset)), vec(F32T, 32))
        d = h.splat(h.load_f16(wrow, wo), 32)
        if has_min:
            y = h.fma(f, d, h.splat(h.load_f16(wrow, b.add(wo, c64(2))), 32))
        else:
            y = b.fmul(f, d)
        store(h, yrow, b.mul(bi, c64(128)), y)
    return body


# Q8_0 rows prefetch 4 KiB ahead: the Gemma head (262144 x 640) took 7.9 -> 6.8 ms with
# 2 threads, 15.2 -> 11.6 ms with one. The K-quants, compute-bound, lost 10-40% with it.
row_q8_0 = make_row_intrinsic(_body_q8_0, block_bytes=34)
rows_q8_0 = make_row_intrinsic(_body_q8_0, nrows=ROWS, block_bytes=34)
row_q4_0 = make_row_intrinsic(_make_body_q32(Q4_0))
row_q4_1 = make_row_intrinsic(_make_body_q32(Q4_1))
row_q5_0 = make_row_intrinsic(_make_body_q32(Q5_0))
row_q5_1 = make_row_intrinsic(_make_body_q32(Q5_1))
row_iq4_nl = make_row_intrinsic(_make_body_q32(IQ4_NL))
# four rows a loop (dispatch's quartered order) on AVX2 without VNNI
rows_q4_0 = make_row_intrinsic(_make_body_q32_rows(Q4_0), nrows=ROWS)
rows_q4_1 = make_row_intrinsic(_make_body_q32_rows(Q4_1), nrows=ROWS)
rows_q5_0 = make_row_intrinsic(_make_body_q32_rows(Q5_0), nrows=ROWS)
rows_q5_1 = make_row_intrinsic(_make_body_q32_rows(Q5_1), nrows=ROWS)

# a short batch's tokens, up to eight a row (dispatch._dot_rows_tokens): each the row
# kernel's bits. Prefetched as Q8_0's rows: one row at a time, a long body a block, the
# hardware prefetcher fell behind (Q5_0 147456 x 640, 2 tokens: 16 -> 6.9 ms, AVX2 build).
# Q8_0 and Q4_0 form four blocks' scale products in one multiply (ir_helpers.group_scales):
# AVX2 build on the Xeon, 4 tokens, Q8_0 262144 x 640 12.8 -> 10.5 ms, Q4_0 65536 x 640
# 2.7-2.9 -> 2.5-2.7 ms. Q5_0, Q5_1 and IQ4_NL, whose unpacking keeps the shuffle port busy,
# lost with it (Q5_0 2.7-2.9 -> 3.0-3.3 ms).
# every token loop here takes up to WIDE_TOKENS_A_ROW tokens: dispatch's passes ask these
# types for as many (a pass asking more than a loop serves would get too few sums)
WIDE_TOKEN_TYPES = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL)
tok_q8_0 = make_tokens_intrinsic(_body_q8_0, block_bytes=34, block_scales=True, most=WIDE_TOKENS_A_ROW)
tok_q4_0 = make_tokens_intrinsic(_make_body_q32(Q4_0), block_bytes=Q32[Q4_0][0], block_scales=True,
                                 most=WIDE_TOKENS_A_ROW)
tok_q4_1 = make_tokens_intrinsic(_make_body_q32(Q4_1), block_bytes=Q32[Q4_1][0], most=WIDE_TOKENS_A_ROW)
tok_q5_0 = make_tokens_intrinsic(_make_body_q32(Q5_0), block_bytes=Q32[Q5_0][0], most=WIDE_TOKENS_A_ROW)
tok_q5_1 = make_tokens_intrinsic(_make_body_q32(Q5_1), block_bytes=Q32[Q5_1][0], most=WIDE_TOKENS_A_ROW)
tok_iq4_nl = make_tokens_intrinsic(_make_body_q32(IQ4_NL), block_bytes=Q32[IQ4_NL][0], most=WIDE_TOKENS_A_ROW)

deq_row_q8_0 = make_deq_intrinsic(32, _deq_q8_0)
deq_row_q4_0 = make_deq_intrinsic(32, _make_deq_q32(Q4_0))
deq_row_q4_1 = make_deq_intrinsic(32, _make_deq_q32(Q4_1))
deq_row_q5_0 = make_deq_intrinsic(32, _make_deq_q32(Q5_0))
deq_row_q5_1 = make_deq_intrinsic(32, _make_deq_q32(Q5_1))
deq_row_iq4_nl = make_deq_intrinsic(32, _make_deq_q32(IQ4_NL))
