"""The machine's read bandwidth as the kernels issue defines it: a Numba prange sum over a
512 MiB float32 array (far larger than L3). Shared by bench_kernels and compare_llamacpp."""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange

N_BYTES = 512 * 2**20


@njit(parallel=True, fastmath=True, cache=True)
def prange_sum(a):
    s = np.float32(0.0)
    for i in prange(a.shape[0]):
        s += a[i]
    return s


def big_array() -> np.ndarray:
    return np.ones(N_BYTES // 4, np.float32)


def read_bandwidth(repeat: int = 7) -> float:
    """Median bytes/s of `repeat` sums (after one warm-up) on the current thread count."""
    a = big_array()
    prange_sum(a)
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        prange_sum(a)
        ts.append(time.perf_counter() - t0)
    return a.nbytes / float(np.median(ts))
