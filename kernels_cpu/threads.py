"""Thread count of the Numba kernels (the prange loops).

numba.set_num_threads is per calling thread; edgeinfer runs the engine in a worker
thread, so the count set here is kept module-wide and re-applied (cheaply) by every
kernel entry point in whichever thread calls it.
"""
from __future__ import annotations

import threading

import numba

_wanted: int | None = None
_applied = threading.local()  # the count this thread last set (numba's getter takes a lock)


def set_threads(n: int) -> None:
    """Use n threads (clamped to 1..NUMBA_NUM_THREADS) in the kernels, from any thread."""
    global _wanted
    _wanted = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(_wanted)
    _applied.count = _wanted


def get_threads() -> int:
    return _wanted if _wanted is not None else numba.get_num_threads()


def apply_threads() -> None:
    """Make the calling thread use the count chosen with set_threads (no-op if none chosen)."""
    if _wanted is not None and getattr(_applied, "count", None) != _wanted:
        numba.set_num_threads(_wanted)
        _applied.count = _wanted


_POOL: dict[int, object] = {}


def worker_pool(n: int):
    """A persistent pool of n Python threads for work that splits itself across cores
    outside Numba's parallel regions (the BLAS prefill GEMM and attention: numpy's BLAS is
    kept to one thread beside Numba, and releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = _POOL.get(n)
    if pool is None:
        _POOL.clear()
        pool = _POOL[n] = ThreadPoolExecutor(n, thread_name_prefix="edgeinfer-worker")
    return pool
