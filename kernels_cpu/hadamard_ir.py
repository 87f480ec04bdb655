"""The butterfly of the K/V cache's Hadamard rotation (kv_quant_jit.fwht) as one vector op.

Numba's loop over the 32 rows of a transposed block does not vectorize (LLVM cannot prove
the two element rows apart), so the step is emitted directly: two <32 x float> loads, their
sum and difference (one rounding each, as the scalar u + v, u - v), two stores.
"""
from __future__ import annotations

from numba import types
from numba.extending import intrinsic

from .ir_helpers import F32T, vec

ROWS = 32   # the rows one butterfly takes: the width of kv_quant_jit's transposed blocks


@intrinsic
def butterfly_rows(typingctx, t, p, o):
    """t[p:p+32], t[o:o+32] = t[p:p+32] + t[o:o+32], t[p:p+32] - t[o:o+32] (t 1-D float32)."""
    sig = types.void(t, p, o)

    def codegen(context, builder, sig, args):
        b = builder
        arr = context.make_array(sig.args[0])(context, b, args[0])
        vt = vec(F32T, ROWS).as_pointer()
        pp = b.bitcast(b.gep(arr.data, [args[1]]), vt)
        po = b.bitcast(b.gep(arr.data, [args[2]]), vt)
        u = b.load(pp, align=4)
        v = b.load(po, align=4)
        b.store(b.fadd(u, v), pp, align=4)
        b.store(b.fsub(u, v), po, align=4)
        return context.get_dummy_value()
    return sig, codegen
