"""Reports the first start's kernel compilation ("compiling kernels for this CPU ... 7/12").

Numba compiles a kernel on its first call and keeps it in its on-disk cache; on a cold
cache that takes seconds per kernel and the program looks hung. The CPU backend runs one
tiny forward pass at load (`warm_up`) under `reporting`, which counts the top-level
compilations (a kernel's callees compile inside it) and hands (done, total) to a callback:
the default one writes one line to stderr, updated in place on a terminal, plain lines
otherwise. A warm cache compiles nothing and prints nothing. A front end with its own
screen (the TUI) installs its callback with `set_reporter`.

Numba compiles under one lock per process, so a cold start compiles one kernel at a time.
A kernel registered with `compile_elsewhere` (the attention kernel, the largest) is given
to a second Python process at a cold start, which writes it into the shared on-disk cache
while this one compiles the rest; the first call that needs it waits for that process
(`wait_for`) and loads it from the cache. A warm cache starts no process.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterable

MESSAGE = "compiling kernels for this CPU (first start only)"

# report(done, total, finished): called when compiling starts, after each kernel, and once
# with finished=True at the end (only where something was compiled)
Reporter = Callable[[int, int, bool], None]


def stderr_reporter(stream=None) -> Reporter:
    """The default reporter: `MESSAGE: done/total` on `stream` (stderr), one line rewritten
    with a carriage return on a terminal, one line per update otherwise."""
    last = [None]

    def report(done: int, total: int, finished: bool) -> None:
        out = stream if stream is not None else sys.stderr
        try:
            tty = out.isatty()
        except (AttributeError, ValueError):
            tty = False
        text = f"{MESSAGE}: {done}/{total}"
        if tty:
            out.write("\r\x1b[2K" + text + ("\n" if finished else ""))
        elif text != last[0]:
            out.write(text + "\n")
        last[0] = text
        out.flush()
    return report


_reporter: Reporter | None = stderr_reporter()


def set_reporter(report: Reporter | None) -> Reporter | None:
    """Install the callback later loads report to (None: silent); returns the previous one."""
    global _reporter
    previous, _reporter = _reporter, report
    return previous


def get_reporter() -> Reporter | None:
    return _reporter


def on_disk(dispatcher) -> bool:
    """Whether Numba's cache holds an index for this kernel (some signature of it compiled
    before) or this process already has it compiled."""
    if getattr(dispatcher, "overloads", None):
        return True
    cache = getattr(dispatcher, "_cache", None)
    index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
    return bool(index) and os.path.exists(index)


class _Counter:
    """A numba:compile listener counting top-level compilations (per thread depth)."""

    def __init__(self, total: int, report: Reporter | None) -> None:
        self.total, self.report = max(total, 1), report
        self.done = 0
        self.started = False
        self._depth = threading.local()
        self._lock = threading.Lock()

    def on_start(self, _event) -> None:
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        if depth == 0 and not self.started:
            self.started = True
            self._emit(False)

    def on_end(self, _event) -> None:
        self._depth.n = getattr(self._depth, "n", 1) - 1
        if self._depth.n == 0:
            with self._lock:
                self.done += 1
                self.total = max(self.total, self.done)
            self._emit(False)

    def finish(self) -> None:
        if self.started:
            self.done = self.total
            self._emit(True)

    def _emit(self, finished: bool) -> None:
        if self.report is not None:
            try:
                self.report(self.done, self.total, finished)
            except Exception:  # noqa: BLE001 - a broken progress display must not stop a load
                pass


@contextmanager
def reporting(total: int, report: Reporter | None = None):
    """Count the Numba compilations inside the block (total: the expected number) and
    report them; yields the counter (`.done`, `.started`)."""
    from numba.core import event

    counter = _Counter(total, report if report is not None else _reporter)
    listener = type("_CompileListener", (event.Listener,), {
        "on_start": lambda self, ev: counter.on_start(ev),
        "on_end": lambda self, ev: counter.on_end(ev),
    })()
    event.register("numba:compile", listener)
    try:
        yield counter
    finally:
        event.unregister("numba:compile", listener)
    counter.finish()


_elsewhere: dict = {}   # id(kernel) -> [kernel, starts a process compiling it into the cache]
_pending: dict = {}     # id(kernel) -> that process, until a call waits for it


def compile_elsewhere(kernel, start: Callable[[], subprocess.Popen]) -> None:
    """Let a cold start give `kernel` to the process `start()` launches (see the module
    docstring); the process must compile it with the signature this process calls."""
    _elsewhere[id(kernel)] = [kernel, start]


def wait_for(kernel) -> None:
    """Before `kernel`'s first call: wait for the process compiling it, if there is one."""
    proc = _pending.pop(id(kernel), None)
    if proc is not None:
        proc.wait()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _start_elsewhere(missing: list) -> None:
    if len(missing) < 2 or _cores() < 2:
        return   # nothing to share the work with, or no second core to share it on
    for k in missing:
        entry = _elsewhere.get(id(k))
        if entry is not None and entry[0] is k and id(k) not in _pending:
            try:
                _pending[id(k)] = entry[1]()
            except OSError:
                pass   # this process compiles it, as without the helper process


def warm_up(run: Callable[[], object], kernels: Iterable, report: Reporter | None = None) -> int:
    """Run `run` (a tiny forward pass) under `reporting` unless every one of `kernels` is
    already compiled or cached on disk; at a cold start, kernels registered with
    `compile_elsewhere` compile in a second process meanwhile. Returns how many kernels
    were compiled."""
    missing = [k for k in kernels if not on_disk(k)]
    if not missing:
        return 0
    _start_elsewhere(missing)
    with reporting(len(missing), report) as counter:
        run()
    return counter.done if counter.started else 0
