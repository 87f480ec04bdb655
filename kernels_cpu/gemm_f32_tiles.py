"""A float32 GEMM for long batches of tokens through small float matrices: the vision encoders'
linears (thousands of patches through matrices of a few MB).

    gemm(W, X, out)     out (n_tok, n_rows) = X (n_tok, k) @ W (n_rows, k).T, float32, k % 8 == 0

The tile is tinyBLAS's on AVX2: 4 weight rows x 3 tokens, twelve 8-lane accumulators along k
(one fma each per 8 values; 12 accumulators and 4 weight vectors fill the 16 registers), the
horizontal sums at the end. Tokens go in blocks of TOKEN_BLOCK whose rows stay in L2 while a
thread's weight rows pass over them four at a time (those stay in L1); each thread owns a
contiguous range of weight rows, so every output is written by one thread.

Why not numpy's BLAS: the engine keeps OpenBLAS to one thread beside Numba, and splitting a
product into row tiles on our threads re-packs all of X for every tile; at 4096 patches that
ran at ~70-95 GFLOP/s on two Zen 3 cores. Sums run in another order than BLAS's: results
agree to float32 rounding, not bits (the encoders are held to libmtmd by tolerance).
"""
from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from .ir_helpers import F16T, F32T, I16, I32, IRHelpers, c64, counted_loop, target_features, vec
from .threads import apply_threads, get_threads

TILE_ROWS, TILE_TOKENS = 3, 4
TOKEN_BLOCK = 48   # 48 tokens x 1152 values x 4 bytes = 216 KiB: in L2 beside the weights' rows


def _tile_codegen(half: bool):
    """acc[j, i] = w[r + i] . x[t + j] for i < TILE_ROWS, j < TILE_TOKENS (rows past the end
    read the last row); half: w holds F16 bits (uint16), widened as loaded (vcvtph2ps)."""
    def codegen(context, builder, sig, args):
        b = builder
        W = context.make_array(sig.args[0])(context, b, args[0])
        X = context.make_array(sig.args[2])(context, b, args[2])
        A = context.make_array(sig.args[4])(context, b, args[4])
        n_rows, k = cgutils.unpack_tuple(b, W.shape)
        n_tok = cgutils.unpack_tuple(b, X.shape)[0]
        last_r, last_t = b.sub(n_rows, c64(1)), b.sub(n_tok, c64(1))

        def clamp(first, n, last):
            rows = []
            for j in range(n):
                v = b.add(first, c64(j))
                rows.append(b.select(b.icmp_signed(">", v, last), last, v))
            return rows
        h = IRHelpers(b, target_features(context))
        wbase = b.bitcast(W.data, (I16 if half else F32T).as_pointer())
        xbase = b.bitcast(X.data, F32T.as_pointer())
        wrows = [b.gep(wbase, [b.mul(v, k)]) for v in clamp(args[1], TILE_ROWS, last_r)]
        xrows = [b.gep(xbase, [b.mul(v, k)]) for v in clamp(args[3], TILE_TOKENS, last_t)]
        v8 = vec(F32T, 8)
        zero = ir.Constant(v8, [0.0] * 8)

        def wload(p, i):
            if not half:
                return b.load(b.bitcast(b.gep(p, [i]), v8.as_pointer()), align=4)
            bits = b.load(b.bitcast(b.gep(p, [i]), vec(I16, 8).as_pointer()), align=2)
            return b.fpext(b.bitcast(bits, vec(F16T, 8)), v8)

        def step(i, accs):
            ws = [wload(p, i) for p in wrows]
            xs = [b.load(b.bitcast(b.gep(p, [i]), v8.as_pointer()), align=4) for p in xrows]
            return [h.fma(ws[ri], xs[tj], accs[tj * TILE_ROWS + ri])
                    for tj in range(TILE_TOKENS) for ri in range(TILE_ROWS)]
        fin = counted_loop(b, k, 8, [zero] * (TILE_ROWS * TILE_TOKENS), step, "f32tile")
        out = b.bitcast(A.data, F32T.as_pointer())
        for n, v in enumerate(fin):
            b.store(h.hsum_f32(v), b.gep(out, [ir.Constant(I32, n)]))
        return context.get_dummy_value()
    return codegen


@intrinsic
def _tile32(typingctx, w, r, x, t, acc):
    return types.void(w, r, x, t, acc), _tile_codegen(False)


@intrinsic
def _tile16(typingctx, w, r, x, t, acc):
    return types.void(w, r, x, t, acc), _tile_codegen(True)


@njit(parallel=True, nogil=True, cache=True)
def _gemm(w, half, x, out, token_block, n_threads):
    # n_threads passed in: numba's get_num_threads inside a kernel keeps it out of the disk cache
    n_tok, n_rows = out.shape
    groups = (n_rows + TILE_ROWS - 1) // TILE_ROWS
    n_threads = min(n_threads, groups)
    for part in prange(n_threads):
        g0 = part * groups // n_threads
        g1 = (part + 1) * groups // n_threads
        acc = np.empty((TILE_TOKENS, TILE_ROWS), np.float32)
        for t0 in range(0, n_tok, token_block):
            t1 = min(t0 + token_block, n_tok)
            for g in range(g0, g1):
                r = g * TILE_ROWS
                nr = min(TILE_ROWS, n_rows - r)
                for t in range(t0, t1, TILE_TOKENS):
                    if half:
                        _tile16(w, r, x, t, acc)
                    else:
                        _tile32(w, r, x, t, acc)
                    for j in range(min(TILE_TOKENS, t1 - t)):
                        for i in range(nr):
                            out[t + j, r + i] = acc[j, i]


@functools.cache
def _f16c() -> bool:
    return "+f16c" in target_features(cpu_target.target_context)


def gemm(w: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x @ w.T for w (n_rows, k) float32 or float16, x (n_tok, k) float32, k a multiple of 8."""
    w = np.ascontiguousarray(w)
    if w.dtype not in (np.float32, np.float16):
        raise ValueError(f"gemm takes float32 or float16 weights, not {w.dtype}")
    if w.dtype == np.float16 and not _f16c():
        w = w.astype(np.float32)   # without F16C, LLVM's half widening calls a helper Numba's JIT lacks
    half = w.dtype == np.float16
    x = np.ascontiguousarray(x, np.float32)
    if w.ndim != 2 or x.ndim != 2 or w.shape[1] != x.shape[1] or w.shape[1] % 8:
        raise ValueError(f"gemm needs (n, k) and (m, k) with k % 8 == 0, got {w.shape} and {x.shape}")
    if out is None:
        out = np.empty((x.shape[0], w.shape[0]), np.float32)
    apply_threads()
    _gemm(w.view(np.uint16) if half else w, half, x, out, TOKEN_BLOCK, get_threads())
    return out
