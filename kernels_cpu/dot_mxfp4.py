"""MXFP4 (gpt-oss's expert type) row dots and row dequantization, as IR.

A block is one E8M0 scale byte e, then 16 bytes of 4-bit E2M1 codes (low nibbles are
elements 0..15, high ones 16..31), value = kvalues_mxfp4[code] * 2^(e-128) (the table holds
the E2M1 values doubled, the scale is halved to match). The dot follows
ggml_vec_dot_mxfp4_q8_0 (AVX2): table lookup by vpshufb, |q| . sign(q)*x by vpmaddubsw +
vpmaddwd into 8 i32 lanes, and, unlike the other 32-block types, two <8 x float>
accumulators, even blocks in one and odd blocks in the other, added before the horizontal
sum; an odd last block is summed as one integer, scaled, and added to that sum.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .dot_q32 import nibbles32, offset_pairs
from .ir_helpers import (F32T, I8, I16, I32, I64, IRHelpers, array_ptrs, c64, const_vec, counted_loop,
                         make_deq_intrinsic, store, target_features, vec, ROWS)

KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
BLOCK_BYTES = 17


def e8m0_half(h, wrow, wo):
    """The scale byte at wrow + wo -> 2^(e-128) as float: ggml_e8m0_to_fp32_half's bits,
    0x00200000 << e for the denormals e < 2, else (e - 1) << 23."""
    b = h.b
    e = b.zext(h.load(wrow, wo, I8), I32)
    bits = b.select(b.icmp_unsigned("<", e, ir.Constant(I32, 2)), b.shl(ir.Constant(I32, 0x00200000), e),
                    b.shl(b.sub(e, ir.Constant(I32, 1)), ir.Constant(I32, 23)))
    return b.bitcast(bits, F32T)


def _e8m0_half_table(h):
    """The 256 values of e8m0_half as a constant array in the module (a scale is then one
    indexed load, not six scalar operations)."""
    import struct

    name = "edgeinfer_e8m0_half"
    g = h.b.module.globals.get(name)
    if g is None:
        vals = [struct.unpack("<f", struct.pack("<I", (0x00200000 << e) if e < 2 else (e - 1) << 23))[0]
                for e in range(256)]
        g = cgutils.global_constant(h.b.module, name, ir.Constant(ir.ArrayType(F32T, 256), vals))
    return g


def e8m0_half_splat(h, wrow, wo, n):
    """e8m0_half of the scale byte at wrow + wo in all n lanes, from the table (vbroadcastss)."""
    b = h.b
    e = b.zext(h.load(wrow, wo, I8), I64)
    return h.splat(b.load(b.gep(_e8m0_half_table(h), [ir.Constant(I64, 0), e])), n)


def mxfp4_values(h, wrow, wo, table=KVALUES_MXFP4):
    """The block at byte wo's 32 table values as <32 x i8> (elements in order): the signed
    E2M1 values doubled, or another 16-entry table indexed by the same codes."""
    return h.lut16(nibbles32(h, h.load(wrow, h.b.add(wo, c64(1)), vec(I8, 16))), table)


def _scale(h, wrow, xd, bi):
    """fp16(y.d) * e8m0_half(x.e), as ggml forms it (one float product)."""
    b = h.b
    dx = h.load(xd, b.mul(bi, c64(4)), F32T)
    return b.fmul(dx, e8m0_half(h, wrow, b.mul(bi, c64(BLOCK_BYTES))))


def _scale8(h, wrow, xd, bi):
    """_scale's product formed in 8 lanes (the same value in each)."""
    b = h.b
    return b.fmul(h.splat(h.load(xd, b.mul(bi, c64(4)), F32T), 8), e8m0_half_splat(h, wrow, b.mul(bi, c64(BLOCK_BYTES)), 8))


def _lanes(h, wrow, xq, bi):
    """Block bi's <8 x i32> lane sums (lane L: products 4L..4L+3) as ggml's |q| . sign(x, q)
    gives them, from the table values + 12 (0..24: vpmaddubsw takes them as they are) less
    12 * (x summed in pairs), which a several-rows loop computes once a block
    (dot_q32.offset_pairs): no abs and sign a row."""
    b = h.b
    q = mxfp4_values(h, wrow, b.mul(bi, c64(BLOCK_BYTES)), [v + 12 for v in KVALUES_MXFP4])
    xv = h.load(xq, b.mul(bi, c64(32)), vec(I8, 32))
    # pairs <= 2 * 24 * 128; less the offset's pairs (<= 2 * 12 * 128): exact in i16
    return h.madd_i16(b.sub(h.maddubs(q, xv), offset_pairs(h, xv, 12)), const_vec(I16, 16, 1))


def _rows_dot(context, builder, sig, args, nrows, step2=False):
    """The dots of nrows rows (array_ptrs' rows r, r + step, ...; step2: r, r + 2 step)
    in ggml's order, each row with its own pair of accumulators; a float per row."""
    if step2:
        args = list(args)
        args[5] = builder.mul(args[5], ir.Constant(I64, 2))
    (wrows, xq, xd, _xs), nb = array_ptrs(context, builder, sig, args, nrows)
    h = IRHelpers(builder, target_features(context))
    zero = ir.Constant(vec(F32T, 8), [0.0] * 8)

    def pair(i, accs):
        out = []
        for r, wrow in enumerate(wrows):
            for k in (0, 1):   # block i into the first accumulator, block i + 1 into the second
                bi = builder.add(i, c64(k))
                s = _lanes(h, wrow, xq, bi)
                out.append(h.fma(_scale8(h, wrow, xd, bi), builder.sitofp(s, vec(F32T, 8)),
                                 accs[2 * r + k]))
        return out
    n_even = builder.and_(nb, ir.Constant(I64, -2))
    accs = counted_loop(builder, n_even, 2, [zero, zero] * nrows, pair, "mxfp4")
    totals = [h.hsum_f32(builder.fadd(accs[2 * r], accs[2 * r + 1])) for r in range(nrows)]
    # an odd block count: the last block as ggml's scalar tail, sumf += d * (sumi1 + sumi2),
    # a product and a sum rounded apart (llama.cpp's build does not contract it to an fma)
    entry = builder.block
    tail = builder.append_basic_block("mxfp4.tail")
    done = builder.append_basic_block("mxfp4.done")
    builder.cbranch(builder.icmp_signed("<", n_even, nb), tail, done)
    builder.position_at_end(tail)
    with_tail = []
    for wrow, total in zip(wrows, totals):
        isum = _lanes(h, wrow, xq, n_even)
        while isum.type.count > 1:   # exact: the order of integer adds does not matter
            isum = builder.add(h.half(isum, 0), h.half(isum, 1))
        isum = builder.extract_element(isum, ir.Constant(I32, 0))
        with_tail.append(builder.fadd(total, builder.fmul(_scale(h, wrow, xd, n_even), builder.sitofp(isum, F32T))))
    tail_end = builder.block
    builder.branch(done)
    builder.position_at_end(done)
    outs = []
    for total, t in zip(totals, with_tail):
        out = builder.phi(F32T)
        out.add_incoming(total, entry)
        out.add_incoming(t, tail_end)
        outs.append(out)
    return outs


@intrinsic
def row_mxfp4(typingctx, w, r, xq, xd, xs):
    """Row r of MXFP4 blocks w . Q8_0 activations (xq, xd; xs unused), in ggml's order."""
    def codegen(context, builder, sig, args):
        return _rows_dot(context, builder, sig, args, 1)[0]
    return types.float32(w, r, xq, xd, xs), codegen


@intrinsic
def rows_mxfp4(typingctx, w, r, xq, xd, xs, step):
    """Rows r, r + step, ... (ROWS of them) as row_mxfp4 computes each."""
    sig = types.UniTuple(types.float32, ROWS)(w, r, xq, xd, xs, step)

    def codegen(context, builder, sig, args):
        # two loops of two rows: four rows' eight accumulators and the constants spill
        step = args[5]
        first = _rows_dot(context, builder, sig, args, 2, step2=True)
        args2 = list(args)
        args2[1] = builder.add(args[1], step)
        second = _rows_dot(context, builder, sig, args2, 2, step2=True)
        return context.make_tuple(builder, sig.return_type, [first[0], second[0], first[1], second[1]])
    return sig, codegen


def _deq_mxfp4(h, wrow, yrow, bi):
    b = h.b
    wo = b.mul(bi, c64(BLOCK_BYTES))
    f = b.sitofp(mxfp4_values(h, wrow, wo), vec(F32T, 32))
    store(h, yrow, b.mul(bi, c64(128)), b.fmul(f, h.splat(e8m0_half(h, wrow, wo), 32)))


deq_row_mxfp4 = make_deq_intrinsic(32, _deq_mxfp4)
