"""Reports the first start's kernel compilation ("compiling kernels for this CPU ... 7/12").

Numba compiles a kernel on its first call and keeps it in its on-disk cache; on a cold
cache that takes seconds per kernel and the program looks hung. The CPU backend runs one
tiny forward pass at load (`warm_up`) under `reporting`, which counts the top-level
compilations (a kernel's callees compile inside it) and hands (done, total) to a callback:
the default one writes one line to stderr, updated in place on a terminal, plain lines
otherwise. A warm cache compiles nothing and prints nothing. A front end with its own
screen (the TUI) installs its callback with `set_reporter`.

Numba compiles under one lock per process, so a cold start compiles one kernel at a time.
On 2+ cores the work is shared. Kernels registered with `compile_elsewhere` (the K-quant
row quantizer, attention, the gated activation, quantize_act: about half of it) are
given to one second Python process, which compiles them in order, as a forward pass
needs them, into the shared on-disk cache; the first call needing one waits for its job
(`wait_for`) and loads it from the cache. Kernels registered with `compile_before` (the
decode step's matvec and fused MLP, needed only at the pass's end) compile here first,
so that neither process waits on the other. A warm cache starts no process.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
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


_elsewhere: dict = {}   # id(kernel) -> (kernel, job: Python code compiling it, priority)
_before: dict = {}      # id(kernel) -> (kernel, job): compiled here before the forward pass
_pending: dict = {}     # id(kernel) -> the _Helper compiling it, until a call waits for it


def compile_elsewhere(kernel, job: str, priority: int = 0) -> None:
    """Let a cold start give `kernel` to the second process (see the module docstring).
    `job` is Python source that compiles it with the exact signature this process calls it
    with (a wrong one costs only time: this process then compiles it itself). The second
    process runs its jobs by `priority`, lowest first: the kernels needed soonest."""
    _elsewhere[id(kernel)] = (kernel, job, priority)


def compile_before(kernel, job: str) -> None:
    """Let a cold start that shares its work with a second process compile `kernel` here
    first, before the forward pass: a kernel the pass needs only at its end (the decode
    matvec), which would otherwise leave this process idle while the other one still
    compiles the kernels the pass needs in its middle."""
    _before[id(kernel)] = (kernel, job)


class _Helper:
    """The second process: runs its jobs in order, printing `done N` after job N."""

    def __init__(self, jobs: list[str]) -> None:
        from numba.core import config

        env = dict(os.environ)
        if config.CACHE_DIR:
            env["NUMBA_CACHE_DIR"] = config.CACHE_DIR
        # a failing job does not stop the ones after it (this process compiles what it missed)
        code = "\n".join(f"try:\n    exec({job!r}, {{}})\nexcept Exception:\n    pass\n"
                         f"print('done {i}', flush=True)" for i, job in enumerate(jobs))
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.n_jobs = len(jobs)
        self.done: set[int] = set()
        self._lock = threading.Lock()

    def wait(self, job: int) -> None:
        """Until job `job` is done or the process has ended (a failed job: the caller compiles)."""
        with self._lock:
            while job not in self.done:
                line = self.proc.stdout.readline()
                if not line:   # ended: nothing more will come
                    self.proc.wait()
                    return
                if line.startswith("done "):
                    self.done.add(int(line.split()[1]))
            if len(self.done) == self.n_jobs:
                self.proc.wait()   # its last job is done: it exits now (reaped, not a zombie)


def pending_jobs() -> list:
    """(helper, job) pairs of the background compile jobs this process still waits on."""
    return list(_pending.values())


def wait_for(kernel) -> None:
    """Before `kernel`'s first call: wait for the second process's job compiling it, if
    there is one (then the call loads it from the on-disk cache)."""
    entry = _pending.pop(id(kernel), None)
    if entry is not None:
        helper, job = entry
        helper.wait(job)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _start_elsewhere(missing: list) -> bool:
    """Start the second process on the registered kernels among `missing`; True if it started."""
    if len(missing) < 2 or _cores() < 2:
        return False   # nothing to share the work with, or no second core to share it on
    entries = [_elsewhere[id(k)] for k in missing   # (a kernel also set to compile before stays here)
               if id(k) in _elsewhere and _elsewhere[id(k)][0] is k and id(k) not in _pending
               and id(k) not in _before]
    if not entries or len(entries) == len(missing):
        return False   # leave this process something to compile meanwhile
    entries.sort(key=lambda e: e[2])
    try:
        helper = _Helper([job for _, job, _ in entries])
    except OSError:
        return False   # this process compiles them, as without the helper process
    for i, (kernel, _, _) in enumerate(entries):
        _pending[id(kernel)] = (helper, i)
    return True


def _marker(key: str | None):
    """The file a finished pass with this key leaves in Numba's cache folder (None: no key,
    or no folder to keep it in)."""
    from numba.core import config

    if not key or not config.CACHE_DIR:
        return None
    return Path(config.CACHE_DIR) / "warmed" / hashlib.sha256(key.encode()).hexdigest()[:24]


def warm_up(run: Callable[[], object], kernels: Iterable, report: Reporter | None = None,
            key: str | None = None) -> int:
    """Run `run` (a tiny forward pass) under `reporting` unless every one of `kernels` is
    already compiled or cached on disk and, given a `key` (the model and what changes its
    pass), a pass with that key ran to its end on this cache before: `kernels` are the
    ones every model's pass compiles, but a pass reaches more (a recurrent layer's, an
    expert router's, a second head size's attention) that another model's pass left
    uncompiled. At a cold start, kernels registered with `compile_elsewhere` compile in a
    second process meanwhile. Returns how many kernels were compiled."""
    missing = [k for k in kernels if not on_disk(k)]
    marker = _marker(key)
    if not missing and (marker is None or marker.exists()):
        return 0
    shared = _start_elsewhere(missing)
    with reporting(len(missing), report) as counter:
        if shared:
            for k in missing:
                entry = _before.get(id(k))
                if entry is not None and entry[0] is k:
                    exec(entry[1], {})   # noqa: S102 - a job registered by this package's code
        run()
    if marker is not None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:
            pass   # a read-only cache: the pass runs again next time, nothing worse
    return counter.done if counter.started else 0
