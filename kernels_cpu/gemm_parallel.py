"""One parallel region for the prefill GEMMs (gemm_kquant, gemm_q32): row groups shared out by claims.

Both GEMMs compute 8 rows (a row group) at a time and had their row ranges run on the
Python worker pool: ~0.1 ms a call to hand out and collect the pieces on 2 threads, which
is most of a short prompt's product on a small matrix. Here the rows of up to three
matrices on the same activations (Q/K/V, gate/up) are shared out in one Numba parallel
region by claims on an atomic counter, as the decode matvecs are (dispatch.py): a thread
slowed by another process takes fewer. Each row group is computed whole by one thread,
so the results do not depend on the split.

A mixture-of-experts layer's busy experts run in one region too (`Driver.run_experts`):
work items are (expert, matrix, row item) triples over every expert's own token segment of
one packed buffer (`segment_layout`). Per-expert calls cost a pack and a region each,
~8% of a Qwen3-30B-A3B-shaped prefill.

`Driver(gemm_rows, segment, tile)` copies the generic functions below with `_gemm_rows`,
`_segment` and `_TILE` bound to one GEMM's (as dispatch.KernelSet copies its kernels),
each copy named after it so each has its own file in Numba's on-disk cache.
"""
from __future__ import annotations

from types import FunctionType

import numpy as np
from numba import njit, prange

from .dispatch import CLAIMS_PER_THREAD, _fetch_add
from .gemm_kquant_wide import GROUPS

GROUP_ROWS = 8      # rows a group (both GEMMs: one per 32-bit lane)
TOKENS_PAD = 4      # both GEMMs' token step: a packed segment's length is a multiple of it
# row groups a work item (32 rows: the claim overhead once), gemm_kquant_wide's step, so a
# work item's groups are the 32-row kernels' whole
ITEM_GROUPS = GROUPS
_JIT = dict(cache=True, nogil=True)
_gemm_rows = _segment = _TILE = None   # bound in each Driver's copies


def segment_layout(counts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the tokens of consecutive segments (counts[j] each) go in a packed buffer whose
    segments are each padded to a multiple of TOKENS_PAD: (seg, which, pos) with seg[j] the
    packed row where segment j starts (seg[-1] the total), and for input row i its segment
    which[i] and its position pos[i] inside it."""
    counts = np.asarray(counts, np.int64)
    seg = np.zeros(counts.shape[0] + 1, np.int64)
    np.cumsum(-(-counts // TOKENS_PAD) * TOKENS_PAD, out=seg[1:])
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    which = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
    return seg, which, np.arange(which.shape[0], dtype=np.int64) - first[which]


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


@njit(inline="always", **_JIT)
def _expert_claimed(claims, nt, w1, q1, o1, w2, q2, o2, n_mat, experts, seg, firsts, counts, n_per, xa, xb, xc):
    """On one thread: claim work items (expert j's row item r of matrix m, experts in turn)
    until none are left. Expert j's tokens are packed rows seg[j]..seg[j + 1] of xa/xb/xc
    and its outputs rows firsts[j]..firsts[j] + counts[j] of o1/o2; its rows of the
    weights are experts[j] * n_per onwards."""
    n_groups = n_per // GROUP_ROWS
    per_mat = -(-n_groups // ITEM_GROUPS)
    per_expert = per_mat * n_mat
    n = experts.shape[0] * per_expert
    step = max(1, n // (CLAIMS_PER_THREAD * nt))
    i0 = _fetch_add(claims, step)
    while i0 < n:
        for i in range(i0, min(i0 + step, n)):
            j = i // per_expert
            r = i - j * per_expert
            m = r // per_mat
            g = (r - m * per_mat) * ITEM_GROUPS
            g1 = min(g + ITEM_GROUPS, n_groups)
            w0 = experts[j] * n_per
            a0 = firsts[j]
            va, vb, vc = _segment(xa, xb, xc, seg[j], seg[j + 1])
            if m == 0:
                _gemm_rows(w1[w0:w0 + n_per], q1, g, g1, va, vb, vc, _TILE, o1[a0:a0 + counts[j]])
            else:
                _gemm_rows(w2[w0:w0 + n_per], q2, g, g1, va, vb, vc, _TILE, o2[a0:a0 + counts[j]])
        i0 = _fetch_add(claims, step)


@njit(parallel=True, **_JIT)
def _expert_kernel(w1, q1, o1, w2, q2, o2, n_mat, experts, seg, firsts, counts, n_per, xa, xb, xc, nt):
    claims = np.zeros(1, np.int64)
    for _ in prange(nt):   # one iteration per thread
        _expert_claimed(claims, nt, w1, q1, o1, w2, q2, o2, n_mat, experts, seg, firsts, counts, n_per,
                        xa, xb, xc)


def _copy(generic, g: dict, name: str):
    """A copy of the jitted function `generic` reading the globals g, named `name`."""
    f = generic.py_func
    copy = FunctionType(f.__code__, g, name, f.__defaults__, f.__closure__)
    copy.__qualname__, copy.__module__ = name, f.__module__
    opts = {k: v for k, v in generic.targetoptions.items() if k in ("parallel", "nogil", "inline")}
    return njit(cache=True, **opts)(copy)


class Driver:
    """The parallel region of one GEMM: `run(ws, qts, packed, outs, n_threads)`."""

    def __init__(self, gemm_rows, segment, tile: int, name: str) -> None:
        self._g = g = dict(globals())
        g.update(_gemm_rows=gemm_rows, _segment=segment, _TILE=tile)
        self._name, self._expert = name, None
        for fname in ("_claimed", "_kernel"):   # callee first
            g[fname] = _copy(globals()[fname], g, f"{fname}_{name}")
        self.kernel = g["_kernel"]

    @property
    def expert_kernel(self):
        """The experts' region, copied on first use (dense models never compile it)."""
        if self._expert is None:
            for fname in ("_expert_claimed", "_expert_kernel"):   # callee first
                self._g[fname] = _copy(globals()[fname], self._g, f"{fname}_{self._name}")
            self._expert = self._g["_expert_kernel"]
        return self._expert

    def run_experts(self, ws: list, qts: list, experts, seg, firsts, counts, n_per: int, packed,
                    outs: list, n_threads: int) -> None:
        """For each listed expert j (rows experts[j] * n_per onwards of every ws[i], n_per % 8
        == 0): outs[i][firsts[j]:firsts[j] + counts[j]] = its packed token segment
        seg[j]..seg[j + 1] . its rows. 1 or 2 matrices with the same n_per."""
        if not 1 <= len(ws) <= 2:
            raise ValueError(f"1 or 2 expert tensors a call, got {len(ws)}")
        i2 = len(ws) - 1
        self.expert_kernel(ws[0], int(qts[0]), outs[0], ws[i2], int(qts[i2]), outs[i2], len(ws),
                           np.ascontiguousarray(experts, np.int64), np.ascontiguousarray(seg, np.int64),
                           np.ascontiguousarray(firsts, np.int64), np.ascontiguousarray(counts, np.int64),
                           n_per, *packed, n_threads)

    def run(self, ws: list, qts: list, packed, outs: list, n_threads: int) -> None:
        """outs[i] (n_tok, rows_i) = the packed activations . ws[i], 1 to 3 matrices."""
        if not 1 <= len(ws) <= 3:
            raise ValueError(f"1 to 3 matrices a call, got {len(ws)}")
        none = np.empty((outs[0].shape[0], 0), np.float32)
        args = []
        for k in range(3):
            args += [ws[k], int(qts[k]), outs[k]] if k < len(ws) else [ws[0], int(qts[0]), none]
        self.kernel(*args, *packed, n_threads)


class Drivers:
    """A GEMM's drivers per set of weight types, each compiling only those types' code.

    The GEMM module's dispatching functions (`specialised`, callees first, ending with its
    `_gemm_rows`) test `_HAS_<TYPE> and qt == <TYPE>`; each type set gets copies of them
    with the other types' flags False, which Numba prunes before typing (as dispatch.py's
    kernel sets do). A cold start then compiles a model's one or two types, not all of
    them (gemm_q32's seven took ~30 s)."""

    def __init__(self, module_globals: dict, specialised: tuple, type_names: dict, tile: int, name: str) -> None:
        self._g, self._specialised, self._names = module_globals, specialised, type_names
        self._tile, self._name = tile, name
        self._drivers: dict = {}
        self._unions: list = []   # the type sets of use_types, latest first

    def use_types(self, qts) -> Driver | None:
        """Make one driver serve every call on these types (a model's: `for_types` of any
        subset then returns it), so that a model compiles one driver, not one per type
        set its calls happen to group. Each model loaded (a target and its draft) keeps
        its own. Returns it, or None where no type is this GEMM's."""
        key = tuple(sorted({int(q) for q in qts} & set(self._names)))
        if not key:
            return None
        if key in self._unions:
            self._unions.remove(key)
        self._unions.insert(0, key)
        return self.for_types(key)

    def run(self, ws: list, qts: list, packed, outs: list, n_threads: int) -> None:
        """outs[i] = the packed activations . ws[i] for 1 to 3 matrices (rows % 8 == 0), in one
        parallel region compiled for these types only."""
        self.for_types(qts).run(ws, qts, packed, outs, n_threads)

    def for_types(self, qts) -> Driver:
        key = tuple(sorted({int(q) for q in qts}))
        key = next((u for u in self._unions if set(key) <= set(u)), key)
        got = self._drivers.get(key)
        if got is None:
            unknown = [q for q in key if q not in self._names]
            if unknown:
                raise ValueError(f"the {self._name} GEMM has no kernels for type ids {unknown}")
            g = dict(self._g)
            g.update({f"_HAS_{n}": q in key for q, n in self._names.items()})
            suffix = "_".join(self._names[q] for q in key)
            for fname in self._specialised:
                # named by the driver too ("kquant_wide", "kquant"): copies that bind other
                # globals must not share Numba's cache entries
                g[fname] = _copy(self._g[fname], g, f"{fname}_{self._name}_{suffix}")
            got = self._drivers[key] = Driver(g[self._specialised[-1]], self._g["_segment"], self._tile,
                                              f"{self._name}_{suffix}")
        return got
