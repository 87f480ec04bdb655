"""F16 weight rows dotted with a float32 activation, vectorized (decode's F16 matrices).

A row's F16 values are widened 8 at a time (vcvtph2ps with F16C; integer ops elsewhere,
ir_helpers.f16_lanes) and multiplied into four 8-lane fma accumulators over 32-value steps,
reduced as GGML_F32x8_REDUCE; the n % 32 tail is added in double. That is
ggml_vec_dot_f16's order with the activation kept in float32 (ggml rounds it to F16 first,
then its tinyBLAS tiles may sum in another order: F16 matrices are not bit-exact to
llama.cpp either way). The scalar loop this replaces ran at 0.8 GB/s on Gemma 4's 52 MiB
per-layer projection, a third of an E4B decode step.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .ir_helpers import F32T, I16, I64, IRHelpers, counted_loop, reduce_f32x8, target_features, vec
from .quant_kernels import f16

_V8 = vec(F32T, 8)
_JIT = dict(cache=True, nogil=True)


@intrinsic
def dot_f16_row(typingctx, w_addr, x_addr, n_chunks):
    """The dot of n_chunks x 32 F16 values at w_addr with float32 values at x_addr."""
    sig = types.float32(types.int64, types.int64, types.int64)

    def codegen(context, b, sig, args):
        h = IRHelpers(b, target_features(context))
        w = b.inttoptr(args[0], I16.as_pointer())
        x = b.inttoptr(args[1], F32T.as_pointer())
        zero = ir.Constant(_V8, [0.0] * 8)

        def step(c, accs):
            out = []
            for lane in range(4):
                off = b.add(b.mul(c, ir.Constant(I64, 32)), ir.Constant(I64, 8 * lane))
                wv = h.f16_lanes(b.load(b.bitcast(b.gep(w, [off]), vec(I16, 8).as_pointer()), align=2))
                xv = b.load(b.bitcast(b.gep(x, [off]), _V8.as_pointer()), align=4)
                out.append(h.fma(wv, xv, accs[lane]))
            return out

        return reduce_f32x8(b, counted_loop(b, args[2], 1, [zero] * 4, step, "f16dot"))

    return sig, codegen


@njit(parallel=True, **_JIT)
def matvec_f16(wh, x, out):
    """out = W @ x for F16 weights given as uint16 (n_rows, n_cols), rows in parallel."""
    n_cols = x.shape[0]
    n32 = n_cols - n_cols % 32
    xa = x.ctypes.data
    for r in prange(out.shape[0]):
        row = wh[r]
        acc = dot_f16_row(row.ctypes.data, xa, n32 // 32) if n32 else np.float32(0.0)
        total = np.float64(acc)
        for k in range(n32, n_cols):
            v = row[k]
            total += np.float64(np.float32(f16(v & 0xFF, v >> 8) * x[k]))
        out[r] = np.float32(total)
