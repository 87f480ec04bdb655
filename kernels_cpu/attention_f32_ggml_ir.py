"""attention_f32_ggml's scores for `lanes` keys at once, one key a lane, each (query, key)
pair in ggml_vec_dot_f32's own order (f32_ggml.vec_dot_f32): its 4 x lanes slots, each one
fma chain over the steps; slots l, l + lanes, l + 2 lanes, l + 3 lanes reduced as
(0 + 2) + (1 + 3); the lanes' horizontal sum as ggml's (f32_ggml._hsum); then the tail,
products rounded on their own and added in order, the last few fused (f32_ggml._tail).

Written in a pair's own scalar terms that is ~36 dependent scalar ops a pair; with the keys
in the vector lanes every op serves `lanes` pairs, and the slots' vectors stay in registers.
K comes in blocks of `lanes` keys, each transposed (blocks, head size, lanes): a slot's
value for the block's keys is one load, and a block's values lie together (K^T's rows, a
whole key count apart, had put each in another page: 2.5x slower).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .ir_helpers import F32T, IRHelpers, arithmetic_fence, c64, counted_loop, target_features, vec


def _hsum_slots(b, red, lanes):
    """f32_ggml._hsum of red[0..lanes-1] (each a vector over the keys)."""
    if lanes == 16:   # _mm512_reduce_add_ps: ggml_math.hsum16
        h = [b.fadd(b.fadd(red[i], red[i + 8]), b.fadd(red[i + 4], red[i + 12])) for i in range(4)]
        return b.fadd(b.fadd(h[0], h[2]), b.fadd(h[1], h[3]))
    t = [b.fadd(red[i], red[i + 4]) for i in range(4)]
    return b.fadd(b.fadd(t[0], t[1]), b.fadd(t[2], t[3]))


def _codegen(lanes):
    def codegen(context, builder, sig, args):
        b = builder
        h = IRHelpers(b, target_features(context))
        q = context.make_array(sig.args[0])(context, builder, args[0])
        kt = context.make_array(sig.args[1])(context, builder, args[1])
        out = context.make_array(sig.args[4])(context, builder, args[4])
        i, j0 = args[2], args[3]
        fv = vec(F32T, lanes)
        qrow = b.bitcast(b.gep(b.bitcast(q.data, ir.IntType(8).as_pointer()),
                               [b.mul(i, cgutils.unpack_tuple(b, q.strides)[0])]), F32T.as_pointer())
        kt_strides = cgutils.unpack_tuple(b, kt.strides)
        kbase = b.gep(b.bitcast(kt.data, ir.IntType(8).as_pointer()), [b.mul(b.sdiv(j0, c64(lanes)), kt_strides[0])])
        kt_stride = kt_strides[1]
        d = cgutils.unpack_tuple(b, q.shape)[1]
        step = 4 * lanes
        body = b.sub(d, b.srem(d, c64(step)))

        def keys(k):   # element k of the block's lanes keys
            return h.load(kbase, b.mul(k, kt_stride), fv)

        def qsplat(k):
            return h.splat(b.load(b.gep(qrow, [k])), lanes)

        zero = ir.Constant(fv, [0.0] * lanes)
        red = []
        for slot in range(lanes):   # slots slot, + lanes, + 2 lanes, + 3 lanes: one fma chain each
            def steps(i0, accs, slot=slot):
                return [h.fma(qsplat(k), keys(k), a) for a, k in
                        zip(accs, [b.add(i0, c64(slot + m * lanes)) for m in range(4)])]
            a = counted_loop(b, body, step, [zero] * 4, steps, f"slot{slot}")
            red.append(b.fadd(b.fadd(a[0], a[2]), b.fadd(a[1], a[3])))
        s = _hsum_slots(b, red, lanes)
        left = b.sub(d, body)   # f32_ggml._tail: whole vectors (then half a vector) unfused, the rest fused
        plain = b.add(body, b.mul(b.sdiv(left, c64(lanes)), c64(lanes)))
        half = b.icmp_signed(">=", b.srem(left, c64(lanes)), c64(lanes // 2))
        plain = b.select(half, b.add(plain, c64(lanes // 2)), plain)
        s = counted_loop(b, b.sub(plain, body), 1, [s],
                         lambda k, acc: [b.fadd(acc[0], arithmetic_fence(b, b.fmul(qsplat(b.add(body, k)),
                                                                          keys(b.add(body, k)))))], "unfused")[0]
        s = counted_loop(b, b.sub(d, plain), 1, [s],
                         lambda k, acc: [h.fma(qsplat(b.add(plain, k)), keys(b.add(plain, k)), acc[0])], "fused")[0]
        orow = b.gep(b.bitcast(out.data, ir.IntType(8).as_pointer()),
                     [b.add(b.mul(i, cgutils.unpack_tuple(b, out.strides)[0]), b.mul(j0, c64(4)))])
        b.store(s, b.bitcast(orow, fv.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _make(lanes):
    codegen = _codegen(lanes)

    @intrinsic
    def scores_block(typingctx, q, kt, i, j0, out):
        """out[i, j0 + l] = ggml_vec_dot_f32(K[j0 + l], q[i]) for l < lanes; kt[b, e, l] = K[b lanes + l, e]."""
        return types.void(q, kt, i, j0, out), codegen
    return scores_block


scores_block8, scores_block16 = _make(8), _make(16)
