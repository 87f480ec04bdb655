"""gemm_q32's token products with 512-bit VNNI: 32 rows a step, vpdpbusd sums.

gemm_q32 stages NBLK blocks of 8 rows at a time (values as bytes [step k][row][4 bytes],
signed types also as |w|, the row scales as floats) and multiplies them with vpmaddubsw
(signed values as |w| . sign(x, w)). On CPUs with AVX512-VNNI this module takes four
staged groups at a time, as gemm_kquant_wide does for the 256-element types:
- `merge` lays them side by side: each 128-byte line holds 32 rows' 4 bytes, as unsigned
  codes: Q4_0/Q5_0 (value = code - 8 / - 16) and Q4_1/Q5_1 their codes, the signed types
  (Q8_0, IQ4_NL, MXFP4) their value + 128 (vpdpbusd multiplies unsigned by signed bytes);
  the 32 row scales (and mins) of each block.
- Per token and block, 8 broadcasts of its 4-byte steps serve both zmm of the lines: the
  exact dot in i32 lanes, less offset * the token's block sum (8, 16 or 128), which is
  the same integer gemm_q32 forms; then its fma per row and block, acc += (d_row d_x) * I
  (and Q4_1/Q5_1's + (m_row d_x) * sum), so every result has gemm_q32's bits.
Four tokens a step: each keeps its 32 float accumulators in registers over the run.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .gemm_kquant_wide import GROUPS, LANES, NV, ROWS, bcast16, dpbusd512, gather_groups, store
from .ir_helpers import F32T, I8, I32, IRHelpers, c64, const_vec, counted_loop, row_pointer, target_features, vec
from .quant_kernels import IQ4_NL, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0

TOKENS = 4                 # tokens a step (gemm_q32's padding)
_LINE = 4 * ROWS           # a line: 4 bytes of each row
_PER_BLOCK = 8 * _LINE + 2 * 4 * ROWS    # 8 lines, then the row scales, then the row mins
# the value offset gemm_q32's integers take off (value = code - offset), per type
OFFSET = {Q4_0: 8, Q5_0: 16, Q8_0: 128, IQ4_NL: 128, MXFP4: 128, Q4_1: 0, Q5_1: 0}
_MIN = (Q4_1, Q5_1)


def scratch_bytes(nblk: int) -> int:
    return nblk * _PER_BLOCK


def make_merge(qt: int, nblk: int, per_block: int, code_bytes: int, signed: bool, stride: int):
    """merge(s4, sw): the wide scratch of nblk blocks from four gemm_q32 scratches (s4's
    rows, `stride` bytes apart; per_block bytes a staged block, its codes plane first, a
    signed type's values in its second plane, then 8 scales and for Q4_1/Q5_1 8 mins)."""
    def codegen(context, builder, sig, args):
        b = builder
        s4, sw = (b.bitcast(context.make_array(t)(context, b, a).data, I8.as_pointer())
                  for t, a in zip(sig.args, args))
        src = [b.gep(s4, [c64(q * stride)]) for q in range(GROUPS)]
        planes = 2 if signed else 1
        for j in range(nblk):
            base, wbase = per_block * j, _PER_BLOCK * j
            for k in range(8):
                v = gather_groups(b, src, base + code_bytes * (planes - 1) + 32 * k, vec(I8, 32))
                if signed:   # value + 128 as an unsigned byte
                    v = b.xor(v, const_vec(I8, 4 * ROWS, -128))
                store(b, sw, wbase + _LINE * k, v)
            at = base + code_bytes * planes
            store(b, sw, wbase + 8 * _LINE, gather_groups(b, src, at, vec(F32T, 8)))
            if qt in _MIN:
                store(b, sw, wbase + 8 * _LINE + 4 * ROWS, gather_groups(b, src, at + 32, vec(F32T, 8)))
        return context.get_dummy_value()

    @intrinsic
    def merge(typingctx, s4, sw):
        return types.void(s4, sw), codegen
    return merge


def make_tokens(qt: int, nblk: int):
    """tokens(sw, xq, xd, xs, t_lo, acc, t_hi): for tokens t_lo..t_hi (a multiple of TOKENS
    apart), acc[t, :32] += the nblk merged blocks . token t's (views from the run's first block)."""
    offset = OFFSET[qt]

    def codegen(context, builder, sig, args):
        s, xq, xd, xs, acc = (context.make_array(ty)(context, builder, a)
                              for ty, a in zip((sig.args[0], sig.args[1], sig.args[2], sig.args[3], sig.args[5]),
                                               (args[0], args[1], args[2], args[3], args[5])))
        t_lo, t_hi = args[4], args[6]
        b = builder
        h = IRHelpers(b, target_features(context))
        i8p = I8.as_pointer()
        sw = b.bitcast(s.data, i8p)

        xrow, drow, srow, arow = (row_pointer(b, a) for a in (xq, xd, xs, acc))

        def floats(at):
            return [h.load(sw, c64(at + 64 * v), vec(F32T, LANES)) for v in range(NV)]
        d_rows = [floats(_PER_BLOCK * j + 8 * _LINE) for j in range(nblk)]
        m_rows = [floats(_PER_BLOCK * j + 8 * _LINE + 4 * ROWS) for j in range(nblk)] if qt in _MIN else None
        zero = const_vec(I32, LANES, 0)

        def quad(i, _):
            ts = [b.add(b.add(t_lo, i), c64(ti)) for ti in range(TOKENS)]
            xs_, ds_, bs_ = [xrow(t) for t in ts], [drow(t) for t in ts], [srow(t) for t in ts]
            accs = [[h.load(arow(t), c64(64 * v), vec(F32T, LANES)) for v in range(NV)] for t in ts]
            for j in range(nblk):
                isum = [[zero] * NV for _ in ts]
                for k in range(8):
                    wv = [h.load(sw, c64(_PER_BLOCK * j + _LINE * k + 64 * v), vec(I32, LANES)) for v in range(NV)]
                    for ti in range(TOKENS):
                        xb = bcast16(h, xs_[ti], 32 * j + 4 * k)
                        isum[ti] = [dpbusd512(h, a, w, xb) for a, w in zip(isum[ti], wv)]
                for ti in range(TOKENS):
                    bsum = h.load(bs_[ti], c64(4 * j), I32)
                    if offset:   # minus offset * the token's block sum
                        off = h.splat(b.shl(bsum, ir.Constant(I32, offset.bit_length() - 1)), LANES)
                        isum[ti] = [b.sub(a, off) for a in isum[ti]]
                    dxv = h.splat(h.load(ds_[ti], c64(4 * j), F32T), LANES)
                    accs[ti] = [h.fma(b.fmul(d, dxv), b.sitofp(a, vec(F32T, LANES)), c)
                                for d, a, c in zip(d_rows[j], isum[ti], accs[ti])]
                    if m_rows is not None:   # + m dx sum(x)
                        xsum = h.splat(b.sitofp(bsum, F32T), LANES)
                        accs[ti] = [h.fma(b.fmul(m, dxv), xsum, c) for m, c in zip(m_rows[j], accs[ti])]
            for t, a in zip(ts, accs):
                for v in range(NV):
                    store(b, arow(t), 64 * v, a[v])
            return []
        counted_loop(b, b.sub(t_hi, t_lo), TOKENS, [], quad, "q32w_tok")
        return context.get_dummy_value()

    @intrinsic
    def tokens(typingctx, s, xq, xd, xs, t_lo, acc, t_hi):
        return types.void(s, xq, xd, xs, t_lo, acc, t_hi), codegen
    return tokens
