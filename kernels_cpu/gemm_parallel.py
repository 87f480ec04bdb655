"""One parallel region for the prefill GEMMs (gemm_kquant, gemm_q32): row groups shared out by claims.

Both GEMMs compute 8 rows (a row group) at a time and had their row ranges run on the
Python worker pool: ~0.1 ms a call to hand out and collect the pieces on 2 threads, which
is most of a short prompt's product on a small matrix. Here the rows of up to three
matrices on the same activations (Q/K/V, gate/up) are shared out in one Numba parallel
region by claims on an atomic counter, as the decode matvecs are (dispatch.py): a thread
slowed by another process takes fewer. Each row group is computed whole by one thread,
so the results do not depend on the split.

`Driver(gemm_rows, tile)` copies the generic functions below with `_gemm_rows` and
`_TILE` bound to one GEMM's (as dispatch.KernelSet copies its kernels), each copy named
after it so each has its own file in Numba's on-disk cache.
"""
from __future__ import annotations

from types import FunctionType

import numpy as np
from numba import njit, prange

from .dispatch import CLAIMS_PER_THREAD, _fetch_add

GROUP_ROWS = 8      # rows a group (both GEMMs: one per 32-bit lane)
ITEM_GROUPS = 2     # row groups a work item (16 rows: the claim overhead, once per item)
_JIT = dict(cache=True, nogil=True)
_gemm_rows = _TILE = None   # bound in each Driver's copies


@njit(inline="always", **_JIT)
def _claimed(claims, nt, w1, q1, o1, w2, q2, o2, w3, q3, o3, xa, xb, xc):
    """On one thread: claim work items (ITEM_GROUPS row groups of o1's matrix, then o2's,
    then o3's) until none are left."""
    n1 = -(-(o1.shape[1] // GROUP_ROWS) // ITEM_GROUPS)
    n2 = -(-(o2.shape[1] // GROUP_ROWS) // ITEM_GROUPS)
    n3 = -(-(o3.shape[1] // GROUP_ROWS) // ITEM_GROUPS)
    n = n1 + n2 + n3
    step = max(1, n // (CLAIMS_PER_THREAD * nt))
    i0 = _fetch_add(claims, step)
    while i0 < n:
        for i in range(i0, min(i0 + step, n)):
            if i < n1:
                g = i * ITEM_GROUPS
                _gemm_rows(w1, q1, g, min(g + ITEM_GROUPS, o1.shape[1] // GROUP_ROWS), xa, xb, xc, _TILE, o1)
            elif i < n1 + n2:
                g = (i - n1) * ITEM_GROUPS
                _gemm_rows(w2, q2, g, min(g + ITEM_GROUPS, o2.shape[1] // GROUP_ROWS), xa, xb, xc, _TILE, o2)
            else:
                g = (i - n1 - n2) * ITEM_GROUPS
                _gemm_rows(w3, q3, g, min(g + ITEM_GROUPS, o3.shape[1] // GROUP_ROWS), xa, xb, xc, _TILE, o3)
        i0 = _fetch_add(claims, step)


@njit(parallel=True, **_JIT)
def _kernel(w1, q1, o1, w2, q2, o2, w3, q3, o3, xa, xb, xc, nt):
    # nt: the thread count, passed in (numba's get_num_threads inside a kernel would keep
    # it out of the on-disk cache)
    claims = np.zeros(1, np.int64)
    for _ in prange(nt):   # one iteration per thread
        _claimed(claims, nt, w1, q1, o1, w2, q2, o2, w3, q3, o3, xa, xb, xc)


class Driver:
    """The parallel region of one GEMM: `run(ws, qts, packed, outs, n_threads)`."""

    def __init__(self, gemm_rows, tile: int, name: str) -> None:
        g = dict(globals())
        g.update(_gemm_rows=gemm_rows, _TILE=tile)
        for fname in ("_claimed", "_kernel"):   # callee first
            generic = globals()[fname]
            f = generic.py_func
            copy = FunctionType(f.__code__, g, f"{fname}_{name}", f.__defaults__, f.__closure__)
            copy.__qualname__, copy.__module__ = f"{fname}_{name}", f.__module__
            opts = {k: v for k, v in generic.targetoptions.items() if k in ("parallel", "nogil", "inline")}
            g[fname] = njit(cache=True, **opts)(copy)
        self.kernel = g["_kernel"]

    def run(self, ws: list, qts: list, packed, outs: list, n_threads: int) -> None:
        """outs[i] (n_tok, rows_i) = the packed activations . ws[i], 1 to 3 matrices."""
        if not 1 <= len(ws) <= 3:
            raise ValueError(f"1 to 3 matrices a call, got {len(ws)}")
        none = np.empty((outs[0].shape[0], 0), np.float32)
        args = []
        for k in range(3):
            args += [ws[k], int(qts[k]), outs[k]] if k < len(ws) else [ws[0], int(qts[0]), none]
        self.kernel(*args, *packed, n_threads)
