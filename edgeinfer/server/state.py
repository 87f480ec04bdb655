"""What every endpoint shares: the server's configuration and state (the models, the worker,
the metrics, and each model's keep-alive).

The state exists before the model does: `set_model` hands the served model over once loaded.
After that it may be unloaded (Ollama's `keep_alive`) and `ensure_model` loads it again. A
request naming another local model gets it loaded in its own slot (slots.py); the model a
request uses is its slot's, set by the model gate for the request (`current_slot`), the
served model's otherwise.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
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
from edgeinfer.server.slot_status import LastTask
from edgeinfer.server.slots import Slot, current_slot
from edgeinfer.server.worker import Job, QueueFullError, Worker

log = logging.getLogger("edgeinfer.server")

MODEL_ALIASES = ("", "default")
# seconds the request's model took to load for it (0 when it was resident): Ollama's load_duration
load_seconds: contextvars.ContextVar[float] = contextvars.ContextVar("edgeinfer_load_seconds", default=0.0)
# the sampling settings `sampling` checked for this request: `submit` hands them to the job, so
# GET /slots can show the last request's (every dialect calls both, none passes them on itself)
request_params: contextvars.ContextVar[dict | None] = contextvars.ContextVar("edgeinfer_request_params",
                                                                            default=None)


def kv_cache_types(model) -> dict:
    """The model's K/V cache types as llama.cpp names them (-ctk / -ctv), for /props and /api/ps."""
    types = getattr(getattr(model, "engine", None), "cache_types", None)
    return {"cache_type_k": getattr(types, "k", "f16"), "cache_type_v": getattr(types, "v", "f16")}


@dataclass
class ServerConfig:
    model_name: str = "default"
    aliases: list[str] = field(default_factory=list)  # more names of the served model (serve --alias a,b)
    tags: list[str] = field(default_factory=list)     # listed on /v1/models, nothing else (serve --tags)
    any_model_name: bool = False            # one model file served: any name means it (no --strict-model-names)
    max_queue: int = 8
    timeout_s: float | None = None          # per request, queue wait included
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)
    max_body_bytes: int = 2 << 20
    sampling: dict[str, Any] = field(default_factory=dict)  # server-wide defaults (CLI flags)
    keep_alive_s: float = FOREVER           # idle seconds before the model is unloaded; <0 never
    max_models: int = 1                     # models resident at once (least recently used goes)
    bind_host: str = "127.0.0.1"            # where the server listens (store changes need loopback or a key)
    load_wait_s: float = 60.0               # how long a request waits for its model to load, else 503
    model_options: dict[str, Any] = field(default_factory=dict)  # edgeinfer.load keywords for other models
    pooling: str | None = None              # embeddings' pooling over the file's (llama.cpp's --pooling)
    rerank: bool = False                    # POST /v1/rerank and kin (llama-server's --rerank); else 501
    slot_save_path: str | None = None       # folder of /slots save/restore files; None: those are refused
    slots_endpoint: bool = True             # GET /slots (llama-server's --slots / --no-slots)
    reasoning: str = "auto"                 # thinking when a request does not say: on, off, auto (the template's)
    verbose: bool = False                   # llama-server's --verbose: answers carry `__verbose` unless asked not to
    allow_image_urls: bool = False          # fetch http(s) image URLs a request names (serve --allow-image-urls)
    max_image_bytes: int = 20 << 20         # an image's bytes (sent or fetched), bounded before it is decoded

    @property
    def default_think(self) -> bool | None:
        """`reasoning` as a thinking switch: True, False, or None for the template's default."""
        return {"on": True, "off": False}.get(self.reasoning)

    @property
    def exposed(self) -> bool:
        """Listening beyond loopback."""
        import ipaddress

        host = self.bind_host.strip("[]")
        if host == "localhost":
            return False
        try:
            return not ipaddress.ip_address(host).is_loopback
        except ValueError:
            return True


class ServerState:
    """What the endpoints share: the model slots (the served one first), the worker, the
    metrics. `model`, `file_info`, `keep_alive_s` and the keep-alive methods act on the
    request's slot (`slot`)."""

    def __init__(self, config: ServerConfig, loader: Callable[[], Any] | None = None) -> None:
        self.config = config
        self.default = Slot(config.model_name, loader)
        self.default.keep_alive_s = config.keep_alive_s
        self.default.aliases.update(config.aliases)
        self._mapped_names: set[str] = set()  # names any_model_name mapped, each logged once
        self.slots: list[Slot] = [self.default]
        self.load_error: str | None = None
        self.metrics = Metrics()
        self.worker = Worker(config.max_queue, on_job_done=self._job_done)
        self.last_task: LastTask | None = None  # the last generation, as GET /slots reports it
        self.metrics.bind(queue_depth=lambda: self.worker.queue_depth,
                          running=lambda: 1 if self.worker.busy else 0,
                          kv_used=self._kv_used, kv_capacity=self._kv_capacity)
        self.tokenizer_limiter = None    # threads for tokenizer endpoints (llama_api), made in the loop
        self._load_lock: asyncio.Lock | None = None  # one load at a time, in arrival order (made in the loop)
        self._loads_done = 0             # loads finished (or failed): a waiter sees the line move
        self._load_s = 5.0               # moving mean of a load's seconds, for Retry-After
        self.file_facts: dict[tuple, Any] = {}  # (path, size, mtime) -> model_info.describe(...)

    def _job_done(self, job: Job, _seconds: float) -> None:
        self.metrics.record_generation(job.last)
        if job.params is not None:  # a generation (not a /slots action)
            self.last_task = LastTask.of(job)

    # -- the request's slot -------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """The name of the model answering this request (its slot's), as responses report it."""
        return self.slot.name

    @property
    def slot(self) -> Slot:
        return current_slot.get() or self.default

    @property
    def model(self):
        return self.slot.model

    @model.setter
    def model(self, value) -> None:
        self.slot.model = value

    @property
    def file_info(self):
        return self.slot.file_info

    @file_info.setter
    def file_info(self, value) -> None:
        self.slot.file_info = value

    @property
    def keep_alive_s(self) -> float:
        return self.slot.keep_alive_s

    @keep_alive_s.setter
    def keep_alive_s(self, value: float) -> None:
        self.slot.keep_alive_s = value

    @property
    def loader(self):
        return self.default.loader

    @property
    def loaded(self) -> threading.Event:
        return self.default.loaded

    @property
    def reloading(self) -> bool:
        return self.slot.loading is not None

    @property
    def unloaded(self) -> bool:
        """Loaded once and unloaded since (keep_alive, or replaced), as opposed to still loading."""
        return self.slot.unloaded

    def set_model(self, model) -> None:
        """The served model, loaded (serve.py's thread, or given to create_app)."""
        slot = self.default
        slot.model = model
        if slot.loader is None:  # no way to load it again: an unload only forgets it
            slot.loader = lambda: model
            slot.reloadable = False
        slot.path = str(getattr(model, "path", "") or "")
        slot.last_used = time.monotonic()
        slot.loaded.set()

    def resident(self) -> list[Slot]:
        return [s for s in self.slots if s.model is not None]

    # -- keep-alive -----------------------------------------------------------------------------
    def acquire(self) -> None:
        """A request that needs the model starts: no unloading until it ends."""
        self.slot.acquire(self.config.keep_alive_s)

    def release(self) -> None:
        """A request ends; the last one out starts the keep-alive clock."""
        self.slot.release()

    def apply_keep_alive(self, value) -> float | None:
        """A request's keep_alive (None: the server default) checked and made the model's;
        a bad value is a 400 naming the field."""
        if value is None:
            return None
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            raise APIError(400, f"invalid keep_alive: {exc}", param="keep_alive") from None
        self.slot.keep_alive_s = seconds
        return seconds

    def expires_at(self) -> float | None:
        """When the request's model will be unloaded (wall clock), None for never."""
        return self.slot.expires_at()

    def unload(self) -> None:
        self.slot.unload()

    # -- loading --------------------------------------------------------------------------------
    # Loads queue in arrival order (one lock, FIFO): each makes room for itself (an idle model
    # goes at once; a busy one is drained: new requests for it wait, so a stream of them cannot
    # starve the load) and then loads. A request waits as long as the line moves; it gets a 503
    # once nothing has moved for load_wait_s, with a Retry-After from what loads take.
    async def ensure_model(self, overrides: dict[str, Any] | None = None):
        """The request's model, loaded (off the event loop, once for all waiters) if it is not
        resident, or reloaded with `overrides` (edgeinfer.load keywords a request asked for,
        such as Ollama's num_ctx) where they differ from the loaded model's. The seconds a
        load took for the request are its `load_seconds` (Ollama's load_duration)."""
        slot = self.slot
        t0 = time.monotonic()
        try:
            return await self._ensure_model(slot, overrides)
        finally:
            if slot.last_load_s is not None and slot.loaded_at >= t0:
                load_seconds.set(slot.last_load_s)

    async def _ensure_model(self, slot: Slot, overrides: dict[str, Any] | None):
        if overrides and not slot.reloadable:
            _fits_as_loaded(slot, overrides)
        elif overrides and slot.model is not None and _differs(slot.model, overrides):
            if "n_ctx" in overrides:
                _check_context(slot.model, overrides["n_ctx"])
            await self._reload(slot, overrides)
        elif overrides and slot.model is None and slot.loading is None:
            slot.overrides = {**slot.overrides, **overrides}  # not resident: load it so
        if slot.model is not None or slot.loader is None or not (slot.loaded.is_set() or slot is not self.default):
            return self.require_model()  # resident, or the served model's first load is under way
        if slot.loading is None:
            slot.loading = asyncio.ensure_future(self._load(slot))
        seen = self._loads_done
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(slot.loading), self.config.load_wait_s)
                break
            except asyncio.TimeoutError:
                if self._loads_done == seen:  # the line did not move
                    wait = max(1, round(self._load_s))
                    raise APIError(503, f"model {slot.name!r} is still loading; retry shortly",
                                   headers={"retry-after": str(wait)}) from None
                seen = self._loads_done
        return self.require_model()

    async def _reload(self, slot: Slot, overrides: dict[str, Any]) -> None:
        """Load `slot`'s model again with `overrides`, once the requests using it are done (the
        caller's own use set aside; new requests for it wait meanwhile)."""
        slot.uses -= 1  # this request's own use: it waits like the others
        slot.drain(True)
        try:
            deadline = time.monotonic() + self.config.load_wait_s
            while slot.uses > 0:
                if time.monotonic() > deadline:
                    raise APIError(503, f"model {slot.name!r} is in use; retry shortly",
                                   headers={"retry-after": str(max(1, round(self._load_s)))})
                await asyncio.sleep(0.02)
            if slot.model is not None and _differs(slot.model, overrides):
                log.info("reloading %s with %s", slot.name, _shown(overrides))
                slot.overrides = {**slot.overrides, **overrides}
                slot.unload()
        finally:
            slot.uses += 1
            slot.drain(False)

    async def _load(self, slot: Slot) -> None:
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        t0 = time.monotonic()
        try:
            async with self._load_lock:  # FIFO: loads in the order they were asked for
                await self._make_room(slot)
                again = "again " if slot is self.default else ""
                log.info("loading %s", slot.name)
                t_load = time.monotonic()
                try:
                    model = await anyio.to_thread.run_sync(slot.load)
                except EdgeInferError as exc:
                    raise APIError(503, f"failed to load the model {again}({slot.name}): {exc}") from None
                except Exception as exc:  # noqa: BLE001 - the file changed under us, memory ran out...
                    log.error("loading %s failed", slot.name, exc_info=exc)
                    raise APIError(503, f"failed to load the model {again}({slot.name}): "
                                        f"{type(exc).__name__}: {exc}") from None
                slot.last_load_s = time.monotonic() - t_load
                slot.loaded_at = time.monotonic()
                self._load_s = 0.7 * self._load_s + 0.3 * slot.last_load_s
                slot.model = model
                slot.path = str(getattr(model, "path", "") or slot.path or "")
                slot.last_used = time.monotonic()
                slot.loaded.set()
        finally:
            slot.loading = None
            self._loads_done += 1
            log.debug("load of %s ended after %.1fs", slot.name, time.monotonic() - t0)

    async def _make_room(self, slot: Slot) -> None:
        """Unload the least recently used idle models until `slot` fits in max_models; a busy
        one is drained (its requests finish, new ones wait), bounded by load_wait_s."""
        deadline = time.monotonic() + self.config.load_wait_s
        drained: list[Slot] = []
        try:
            while True:
                others = [s for s in self.slots if s is not slot and s.model is not None]
                if len(others) < max(1, self.config.max_models):
                    return
                idle = [s for s in others if s.uses == 0]
                if idle:
                    victim = min(idle, key=lambda s: s.last_used)
                    log.info("unloading %s to load %s", victim.name, slot.name)
                    victim.unload()
                    continue
                victim = min(others, key=lambda s: s.last_used)
                if not victim.draining:
                    victim.drain(True)
                    drained.append(victim)
                if time.monotonic() > deadline:
                    raise APIError(503, f"cannot load {slot.name!r} now: {', '.join(s.name for s in others)} "
                                        "in use; retry shortly", headers={"retry-after": "5"})
                await asyncio.sleep(0.02)
        finally:
            for s in drained:
                s.drain(False)

    # -- other local models ---------------------------------------------------------------------
    def find_slot(self, name: str | None) -> Slot | None:
        """The slot a request's model name means among those known, without touching the disk."""
        if name is None or name in MODEL_ALIASES:
            return self.default
        for slot in self.slots:
            if name in self.names_of(slot):
                return slot
        return None

    def slot_for_file(self, name: str, path, named=None) -> Slot:
        """The slot serving local model `name` (file `path`, made by copy/create when `named`):
        an existing slot with the same file and settings answers to the name too."""
        from edgeinfer.server.slots import model_loader

        settings = _settings(named)
        for slot in self.slots:
            if slot.path and slot.path == str(path) and slot.settings == settings:
                slot.aliases.add(name)
                return slot
        slot = Slot(name, model_loader(path, self.config.model_options, named), path=str(path), named=named)
        slot.settings = settings
        slot.keep_alive_s = self.config.keep_alive_s
        self.slots.append(slot)
        return slot

    def forget(self, name: str) -> None:
        """A deleted model: its slot goes (unloaded when idle), or the name leaves a shared slot."""
        for slot in list(self.slots):
            if slot is self.default:
                continue
            if name in slot.aliases:
                slot.aliases.discard(name)
            elif slot.name == name or slot.name + ":latest" == name:
                if slot.uses == 0:
                    slot.unload()
                    self.slots.remove(slot)

    def names_of(self, slot: Slot) -> set[str]:
        names = {slot.name, slot.name + ":latest"} | slot.aliases | {a + ":latest" for a in slot.aliases}
        if slot is self.default and slot.model is not None:
            p = Path(str(slot.model.path))
            names |= {p.name, p.stem, p.stem + ":latest"}
        return names

    def display_name(self, slot: Slot | None = None) -> str:
        return (slot or self.slot).name

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
        return self.names_of(self.slot)

    def check_model_name(self, name: str | None) -> None:
        """Requests name the model: the request's slot (the served one for "default"/empty)."""
        if name is None or name in MODEL_ALIASES or name in self.model_names():
            return
        if self.config.any_model_name and self.slot is self.default:
            # a placeholder name (gpt-3.5-turbo, local-model) means the one model served
            if self.config.verbose and name not in self._mapped_names and len(self._mapped_names) < 256:
                self._mapped_names.add(name)
                log.info("the model name %r means the served model %r (serve --strict-model-names refuses it)",
                         name[:200], self.config.model_name)
            return
        raise APIError(404, f"model {name!r} not found; this server runs {self.config.model_name!r} "
                            "and the models in its local store", param="model", code="model_not_found")

    def sampling(self, **request_values: Any) -> dict[str, Any]:
        """Server defaults overridden by the request's non-None values, checked."""
        from edgeinfer.sampling import SamplingParams  # (numpy: loaded on the first request, not at start-up)

        params = dict(self.config.sampling)
        params.update(self.slot.sampling)  # a created model's PARAMETER lines
        params.update({k: v for k, v in request_values.items() if v is not None})
        try:
            SamplingParams(**params).validate()
        except EdgeInferError as exc:
            raise APIError(400, str(exc)) from None
        request_params.set(params)  # the same dict: what the endpoint adds to it later shows too
        return params

    # -- generation ------------------------------------------------------------------------
    def submit(self, start: Callable[[threading.Event], Iterator[GenerationChunk]]) -> Job:
        self.require_model()
        loop = asyncio.get_running_loop()
        try:
            params = request_params.get()
            job = self.worker.submit(start, loop, dict(params) if params is not None else None)
        except QueueFullError as exc:
            self.metrics.rejected.inc()
            raise APIError(429, f"the server is busy: {self.worker.max_queue} requests are already "
                           f"waiting; retry after {exc.retry_after_s}s", code="queue_full",
                           headers={"retry-after": str(exc.retry_after_s)}) from None
        if self.config.timeout_s:
            from edgeinfer.server.constraints import request_clock

            started = request_clock.get()  # a grammar compiled for the request counts in its time
            spent = time.monotonic() - started if started is not None else 0.0
            job.timer = loop.call_later(max(0.0, self.config.timeout_s - spent), job.cancel_job, True)
        return job


def _differs(model, overrides: dict[str, Any]) -> bool:
    """Whether a loaded model's engine options differ from these edgeinfer.load keywords."""
    options = getattr(getattr(model, "engine", None), "options", None)
    return any(getattr(options, key, None) != value for key, value in overrides.items())


def _fits_as_loaded(slot: Slot, overrides: dict[str, Any]) -> None:
    """A model handed to the server as it is (no loader) cannot be reloaded: settings it does
    not have are a 400; a context up to its own is served as loaded."""
    model = slot.model
    if model is None:
        return
    rest = {k: v for k, v in overrides.items() if k != "n_ctx"}
    n_ctx = overrides.get("n_ctx")
    if _differs(model, rest) or (n_ctx is not None and n_ctx > model.n_ctx):
        raise APIError(400, f"model {slot.name!r} cannot be reloaded with other settings "
                            f"({_shown(overrides)}) by this server; it runs with num_ctx={model.n_ctx}")


def _check_context(model, n_ctx: int) -> None:
    """A 400 for a context the model was not trained for, or whose K/V would not fit in the
    memory available (the loaded model's own K/V counted as free: a reload lets it go)."""
    cfg = getattr(model, "config", None)
    trained = getattr(cfg, "n_ctx_train", 0) or 0
    if trained and n_ctx > trained:
        raise APIError(400, f"invalid field 'options.num_ctx': {n_ctx} is larger than the model's trained "
                            f"context of {trained} tokens", param="options.num_ctx")
    try:
        per_token = 2 * 2 * cfg.kv_values_per_token  # f16 K+V of each layer's own heads, 2x pool
    except (AttributeError, TypeError):
        return
    from edgeinfer.context_budget import mem_available

    available = mem_available()
    if available is None:
        return
    available += per_token * getattr(model, "n_ctx", 0)
    need = per_token * n_ctx
    if need > 0.8 * available:
        raise APIError(400, f"invalid field 'options.num_ctx': {n_ctx} tokens need about {need >> 20} MiB of "
                            f"K/V memory; {int(0.8 * available) >> 20} MiB are available", param="options.num_ctx")


_OLLAMA_NAMES = {"n_ctx": "num_ctx", "prefill_chunk": "num_batch", "threads": "num_thread", "gpu_layers": "num_gpu"}


def _shown(overrides: dict[str, Any]) -> str:
    """The settings as the request named them (Ollama's option names)."""
    return ", ".join(f"{_OLLAMA_NAMES.get(k, k)}={v}" for k, v in sorted(overrides.items()))


def _settings(named) -> str:
    """What besides the file makes a loaded model differ: a created model's template, system
    prompt and parameters."""
    if named is None:
        return ""
    return json.dumps([named.template, named.system, named.parameters], sort_keys=True)
