"""The FastAPI app: configuration, shared server state, and the plumbing every endpoint uses.

The app exists before the model does: `/health` answers 503 until `set_model` is called
(`edgeinfer serve` loads the model on a thread while uvicorn already listens). After that
the model may be unloaded (Ollama's `keep_alive`) and is loaded again by the next request
that needs it; `/health` stays 200 meanwhile, as the server itself is up.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from edgeinfer.errors import ContextOverflowError, EdgeInferError
from edgeinfer.results import GenerationChunk
from edgeinfer.server.access_log import AccessLogMiddleware, note_usage
from edgeinfer.server.errors import APIError, error_body, error_response
from edgeinfer.server.keep_alive import FOREVER
from edgeinfer.server.metrics import Metrics
from edgeinfer.server.security import SecurityMiddleware
from edgeinfer.server.worker import Job, QueueFullError, Worker

log = logging.getLogger("edgeinfer.server")
B = TypeVar("B", bound=BaseModel)

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
        from edgeinfer.sampling import SamplingParams

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


async def read_body(request: Request, schema: type[B]) -> B:
    """The JSON body, size-limited and validated; every problem is a one-line 400/413."""
    limit = request.app.state.server.config.max_body_bytes
    data = bytearray()
    try:
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise APIError(413, f"request body is larger than {limit} bytes")
    except ClientDisconnect:
        log.info("%s %s: the client disconnected while sending the request body",
                 request.method, request.url.path)
        raise APIError(499, "the client disconnected while sending the request body") from None
    if not data.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return schema.model_validate_json(bytes(data))
    except ValidationError as exc:
        message, param = _describe(exc)
        raise APIError(400, message, param=param) from None


def _describe(exc: ValidationError) -> tuple[str, str | None]:
    errors = exc.errors(include_url=False)
    # an unknown field is the real problem even when a union's other members also failed
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    if err["type"] == "json_invalid":
        return f"malformed JSON: {err['msg'].removeprefix('Invalid JSON: ')}", None
    loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
    if err["type"] == "model_type":
        return "the request body must be a JSON object", None
    if err["type"] == "extra_forbidden":
        return f"unsupported field {loc!r}: this server does not know it, so it cannot honour it", loc
    return f"invalid field {loc!r}: {err['msg'].removeprefix('Value error, ')}", loc or None


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the union member tried into loc ("list[str]", "function-after[...]")
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def _fail(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, EdgeInferError):
        return APIError(400, str(exc))
    log.error("generation failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def watch_disconnect(job: Job, request: Request) -> None:
    """Cancel the job as soon as the client goes away, whether or not chunks are flowing.

    The body has been read, so the next ASGI message is `http.disconnect`; a task waits
    for it beside the request (both the streamed and the whole-answer paths). The job
    stops the task when it ends.
    """
    if job.watcher is not None:
        return

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel_job()
                return

    job.watcher = asyncio.ensure_future(watch())
    scope = request.scope
    job.on_last = lambda last: note_usage(scope, last.usage.prompt_tokens, last.usage.completion_tokens) \
        if last.usage is not None else None


async def _next_chunk(job: Job, request: Request) -> GenerationChunk | None:
    """The job's next chunk; on any failure the job is cancelled and errors become APIError."""
    try:
        return await job.next()
    except BaseException as exc:
        job.cancel_job()
        _finish(job)
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise _fail(exc) from None


async def first_chunk(job: Job, request: Request) -> GenerationChunk | None:
    """Wait (through the queue and the prefill) for the first chunk; errors become APIError."""
    watch_disconnect(job, request)
    chunk = await _next_chunk(job, request)
    if chunk is None and job.timed_out:
        raise APIError(504, "the request timed out while waiting for the model", code="timeout")
    return chunk


async def collect(job: Job, request: Request) -> tuple[str, GenerationChunk]:
    """A whole non-streamed answer: (text, final chunk)."""
    parts: list[str] = []
    chunk = await first_chunk(job, request)
    try:
        while chunk is not None:
            parts.append(chunk.text)
            chunk = await _next_chunk(job, request)
    finally:
        _finish(job)
    if job.timed_out:
        raise APIError(504, f"the request took longer than {request.app.state.server.config.timeout_s}s",
                       code="timeout")
    if job.last is None:  # cancelled before it started
        raise APIError(499, "the request was cancelled")
    return "".join(parts), job.last


async def stream_chunks(job: Job, first: GenerationChunk | None) -> AsyncIterator[GenerationChunk]:
    """The rest of a streamed answer. If the client goes away, the watcher (or Starlette
    cancelling this generator) cancels the generation: it stops before its next token."""
    try:
        chunk = first
        while chunk is not None:
            yield chunk
            chunk = await job.next()
    except Exception as exc:  # noqa: BLE001 - headers are sent: the caller turns it into an error event
        raise _fail(exc) from None
    finally:
        _finish(job)
        job.cancel_job()  # no-op when it finished


def _finish(job: Job) -> None:
    if job.timer is not None:
        job.timer.cancel()
    if job.watcher is not None:
        job.watcher.cancel()


def usage_dict(last: GenerationChunk) -> dict:
    u = last.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def llama_timings(last: GenerationChunk) -> dict:
    """llama-server's `timings` object (milliseconds, tokens/s)."""
    u, t = last.usage, last.timings
    prompt_n = u.prompt_tokens - u.cached_tokens
    prompt_ms, pred_ms = t.prompt_s * 1e3, t.gen_s * 1e3
    return {"cache_n": u.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": t.prompt_tps,
            "predicted_n": u.completion_tokens, "predicted_ms": pred_ms,
            "predicted_per_token_ms": t.tpot_s * 1e3, "predicted_per_second": t.gen_tps}


# -- the app -----------------------------------------------------------------------------------

# Paths that answer without the model: they neither load it again nor hold it loaded.
NO_MODEL_PATHS = frozenset({"/health", "/metrics", "/", "/api/version", "/api/ps"})
# Paths that read keep_alive first and then call `ensure_model` themselves: an Ollama
# unload request must not load an unloaded model just to drop it.
SELF_LOADING_PATHS = frozenset({"/api/generate", "/api/chat"})


class ModelGate:
    """Pure ASGI middleware around the endpoints that use the model: holds the model
    loaded for the whole request (a stream included), loads it again if keep_alive
    unloaded it, and lets the keep-alive clock start once the answer is out."""

    def __init__(self, app, state: ServerState, paths: set[str]) -> None:
        self.app, self.state, self.paths = app, state, paths

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or path not in self.paths:
            await self.app(scope, receive, send)
            return
        state = self.state
        state.acquire()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                state.release()

        async def send_and_release(message) -> None:
            # release before the last byte goes out: a client that has its answer (say to
            # keep_alive 0) and asks /api/ps next must already see the model gone
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()
            await send(message)

        try:
            needs_load = path not in SELF_LOADING_PATHS and not (
                path == "/api/tags" and getattr(state, "_model_info", None) is not None)
            if needs_load and state.unloaded:
                try:
                    await state.ensure_model()
                except APIError as exc:
                    await error_response(path, exc)(scope, receive, send_and_release)
                    return
            await self.app(scope, receive, send_and_release)
        finally:
            release()


def create_app(config: ServerConfig, model=None, loader: Callable[[], Any] | None = None) -> FastAPI:
    """Build the app; pass `model` now or later through `app.state.server.set_model`.

    `loader` loads the model again after keep_alive unloaded it (without one, the model
    given is kept referenced and handed back)."""
    from edgeinfer.server import llama_api, ollama_api, openai_api

    state = ServerState(config, loader)
    if model is not None:
        state.set_model(model)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.worker.start()
        try:
            yield
        finally:
            state.worker.stop()

    app = FastAPI(title="edgeinfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, exc.status_code, str(exc.detail)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, ClientDisconnect):  # logged once, by the security middleware
            return JSONResponse(error_body(request.url.path, 499, "the client disconnected"), status_code=499)
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body(request.url.path, 500, f"internal error: {type(exc).__name__}"),
                            status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.unloaded:  # keep_alive let it go; the next request loads it again
            return JSONResponse({"status": "ok", "model": "loading" if state.reloading else "unloaded"})
        if state.model is None:
            status = "error" if state.load_error else "loading"
            return JSONResponse({"status": status}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse("edgeinfer is running")

    app.include_router(openai_api.router)
    app.include_router(ollama_api.router)
    app.include_router(llama_api.router)

    # bounded label values for the request counter: the paths we serve, else "other"
    known = {getattr(r, "path", None) for router in (app.router, openai_api.router, ollama_api.router,
                                                      llama_api.router) for r in router.routes} - {None}

    def count(path: str, status: int) -> None:
        state.metrics.requests.labels(endpoint=path if path in known else "other", status=str(status)).inc()

    app.add_middleware(ModelGate, state=state, paths=known - NO_MODEL_PATHS)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
    app.add_middleware(SecurityMiddleware, allowed_hosts=config.allowed_hosts, api_key=config.api_key,
                       cors_origins=config.cors_origins, max_body_bytes=config.max_body_bytes,
                       on_response=count)
    app.add_middleware(AccessLogMiddleware)
    return app
