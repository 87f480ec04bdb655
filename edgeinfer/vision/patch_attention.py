"""Non-causal attention over an image's patches, shared by every ViT: heads and query slices
spread over the kernels' threads.

Per (head, query slice): the scores by BLAS, the unnormalized softmax weights and their sums
in one compiled pass (kernels_cpu.softmax_rows), the weighted V rows by BLAS, then each
output row divided by its sum. libmtmd normalizes the weights before the product instead;
the two differ in the last bits only."""
from __future__ import annotations

import numpy as np

from edgeinfer.kernels_cpu import get_threads
from edgeinfer.kernels_cpu.softmax_rows import exp_rows
from edgeinfer.kernels_cpu.threads import single_threaded_blas, worker_pool

QUERY_ROWS = 1024   # queries per slice: a score matrix is at most QUERY_ROWS x n (16384 patches: 64 MB)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, query_rows: int | None = None) -> np.ndarray:
    """softmax(q k^T * scale) v for every head, q k v (n, heads, d) -> (n, heads * d), scale > 0.
    Each (head, query slice) is one piece of work; BLAS and the softmax kernel release the
    GIL, so the pieces run side by side."""
    n, nh, d = q.shape
    rows = query_rows or QUERY_ROWS
    single_threaded_blas()   # the pieces run side by side, each calling BLAS
    out = np.empty((n, nh, d), np.float32)
    heads = [(np.ascontiguousarray(q[:, h]), np.ascontiguousarray(k[:, h]), np.ascontiguousarray(v[:, h]))
             for h in range(nh)]
    scale = np.float32(scale)

    def piece(job: tuple[int, int]) -> None:
        h, lo = job
        qh, kh, vh = heads[h]
        s = qh[lo:lo + rows] @ kh.T
        sums = np.empty(s.shape[0], np.float32)
        exp_rows(s, scale, sums)
        o = s @ vh
        o /= sums[:, None]
        out[lo:lo + rows, h] = o

    jobs = [(h, lo) for h in range(nh) for lo in range(0, n, rows)]
    n_threads = min(get_threads(), len(jobs))
    if n_threads > 1:
        list(worker_pool(n_threads).map(piece, jobs))
    else:
        for job in jobs:
            piece(job)
    return out.reshape(n, nh * d)
