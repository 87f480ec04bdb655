"""The vision encoders' float GEMM: thousands of patches through F16 or F32 matrices of a few MB.

    gemm(W, X, bias=None)     X (n_tok, k) @ W (n_rows, k).T [+ bias] -> (n_tok, n_rows) float32

numpy's BLAS (OpenBLAS, whose AVX2 or AVX-512 kernels it picks at run time) does the
products. On the encoders' shapes (4096 patches x 1152 x 4304, two Zen 3 threads) it ran at
~150-180 GFLOP/s, the Numba tile kernel it replaced at ~80-120. BLAS is kept to one thread
(threads.single_threaded_blas); the matrix is widened from F16 to float32 (exact) a chunk of
rows at a time, on all threads, and each worker thread multiplies its own contiguous range
of the tokens by the chunk, so X is read once a chunk and every output row is one thread's.
(Ranges of rows instead, each thread multiplying all of X: the same on the MLP's shapes,
15-25% slower on 1152 x 1152, where a thread's N was only 576. The text model's prompt path
cuts rows into small tiles, each packing X again: on these shapes 70-95 GFLOP/s.)
Sums run in BLAS's order, which can change with the cut of the tokens (the thread count): the
encoders agree with libmtmd to float32 rounding, not bits, and are held to it by tolerance
(tests/test_vision_*.py).
"""
from __future__ import annotations

import functools

import numpy as np

from .f16 import f16_to_f32
from .threads import get_threads, on_a_worker, single_threaded_blas, worker_pool

CHUNK_VALUES = 1 << 23   # weights widened to float32 at a time (32 MB: the ViTs' largest matrices, whole)


def gemm(w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x @ w.T (+ bias, added to each product as a separate add would) for w (n_rows, k)
    float32 or float16, x (n_tok, k) float32, bias (n_rows,)."""
    w = np.ascontiguousarray(w)
    if w.dtype not in (np.float32, np.float16):
        raise ValueError(f"gemm takes float32 or float16 weights, not {w.dtype}")
    x = np.ascontiguousarray(x, np.float32)
    if w.ndim != 2 or x.ndim != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"gemm needs (n, k) and (m, k), got {w.shape} and {x.shape}")
    n_rows, k = w.shape
    if bias is not None:
        if np.shape(bias) != (n_rows,):
            raise ValueError(f"gemm's bias has shape {np.shape(bias)}, not ({n_rows},)")
        bias = np.asarray(bias, np.float32)
    n_tok = x.shape[0]
    out = np.empty((n_tok, n_rows), np.float32)
    single_threaded_blas()   # each of our threads calls it
    n_threads = 1 if on_a_worker() else max(1, min(get_threads(), n_tok))
    cuts = [i * n_tok // n_threads for i in range(n_threads + 1)]
    n_chunks = -(-n_rows * k // CHUNK_VALUES) if k else 1
    chunk = max(1, -(-n_rows // max(n_chunks, 1)))   # rows a chunk, the chunks even

    def tokens(a: int, b: int, wf: np.ndarray, part: int) -> None:
        y = out[cuts[part]:cuts[part + 1], a:b]
        np.matmul(x[cuts[part]:cuts[part + 1]], wf.T, out=y)
        if bias is not None:
            y += bias[a:b]

    for a in range(0, n_rows, chunk):
        b = min(a + chunk, n_rows)
        run = functools.partial(tokens, a, b, f16_to_f32(w[a:b]) if w.dtype == np.float16 else w[a:b])
        if n_threads == 1:
            run(0)
        else:
            list(worker_pool(n_threads).map(run, range(n_threads)))
    return out
