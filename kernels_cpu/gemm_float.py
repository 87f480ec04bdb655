"""The vision encoders' float GEMM: thousands of patches through F16 or F32 matrices of a few MB.

    gemm(W, X, bias=None)     X (n_tok, k) @ W (n_rows, k).T [+ bias] -> (n_tok, n_rows) float32

numpy's BLAS (OpenBLAS, whose AVX2 or AVX-512 kernels it picks at run time) does the
products. On the encoders' shapes (4096 patches x 1152 x 4304, two Zen 3 threads) it ran at
~145-160 GFLOP/s, the Numba tile kernel it replaced at ~80-120. BLAS is kept to one thread
(threads.single_threaded_blas), so each worker thread takes one contiguous range of
rows, widens them from F16 to float32 (exact) a chunk at a time and multiplies that chunk
by all of X: BLAS packs X once a chunk, and the chunks are large. (The text model's prompt
path cuts rows into small tiles, each packing X again; on these shapes that ran at 70-95.)
Sums run in BLAS's order, which can change with the cut of the rows (the thread count): the
encoders agree with libmtmd to float32 rounding, not bits, and are held to it by tolerance
(tests/test_vision_*.py).
"""
from __future__ import annotations

import numpy as np

from .f16 import f16_to_f32
from .threads import get_threads, single_threaded_blas, worker_pool

CHUNK_VALUES = 1 << 22   # weights a thread widens to float32 at a time (16 MB)
MIN_ROWS = 8             # rows a thread's range holds at least


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
    out = np.empty((x.shape[0], n_rows), np.float32)
    single_threaded_blas()   # each of our threads calls it
    n_threads = max(1, min(get_threads(), n_rows // MIN_ROWS))
    cuts = [i * n_rows // n_threads for i in range(n_threads + 1)]
    chunk = max(1, CHUNK_VALUES // max(k, 1))

    def rows(part: int) -> None:
        for a in range(cuts[part], cuts[part + 1], chunk):
            b = min(a + chunk, cuts[part + 1])
            wf = f16_to_f32(w[a:b]) if w.dtype == np.float16 else w[a:b]
            y = out[:, a:b]
            np.matmul(x, wf.T, out=y)
            if bias is not None:
                y += bias[a:b]

    if n_threads == 1:
        rows(0)
    else:
        list(worker_pool(n_threads).map(rows, range(n_threads)))
    return out
