"""One worker thread runs generations one at a time; a bounded queue holds the rest.

The event loop never touches the model: a request submits a `Job` (a function that
starts a chunk iterator on the worker thread), then awaits the chunks the worker hands
back through `loop.call_soon_threadsafe`. Cancelling a job (client gone, timeout) sets
its Event: a running generation stops before its next token, a waiting one is taken
out of the queue at once so its place frees up. Who notices a client leaving is the
request's business (app.py's disconnect watcher); the job only offers `cancel_job`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
import time
from typing import Any, Callable, Iterator

from edgeinfer.results import GenerationChunk

StartFn = Callable[[threading.Event], Iterator[GenerationChunk]]

_END = object()       # the worker is done with a job
_job_ids = itertools.count(1)  # llama-server's id_task, as GET /slots shows it


class QueueFullError(Exception):
    """Every queue place is taken; carries the seconds a client should wait."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the server is busy ({retry_after_s}s)")
        self.retry_after_s = retry_after_s


class Job:
    """One submitted generation: its cancel flag and the channel its chunks come back on."""

    def __init__(self, start: StartFn, loop: asyncio.AbstractEventLoop,
                 on_cancel: Callable[["Job"], None] | None = None) -> None:
        self.start = start
        self.id = next(_job_ids)
        self._on_cancel = on_cancel  # the worker's hook: take a waiting job out of the line
        self.cancel = threading.Event()
        self.timed_out = False
        self.started = False
        self.timer: asyncio.TimerHandle | None = None  # the request timeout, when one is set
        self.last: GenerationChunk | None = None  # the final chunk (usage, timings)
        self.on_last: Callable[[GenerationChunk], None] | None = None  # told the final chunk (access log)
        self.watcher: asyncio.Future | None = None  # the request's disconnect watcher, stopped at the end
        self.params: dict | None = None  # the request's sampling settings (GET /slots shows the last ones)
        self.n_decoded = 0               # tokens generated so far (GET /slots' next_token.n_decoded)
        self._loop = loop
        self._chunks: asyncio.Queue = asyncio.Queue()
        self._ended = False

    # -- worker side --------------------------------------------------------------------
    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._chunks.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # -- request side -------------------------------------------------------------------
    async def next(self) -> GenerationChunk | None:
        """The next chunk, None at the end; raises the worker's exception if it failed."""
        if self._ended:
            return None
        item = await self._chunks.get()
        if item is _END:
            self._end()
            return None
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finish_reason is not None:
            self.last = item
            if self.on_last is not None:
                self.on_last(item)
        return item

    def _end(self) -> None:
        self._ended = True
        if self.watcher is not None:
            self.watcher.cancel()

    def cancel_job(self, timed_out: bool = False) -> None:
        """Stop this job (a no-op once its final chunk exists: a late timer changes nothing)."""
        if self.last is None and not self.cancel.is_set():
            self.timed_out = self.timed_out or timed_out
            self.cancel.set()
            if self._on_cancel is not None:
                self._on_cancel(self)


class Worker:
    """The single generation thread and its bounded waiting line."""

    def __init__(self, max_queue: int = 8, on_job_done: Callable[[Job, float], None] | None = None
                 ) -> None:
        self.max_queue = max_queue
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._mean_job_s = 1.0  # moving average, for Retry-After
        self._on_job_done = on_job_done

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            from edgeinfer.big_stack import start_thread

            # a large stack: the generation builds each request's grammar matcher
            self._thread = start_thread(self._loop, "edgeinfer-worker")

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            for job in self._waiting:
                job.cancel.set()
                job._put(_END)
            self._waiting.clear()
            if self._running is not None:
                self._running.cancel.set()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # -- queue ------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def running(self) -> Job | None:
        """The job the worker runs now (GET /slots reads its progress)."""
        return self._running

    def submit(self, start: StartFn, loop: asyncio.AbstractEventLoop, params: dict | None = None) -> Job:
        """Queue a job (`params`: its request's sampling settings, None for other work); raises
        QueueFullError when max_queue jobs already wait."""
        job = Job(start, loop, on_cancel=self._drop)
        job.params = params
        with self._cond:
            if self._stop:
                raise QueueFullError(1)
            if len(self._waiting) >= self.max_queue and (self._running is not None or self._waiting):
                wait = self._mean_job_s * (len(self._waiting) + 1)
                raise QueueFullError(max(1, math.ceil(wait)))
            self._waiting.append(job)
            self._cond.notify()
        return job

    def _drop(self, job: Job) -> None:
        """A cancelled job that has not started leaves the line now."""
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # already running (it will stop at its next token) or finished
        job._put(_END)

    # -- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                job = self._waiting.popleft()
                self._running = job
                job.started = True
            t0 = time.perf_counter()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None
                elapsed = time.perf_counter() - t0
                self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * elapsed
                if self._on_job_done is not None:
                    try:
                        self._on_job_done(job, elapsed)
                    except Exception:  # noqa: BLE001 - metrics must never stop the worker
                        pass
                job._put(_END)
                del job  # an idle worker holds no model: keep_alive's unload must be able to free it

    @staticmethod
    def _run(job: Job) -> None:
        try:
            for chunk in job.start(job.cancel):
                if chunk.finish_reason is not None:
                    job.last = chunk
                elif chunk.token is not None:
                    job.n_decoded += 1
                job._put(chunk)
        except BaseException as exc:  # noqa: BLE001 - handed to the request, which answers it
            job._put(exc)
