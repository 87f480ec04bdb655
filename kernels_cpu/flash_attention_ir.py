"""The per-key V update of flash attention over quantized V rows, emitted as IR (ir_helpers.py).

llama.cpp's CPU flash attention turns each quantized V row into float32 with ggml-base's
to_float (code * d, or code * d + m rounded twice: no fma there) and then runs
ggml_vec_mad_f32: acc = fma(v, vs, acc) element by element (GGML_F32_VEC_FMA, one rounding).
Every element is independent, so whole blocks go through <32 x float> at a time with the
same roundings; flash_attention_ref.py is the spec (its float64 fma emulation differs from
the one-rounding fma with probability ~2^-29, ggml_math.fma_f32).

The heads of a GQA group read the same V rows: v_keys_heads dequantizes each block once for
up to four of them (each head's accumulator keeps its own sequence of fmas, so the bits do
not change; the caller ends a run wherever any of the heads raises its maximum).

The K . Q dots reuse the weight row dots of dot_q32.py (the same ggml_vec_dot_q*_q8_0 order:
per block an <8 x i32> of 4-product lane sums, fma(dK*dQ, lanes, acc), then hsum_float_8).
"""
from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .dot_q32 import Q32, q32_values
from .ir_helpers import F32T, I8, I32, IRHelpers, c64, const_vec, counted_loop, target_features, vec
from .quant_kernels import IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1

_Q8_0 = "q8_0"


def _v_block(h, vrow, bi, qt):
    """Block bi of a V row as to_float gives it: <32 x float>."""
    b = h.b
    if qt == _Q8_0:
        vo = b.mul(bi, c64(34))
        f = b.sitofp(h.load(vrow, b.add(vo, c64(2)), vec(I8, 32)), vec(F32T, 32))
        return b.fmul(f, h.splat(h.load_f16(vrow, vo), 32))
    bs, has_min, _, offset, table = Q32[qt]
    vo = b.mul(bi, c64(bs))
    if table:   # iq4_nl: the signed table values, d * value
        f = b.sitofp(q32_values(h, vrow, vo, qt), vec(F32T, 32))
    else:
        q = b.zext(q32_values(h, vrow, vo, qt), vec(I32, 32))
        f = b.sitofp(b.sub(q, const_vec(I32, 32, offset)), vec(F32T, 32))
    y = b.fmul(f, h.splat(h.load_f16(vrow, vo), 32))
    if has_min:   # q*d + m: two roundings, as the plain C to_float
        y = b.fadd(y, h.splat(h.load_f16(vrow, b.add(vo, c64(2))), 32))
    return y


def _make_v_keys(qt):
    @intrinsic
    def v_keys(typingctx, vb, rows, i0, i1, vs, acc):
        """For i in i0..i1-1 in order: acc = fma(to_float(vb[rows[i]]), vs[i], acc).

        The online softmax's V steps for a run of keys whose weights are known and that
        leave the maximum where it is (the caller rescales acc before a key that raises it).
        Two 32-blocks of acc at a time stay in registers across the run (each element's own
        sequence of roundings is unchanged)."""
        sig = types.void(vb, rows, i0, i1, vs, acc)

        def codegen(context, builder, sig, args):
            b = builder
            h = IRHelpers(b, target_features(context))
            v = context.make_array(sig.args[0])(context, b, args[0])
            stride = cgutils.unpack_tuple(b, v.strides)[0]
            vbase = b.bitcast(v.data, I8.as_pointer())
            rows_p = context.make_array(sig.args[1])(context, b, args[1]).data
            vs_p = context.make_array(sig.args[4])(context, b, args[4]).data
            a = context.make_array(sig.args[5])(context, b, args[5])
            abase = b.bitcast(a.data, I8.as_pointer())
            nb = b.sdiv(cgutils.unpack_tuple(b, a.shape)[0], c64(32))
            i0 = args[2]
            n_keys = b.sub(args[3], i0)
            v32 = vec(F32T, 32)

            def group(bis):
                ptrs = [b.bitcast(h.ptr(abase, b.mul(bi, c64(128))), v32.as_pointer()) for bi in bis]
                inits = [b.load(p, align=4) for p in ptrs]

                def key(k, accs):
                    i = b.add(k, i0)
                    vrow = b.gep(vbase, [b.mul(b.load(b.gep(rows_p, [i])), stride)])
                    w = h.splat(b.load(b.gep(vs_p, [i])), 32)
                    return [h.fma(_v_block(h, vrow, bi, qt), w, acc) for bi, acc in zip(bis, accs)]
                outs = counted_loop(b, n_keys, 1, inits, key, "vkeys")
                for p, y in zip(ptrs, outs):
                    b.store(y, p, align=4)

            n_pairs = b.sdiv(nb, c64(2))
            with cgutils.for_range(b, n_pairs) as loop:
                bi = b.mul(loop.index, c64(2))
                group([bi, b.add(bi, c64(1))])
            with b.if_then(b.icmp_signed("!=", b.mul(n_pairs, c64(2)), nb)):
                group([b.sub(nb, c64(1))])
            return context.get_dummy_value()
        return sig, codegen
    return v_keys


def _make_v_keys_heads(qt, n_heads):
    @intrinsic
    def v_keys_heads(typingctx, vb, rows, i0, i1, vs, accs, h0):
        """For each head h in h0..h0+n_heads-1 and i in i0..i1-1 in order:
        accs[h] = fma(to_float(vb[rows[i]]), vs[h, i], accs[h]).

        v_keys for n_heads heads at once: a run of keys that leaves every one of their
        maxima where it is. Each V block is dequantized once per key for all of them. The
        accumulators stay in registers in pieces of W values per head (4 x 16 or 2 x 32
        floats on AVX2: eight ymm; 32 per head with AVX-512's 32 registers)."""
        sig = types.void(vb, rows, i0, i1, vs, accs, h0)

        def codegen(context, builder, sig, args):
            b = builder
            feats = target_features(context)
            h = IRHelpers(b, feats)
            width = 32 if (n_heads <= 2 or "+avx512f" in feats) else 16
            v = context.make_array(sig.args[0])(context, b, args[0])
            stride = cgutils.unpack_tuple(b, v.strides)[0]
            vbase = b.bitcast(v.data, I8.as_pointer())
            rows_p = context.make_array(sig.args[1])(context, b, args[1]).data
            w = context.make_array(sig.args[4])(context, b, args[4])
            w_stride = cgutils.unpack_tuple(b, w.strides)[0]
            wbase = b.bitcast(w.data, I8.as_pointer())
            a = context.make_array(sig.args[5])(context, b, args[5])
            a_stride = cgutils.unpack_tuple(b, a.strides)[0]
            abase = b.bitcast(a.data, I8.as_pointer())
            nb = b.sdiv(cgutils.unpack_tuple(b, a.shape)[1], c64(32))
            i0 = args[2]
            n_keys = b.sub(args[3], i0)
            heads = [b.add(args[6], c64(k)) for k in range(n_heads)]
            w_rows = [b.bitcast(b.gep(wbase, [b.mul(hh, w_stride)]), F32T.as_pointer()) for hh in heads]
            a_rows = [b.gep(abase, [b.mul(hh, a_stride)]) for hh in heads]
            vw = vec(F32T, width)

            def piece(bi, part):
                """Values part * width .. + width of block bi, for every head, over the run."""
                off = b.add(b.mul(bi, c64(128)), c64(4 * width * part))
                ptrs = [b.bitcast(h.ptr(row, off), vw.as_pointer()) for row in a_rows]
                inits = [b.load(p, align=4) for p in ptrs]

                def key(k, accs):
                    i = b.add(k, i0)
                    vrow = b.gep(vbase, [b.mul(b.load(b.gep(rows_p, [i])), stride)])
                    x = _v_block(h, vrow, bi, qt)
                    if width == 16:
                        x = h.half(x, part)
                    return [h.fma(x, h.splat(b.load(b.gep(wr, [i])), width), acc) for wr, acc in zip(w_rows, accs)]
                outs = counted_loop(b, n_keys, 1, inits, key, "vheads")
                for p, y in zip(ptrs, outs):
                    b.store(y, p, align=4)

            with cgutils.for_range(b, nb) as loop:
                for part in range(32 // width):
                    piece(loop.index, part)
            return context.get_dummy_value()
        return sig, codegen
    return v_keys_heads


_TYPES = {"q8_0": _Q8_0, "q4_0": Q4_0, "q4_1": Q4_1, "q5_0": Q5_0, "q5_1": Q5_1, "iq4_nl": IQ4_NL}
V_KEYS = {name: _make_v_keys(qt) for name, qt in _TYPES.items()}
V_KEYS_HEADS = {(name, n): _make_v_keys_heads(qt, n) for name, qt in _TYPES.items() for n in (2, 4)}



@intrinsic
def prefetch_rows(typingctx, a, first, step, count, span):
    """Prefetch every cache line of rows r .. r + span - 1 for r = first, first + step, ...
    (count of them) of the 2-D byte array a: the next chunk's K or V rows of a block of
    K/V heads, which sit n_kv rows apart (a strided walk the hardware prefetcher follows
    poorly with two cores reading)."""
    sig = types.void(a, first, step, count, span)

    def codegen(context, builder, sig, args):
        b = builder
        h = IRHelpers(b, target_features(context))
        arr = context.make_array(sig.args[0])(context, b, args[0])
        stride = cgutils.unpack_tuple(b, arr.strides)[0]
        width = b.mul(cgutils.unpack_tuple(b, arr.shape)[1], args[4])
        base = b.bitcast(arr.data, I8.as_pointer())
        n_lines = b.sdiv(b.add(width, c64(63)), c64(64))
        with cgutils.for_range(b, args[3]) as rows:
            r = b.add(args[1], b.mul(rows.index, args[2]))
            row = b.gep(base, [b.mul(r, stride)])
            with cgutils.for_range(b, n_lines) as lines:
                h.prefetch(b.gep(row, [b.mul(lines.index, c64(64))]))
        return context.get_dummy_value()
    return sig, codegen
