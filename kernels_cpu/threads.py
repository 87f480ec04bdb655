"""Thread count of the Numba kernels (the prange loops).

numba.set_num_threads is per calling thread; edgeinfer runs the engine in a worker
thread, so the count set here is kept module-wide and re-applied (cheaply) by every
kernel entry point in whichever thread calls it. Without a count chosen, the kernels use
one thread per physical core this process may run on (`default_threads`): a second thread
on a busy SMT sibling slows every parallel region to that sibling's pace.
"""
from __future__ import annotations

import os
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
    """The kernels' thread count: the one chosen with set_threads, else default_threads()."""
    if _wanted is None:
        set_threads(default_threads())
    return _wanted


def apply_threads() -> None:
    """Make the calling thread use the count chosen with set_threads (or the default)."""
    if _wanted is None:
        set_threads(default_threads())
    elif getattr(_applied, "count", None) != _wanted:
        numba.set_num_threads(_wanted)
        _applied.count = _wanted


SYSFS_CPU = "/sys/devices/system/cpu"


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read().strip()


def physical_cores(cpus=None, sysfs: str = SYSFS_CPU) -> int | None:
    """How many physical cores the logical CPUs `cpus` (default: this process's affinity)
    span, from sysfs topology: (physical_package_id, die_id, core_id) per CPU, else its
    thread_siblings_list. None where the topology cannot be read."""
    if cpus is None:
        if not hasattr(os, "sched_getaffinity"):
            return None
        cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        topo = os.path.join(sysfs, f"cpu{int(cpu)}", "topology")
        try:
            package = _read(os.path.join(topo, "physical_package_id"))
            core = _read(os.path.join(topo, "core_id"))
            try:
                die = _read(os.path.join(topo, "die_id"))
            except OSError:
                die = "0"
            cores.add(("core", int(package), int(die), int(core)))
        except (OSError, ValueError):
            try:
                cores.add(("siblings", _read(os.path.join(topo, "thread_siblings_list"))))
            except OSError:
                return None
    return len(cores) or None


def default_threads() -> int:
    """Physical cores in this process's CPU affinity (os.cpu_count() where unknown),
    at most NUMBA_NUM_THREADS; an explicit NUMBA_NUM_THREADS in the environment wins."""
    limit = numba.config.NUMBA_NUM_THREADS
    if os.environ.get("NUMBA_NUM_THREADS"):
        return limit
    n = physical_cores()
    if n is None:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, limit))


_POOL: dict[int, object] = {}


_WORKER_PREFIX = "edgeinfer-worker"


def on_a_worker() -> bool:
    """Whether this thread is one of worker_pool's: work it hands the pool again would wait
    behind itself (every worker busy waiting), so it runs its pieces itself."""
    return threading.current_thread().name.startswith(_WORKER_PREFIX)


def worker_pool(n: int):
    """A persistent pool of n Python threads for work that splits itself across cores
    outside Numba's parallel regions (the BLAS prefill GEMM and attention: numpy's BLAS is
    kept to one thread beside Numba, and releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = _POOL.get(n)
    if pool is None:
        _POOL.clear()
        pool = _POOL[n] = ThreadPoolExecutor(n, thread_name_prefix=_WORKER_PREFIX)
    return pool


# Long prompts' inputs (from this many elements) are cut into one piece per thread. Shorter
# ones stay on the calling thread: a parallel region's start, or handing pieces to the
# pool, costs more than their work.
# From 2^15 to 2^18: a 32-token prefill of gemma3-270m's norms 8.2 -> 3.6 ms (2 threads).
PARALLEL_MIN = 1 << 18


def team_threads(size: int) -> int:
    """On how many threads a row- or element-wise kernel over `size` elements runs: the
    kernels' count from PARALLEL_MIN elements, else 1 (the calling thread), and 1 on a
    worker_pool thread (the pool already keeps every core busy).

    The pieces run in a Numba parallel region (cut by `piece_bounds`), not on the worker
    pool: after each prefill GEMM's region its OpenMP worker spins on a core for a while,
    and pool threads started then share the cores with it (a 1B-shaped model's 512-token
    prefill spent 78 ms in RMSNorm in the model against 23 ms alone). A region of ours
    puts that spinning worker to work instead."""
    if size < PARALLEL_MIN or on_a_worker():
        return 1
    apply_threads()
    return get_threads()


@numba.njit(inline="always", cache=True, nogil=True)
def piece_bounds(n, n_pieces, p, align):
    """[lo, hi) of piece p of n_pieces over range(n), each inner edge a multiple of align."""
    lo = p * n // n_pieces // align * align
    hi = n if p == n_pieces - 1 else (p + 1) * n // n_pieces // align * align
    return lo, hi


def in_pieces(kernel, n: int, *arrays) -> None:
    """kernel(*(a[lo:hi] for a in arrays)) over pieces of the first axis (length n), on the
    worker threads when the input is prefill-sized; each element is computed as one call
    would compute it. (The vision encoders' ops; the text model's prefill ops run as
    `team_threads` says.)"""
    n_threads = get_threads()
    if n_threads < 2 or n < n_threads or arrays[0].size < PARALLEL_MIN or on_a_worker():
        kernel(*arrays)
        return
    cuts = [i * n // n_threads for i in range(n_threads + 1)]
    list(worker_pool(n_threads).map(lambda i: kernel(*(a[cuts[i]:cuts[i + 1]] for a in arrays)),
                                     range(n_threads)))


_blas_limited = False


def single_threaded_blas() -> None:
    """Keep numpy's BLAS to one thread, for the whole process (once; later calls cost a flag
    test). Its own threads compete with Numba's OpenMP workers, which spin after each parallel
    region (a 255-token Gemma prefill ran 11x slower: 15 vs 174 tok/s with 2 Numba threads),
    and the code that calls BLAS from our worker threads (the vision encoders' products and
    attention) would run threads x BLAS threads on the cores."""
    global _blas_limited
    if not _blas_limited:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1, user_api="blas")
        _blas_limited = True
