"""numpy's own OpenBLAS sgemm, called from inside Numba kernels (parallel regions included).

Work that multiplies float matrices with BLAS ran on the Python worker pool: numpy calls
need a Python thread. But after each prefill GEMM's parallel region libgomp's worker keeps
spinning on a core for a while, and the pool's threads then share the cores with it (the
long-prompt attention of a 1B-shaped model: 222 ms a 512-token prefill, 186 ms with the
spinning turned off). A Numba parallel region that calls sgemm itself runs on that worker
instead.

`sgemm_address()` finds the cblas_sgemm of the OpenBLAS numpy loaded (threadpoolctl names
its file) under the ILP64 names numpy's wheels export, or 0 where there is none of them
(another BLAS, or a 32-bit-integer build): callers then keep their numpy path. The address
is a run-time argument of the kernels, not a constant compiled in, so they stay in Numba's
on-disk cache.
"""
from __future__ import annotations

import ctypes
import functools

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .threads import single_threaded_blas

# cblas_sgemm with 64-bit integers: numpy >= 2's scipy-openblas, numpy 1.26's openblas64_
_ILP64_NAMES = ("scipy_cblas_sgemm64_", "cblas_sgemm64_")
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112   # CBLAS_ORDER / CBLAS_TRANSPOSE


@functools.cache
def sgemm_address() -> int:
    """The address of numpy's OpenBLAS cblas_sgemm (64-bit integer interface), 0 if none.
    Its threads are kept to one (threads.single_threaded_blas): each of ours calls it."""
    try:
        from threadpoolctl import threadpool_info

        single_threaded_blas()
        for info in threadpool_info():
            if info.get("internal_api") != "openblas":
                continue
            lib = ctypes.CDLL(info["filepath"])
            for name in _ILP64_NAMES:
                fn = getattr(lib, name, None)
                if fn is not None:
                    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)
    except (ImportError, OSError):
        pass
    return 0


@intrinsic
def sgemm(typingctx, fn, trans_b, m, n, k, a, a_off, lda, b, b_off, ldb, c, c_off, ldc):
    """C = A @ op(B), row-major float32: A (m x k) at a's data + a_off elements with row
    stride lda, op(B) (k x n) from b's data + b_off (trans_b: B is stored n x k), C (m x n)
    at c's data + c_off, row stride ldc. fn: sgemm_address(). Any array layout: only the
    data pointers are read."""
    sig = types.void(fn, trans_b, m, n, k, a, a_off, lda, b, b_off, ldb, c, c_off, ldc)

    def codegen(context, builder, sig, args):
        f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        fp = f32.as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, f32, fp, i64, fp, i64, f32, fp, i64])
        b = builder

        def wide(v):
            return b.sext(v, i64) if v.type.width < 64 else v

        def ptr(i_arr, i_off):
            data = context.make_array(sig.args[i_arr])(context, b, args[i_arr]).data
            return b.gep(b.bitcast(data, fp), [wide(args[i_off])])
        call = b.inttoptr(args[0], fnty.as_pointer())
        tb = b.select(b.icmp_signed("!=", wide(args[1]), ir.Constant(i64, 0)),
                      ir.Constant(i32, TRANS), ir.Constant(i32, NO_TRANS))
        b.call(call, [ir.Constant(i32, ROW_MAJOR), ir.Constant(i32, NO_TRANS), tb,
                      wide(args[2]), wide(args[3]), wide(args[4]), ir.Constant(f32, 1.0),
                      ptr(5, 6), wide(args[7]), ptr(8, 9), wide(args[10]), ir.Constant(f32, 0.0),
                      ptr(11, 12), wide(args[13])])
        return context.get_dummy_value()
    return sig, codegen
