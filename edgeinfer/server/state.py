"""What every endpoint shares: the server's configuration and state (the model, the worker,
the metrics, and the model's keep-alive).

The state exists before the model does: `set_model` hands it over once loaded. After that
the model may be unloaded (Ollama's `keep_alive`) and `ensure_model` loads it again.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import anyio

from edgeinfer.errors import EdgeInferError
from edgeinfer.results import GenerationChunk
from edgeinfer.server.errors import APIError
from edgeinfer.server.keep_alive import FOREVER, parse_duration
from edgeinfer.server.metrics import Metrics
from edgeinfer.server.worker import Job, QueueFullError, Worker

log = logging.getLogger("edgeinfer.server")

MODEL_ALIASES = ("", "default")


@dataclass
class ServerConfig:
    model_name: str = "default"
    max_queue: int = 8
    timeout_s: float | None = None          # per request, queue wait included
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)
    max_body_bytes: int = 2 << 20
    sampling: dict[str, Any] = field(default_factory=dict)  # server-wide defaults (CLI flags)
    keep_alive_s: float = FOREVER           # idle seconds before the model is unloaded; <0 never


class ServerState:
    """What the endpoints share: the model (None while loading or unloaded), the worker,
    the metrics, and the model's keep-alive (who uses it, when it goes)."""

    def __init__(self, config: ServerConfig, loader: Callable[[], Any] | None = None) -> None:
        self.config = config
        self.model = None
        self.loader = loader  # loads the model again after an unload (serve.py's edgeinfer.load)
        self.load_error: str | None = None
        self.keep_alive_s = config.keep_alive_s  # this request's (the last one's) keep_alive
        self.reloading = False
        self._uses = 0                            # requests in flight that need the model
        self._expiry: asyncio.TimerHandle | None = None
        self._expires_at: float | None = None     # wall-clock unload time while idle
        self._load_lock = asyncio.Lock()
        self.metrics = Metrics()
        self.worker = Worker(config.max_queue, on_job_done=lambda job, _s: self.metrics.record_generation(job.last))
        self.metrics.bind(queue_depth=lambda: self.worker.queue_depth,
                          running=lambda: 1 if self.worker.busy else 0,
                          kv_used=self._kv_used, kv_capacity=self._kv_capacity)
        self.loaded = threading.Event()
        self.file_info = None            # the model file's facts, read once (ollama_api.model_info)
        self.tokenizer_limiter = None    # threads for tokenizer endpoints (llama_api), made in the loop

    def set_model(self, model) -> None:
        self.model = model
        if self.loader is None:  # no way to load it again: an unload only forgets it
            self.loader = lambda: model
        self.loaded.set()

    # -- keep-alive ---------------------------------------------------------------------------
    @property
    def unloaded(self) -> bool:
        """Loaded once and unloaded since (keep_alive), as opposed to still loading."""
        return self.model is None and self.loaded.is_set()

    def acquire(self) -> None:
        """A request that needs the model starts: no unloading until it ends."""
        self._uses += 1
        self.keep_alive_s = self.config.keep_alive_s  # Ollama: a request without keep_alive gets the default
        self._cancel_expiry()

    def release(self) -> None:
        """A request ends; the last one out starts the keep-alive clock."""
        self._uses -= 1
        if self._uses > 0 or self.model is None:
            return
        keep = self.keep_alive_s
        if keep == 0:
            self.unload()
        elif keep > 0:
            self._expiry = asyncio.get_running_loop().call_later(keep, self._expire)
            self._expires_at = time.time() + keep

    def apply_keep_alive(self, value) -> float | None:
        """A request's keep_alive (None: the server default) checked and made the model's;
        a bad value is a 400 naming the field."""
        if value is None:
            return None
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            raise APIError(400, f"invalid keep_alive: {exc}", param="keep_alive") from None
        self.keep_alive_s = seconds
        return seconds

    def expires_at(self) -> float | None:
        """When the loaded model will be unloaded (wall clock), None for never."""
        if self._expires_at is not None:
            return self._expires_at
        return None if self.keep_alive_s < 0 else time.time() + self.keep_alive_s

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = self._expires_at = None

    def _expire(self) -> None:
        self._expiry = self._expires_at = None
        if self._uses == 0:
            self.unload()

    def unload(self) -> None:
        """Drop the model (the worker is idle: the last request using it has ended), so its
        weights and mmap can go; the next request that needs it loads it again."""
        self._cancel_expiry()
        if self.model is None:
            return
        log.info("unloading %s (keep_alive)", self.config.model_name)
        self.model = None
        gc.collect()  # the model's KV pool and caches may sit in reference cycles

    async def ensure_model(self):
        """The model, loaded again (off the event loop, once for all waiters) if it was unloaded."""
        if not self.unloaded or self.loader is None:
            return self.require_model()
        async with self._load_lock:
            if self.model is None:
                self.reloading = True
                try:
                    model = await anyio.to_thread.run_sync(self.loader)
                except EdgeInferError as exc:
                    raise APIError(503, f"failed to load the model again: {exc}") from None
                except Exception as exc:  # noqa: BLE001 - the file changed under us, memory ran out...
                    log.error("reloading the model failed", exc_info=exc)
                    raise APIError(503, f"failed to load the model again: {type(exc).__name__}: {exc}") from None
                finally:
                    self.reloading = False
                self.model = model
        return self.require_model()

    def _kv_stats(self) -> dict:
        sessions = getattr(self.model, "sessions", None)
        return sessions.stats() if sessions is not None else {}

    def _kv_used(self) -> float:
        """Token slots in KV blocks held by sequences (the pool's used blocks)."""
        s = self._kv_stats()
        return float(s.get("used", 0) * s.get("block_size", 0))

    def _kv_capacity(self) -> float:
        s = self._kv_stats()
        return float(s.get("total", 0) * s.get("block_size", 0))

    # -- checks ----------------------------------------------------------------------------
    def require_model(self):
        if self.model is None:
            raise APIError(503, self.load_error or "the model is still loading; retry shortly",
                           headers={"retry-after": "1"})
        return self.model

    def model_names(self) -> set[str]:
        names = {self.config.model_name, self.config.model_name + ":latest"}
        if self.model is not None:
            p = Path(str(self.model.path))
            names |= {p.name, p.stem, p.stem + ":latest"}
        return names

    def check_model_name(self, name: str | None) -> None:
        """Requests name the model; the loaded one (or "default"/empty) is the only one here."""
        if name is None or name in MODEL_ALIASES or name in self.model_names():
            return
        raise APIError(404, f"model {name!r} not found; this server runs {self.config.model_name!r}",
                       param="model", code="model_not_found")

    def sampling(self, **request_values: Any) -> dict[str, Any]:
        """Server defaults overridden by the request's non-None values, checked."""
        from edgeinfer.sampling import SamplingParams  # (numpy: loaded on the first request, not at start-up)

        params = dict(self.config.sampling)
        params.update({k: v for k, v in request_values.items() if v is not None})
        try:
            SamplingParams(**params).validate()
        except EdgeInferError as exc:
            raise APIError(400, str(exc)) from None
        return params

    # -- generation ------------------------------------------------------------------------
    def submit(self, start: Callable[[threading.Event], Iterator[GenerationChunk]]) -> Job:
        self.require_model()
        loop = asyncio.get_running_loop()
        try:
            job = self.worker.submit(start, loop)
        except QueueFullError as exc:
            self.metrics.rejected.inc()
            raise APIError(429, f"the server is busy: {self.worker.max_queue} requests are already "
                           f"waiting; retry after {exc.retry_after_s}s", code="queue_full",
                           headers={"retry-after": str(exc.retry_after_s)}) from None
        if self.config.timeout_s:
            job.timer = loop.call_later(self.config.timeout_s, job.cancel_job, True)
        return job
