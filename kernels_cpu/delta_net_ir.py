"""One state row of the gated delta rule in LLVM IR, vectorized with ggml's bits.

The recurrence (kernels_cpu/delta_net.py) touches row j of a head's transposed state M only
through row j itself, k, q, v[j] and the step's scalars. So the four whole-state passes
llama.cpp makes per token (decay, k dots, the rank-1 update, q dots) can run row by row,
two passes over 32-float chunks of a row that stays in L1:

    pass 1: x = M[j, c] * exp(g)    acc_k = fma(x, k[c], acc_k)
            delta = (v[j] - reduce(acc_k)) * beta
    pass 2: x = fma(k[c], delta, M[j, c] * exp(g))  (stored)    acc_q = fma(x, q[c], acc_q)
            returns reduce(acc_q)

Pass 2 multiplies by exp(g) again rather than pass 1 storing the product: the same bits,
one store of the row instead of two (stores bound this loop).

Every element gets the same operations in the same order as ggml_vec_scale_f32,
ggml_vec_mad_f32 and ggml_vec_dot_f32 (AVX2: 4 x 8 lanes of fma over 32-float steps,
GGML_F32x8_REDUCE) give it, so the result is bit-identical to the scalar kernel and the
numpy reference. Rows whose length is not a multiple of 32 stay on the scalar kernel
(ggml adds that tail in double).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .ir_helpers import F32T, I64, IRHelpers, counted_loop, reduce_f32x8, target_features, vec

_V8 = vec(F32T, 8)


def _lane_vec(b, base, c, q):
    """Pointer to floats c*32 + 8q .. +8 of base (float*) as <8 x float>*."""
    off = b.add(b.mul(c, ir.Constant(I64, 32)), ir.Constant(I64, 8 * q))
    return b.bitcast(b.gep(base, [off]), _V8.as_pointer())


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c in float32, rounded once (llvm.fma.f32; loops over it vectorize)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, sig, args):
        f = builder.module.declare_intrinsic("llvm.fma", [F32T], ir.FunctionType(F32T, [F32T] * 3))
        return builder.call(f, args)
    return sig, codegen


ROWS = 2  # rows a call: their independent chains overlap (one row alone waits on its reductions)


@intrinsic
def rows_step(typingctx, m_addr, k_addr, q_addr, eg, v_addr, beta, scale, n_chunks, out_addr):
    """Pass 1 and 2 above on ROWS consecutive rows from m_addr (each n_chunks x 32 float32,
    updated in place) with k and q at k_addr, q_addr and the rows' v values at v_addr;
    writes each row's q dot times `scale` to out_addr."""
    sig = types.void(types.int64, types.int64, types.int64, types.float32, types.int64, types.float32,
                     types.float32, types.int64, types.int64)

    def codegen(context, b, sig, args):
        m_a, k_a, q_a, egv, v_a, betav, scalev, n, o_a = args
        h = IRHelpers(b, target_features(context))
        fp = F32T.as_pointer()
        m0, k, q, v, out = (b.inttoptr(a, fp) for a in (m_a, k_a, q_a, v_a, o_a))
        row_len = b.mul(n, ir.Constant(I64, 32))
        rows = [b.gep(m0, [b.mul(row_len, ir.Constant(I64, r))]) for r in range(ROWS)]
        zero = ir.Constant(_V8, [0.0] * 8)
        eg8 = h.splat(egv, 8)

        def decay_and_k(c, accs):
            out = list(accs)
            for lane in range(4):
                kc = b.load(_lane_vec(b, k, c, lane), align=4)
                for r, m in enumerate(rows):
                    x = b.fmul(b.load(_lane_vec(b, m, c, lane), align=4), eg8)  # stored by pass 2
                    out[4 * r + lane] = h.fma(x, kc, accs[4 * r + lane])
            return out

        acc_k = counted_loop(b, n, 1, [zero] * (4 * ROWS), decay_and_k, "dn.k")
        d8 = []
        for r in range(ROWS):
            vj = b.load(b.gep(v, [ir.Constant(I64, r)]), align=4)
            d8.append(h.splat(b.fmul(b.fsub(vj, reduce_f32x8(b, acc_k[4 * r:4 * r + 4])), betav), 8))

        def update_and_q(c, accs):
            out = list(accs)
            for lane in range(4):
                kc = b.load(_lane_vec(b, k, c, lane), align=4)
                qc = b.load(_lane_vec(b, q, c, lane), align=4)
                for r, m in enumerate(rows):
                    mp = _lane_vec(b, m, c, lane)
                    x = h.fma(kc, d8[r], b.fmul(b.load(mp, align=4), eg8))
                    b.store(x, mp, align=4)
                    out[4 * r + lane] = h.fma(x, qc, accs[4 * r + lane])
            return out

        acc_q = counted_loop(b, n, 1, [zero] * (4 * ROWS), update_and_q, "dn.q")
        for r in range(ROWS):
            b.store(b.fmul(reduce_f32x8(b, acc_q[4 * r:4 * r + 4]), scalev), b.gep(out, [ir.Constant(I64, r)]), align=4)
        return context.get_dummy_value()

    return sig, codegen
