"""The first start's compile progress: counted, shown on stderr, silent when nothing compiles."""
from __future__ import annotations

import io

import numpy as np
from numba import njit

from edgeinfer.kernels_cpu import compile_progress as cp


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _fresh_kernels():
    """Two new kernels (no cache): `outer` calls `inner`, so compiling it compiles both."""
    @njit
    def inner(x):
        return x * 2.0

    @njit
    def outer(x):
        return inner(x) + 1.0

    @njit
    def other(x):
        return x - 1.0
    return outer, other


def test_plain_lines_when_not_a_terminal():
    stream = _Stream(tty=False)
    report = cp.stderr_reporter(stream)
    report(0, 3, False)
    report(1, 3, False)
    report(3, 3, False)
    report(3, 3, True)   # the end repeats nothing
    assert stream.getvalue().splitlines() == [f"{cp.MESSAGE}: 0/3", f"{cp.MESSAGE}: 1/3", f"{cp.MESSAGE}: 3/3"]
    assert "\r" not in stream.getvalue()


def test_one_line_updated_in_place_on_a_terminal():
    stream = _Stream(tty=True)
    report = cp.stderr_reporter(stream)
    report(0, 2, False)
    report(1, 2, False)
    report(2, 2, True)
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith(f"{cp.MESSAGE}: 2/2\n")
    assert text.count("\r") == 3


def test_counts_top_level_compilations_only():
    outer, other = _fresh_kernels()
    calls = []
    with cp.reporting(2, lambda d, t, f: calls.append((d, t, f))) as counter:
        outer(np.float64(1.0))   # inner compiles inside outer: one kernel
        other(np.float64(1.0))
    assert counter.done == 2
    assert calls[0] == (0, 2, False) and calls[-1] == (2, 2, True)
    assert (1, 2, False) in calls


def test_silent_when_nothing_compiles():
    outer, _ = _fresh_kernels()
    outer(np.float64(1.0))
    calls = []
    with cp.reporting(5, lambda *a: calls.append(a)):
        outer(np.float64(2.0))   # compiled already
    assert calls == []


def test_warm_up_skips_the_pass_when_every_kernel_is_ready():
    outer, other = _fresh_kernels()
    outer(np.float64(1.0))
    other(np.float64(1.0))
    ran = []
    assert cp.warm_up(lambda: ran.append(1), [outer, other], report=lambda *a: None) == 0
    assert ran == []


def test_warm_up_compiles_and_reports_what_is_missing():
    outer, other = _fresh_kernels()
    stream = _Stream(tty=False)
    compiled = cp.warm_up(lambda: (outer(np.float64(1.0)), other(np.float64(1.0))), [outer, other],
                          report=cp.stderr_reporter(stream))
    assert compiled == 2
    assert stream.getvalue().splitlines()[-1] == f"{cp.MESSAGE}: 2/2"


def test_a_failing_reporter_does_not_stop_the_load():
    outer, _ = _fresh_kernels()

    def broken(*_):
        raise OSError("stderr closed")
    assert cp.warm_up(lambda: outer(np.float64(1.0)), [outer], report=broken) == 1


def test_set_reporter_swaps_the_default():
    mine = lambda *a: None  # noqa: E731
    previous = cp.set_reporter(mine)
    try:
        assert cp.get_reporter() is mine
    finally:
        cp.set_reporter(previous)
