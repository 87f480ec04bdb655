"""The FastAPI app: configuration, shared server state, and the plumbing every endpoint uses.

The app exists before the model does: `/health` answers 503 until `set_model` is called
(`edgeinfer serve` loads the model on a thread while uvicorn already listens).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from edgeinfer.errors import ContextOverflowError, EdgeInferError
from edgeinfer.results import GenerationChunk
from edgeinfer.server.errors import APIError, error_body, error_response
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


class ServerState:
    """What the endpoints share: the model (None while loading), the worker, the metrics."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.model = None
        self.load_error: str | None = None
        self.metrics = Metrics()
        self.worker = Worker(config.max_queue, on_job_done=lambda job, _s: self.metrics.record_generation(job.last))
        self.metrics.bind(queue_depth=lambda: self.worker.queue_depth,
                          running=lambda: 1 if self.worker.busy else 0,
                          kv_used=self._kv_used, kv_capacity=self._kv_capacity)
        self.loaded = threading.Event()

    def set_model(self, model) -> None:
        self.model = model
        self.loaded.set()

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
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes")
    if not data.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return schema.model_validate_json(bytes(data))
    except ValidationError as exc:
        message, param = _describe(exc)
        raise APIError(400, message, param=param) from None


def _describe(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return f"malformed JSON: {err['msg'].removeprefix('Invalid JSON: ')}", None
    loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
    if err["type"] == "model_type":
        return "the request body must be a JSON object", None
    return f"invalid field {loc!r}: {err['msg']}", loc or None


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


async def _next_chunk(job: Job, request: Request) -> GenerationChunk | None:
    """The job's next chunk; on any failure the job is cancelled and errors become APIError."""
    try:
        return await job.next(request.is_disconnected)
    except BaseException as exc:
        job.cancel_job()
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise _fail(exc) from None


async def first_chunk(job: Job, request: Request) -> GenerationChunk | None:
    """Wait (through the queue and the prefill) for the first chunk; errors become APIError."""
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
        _stop_timer(job)
    if job.timed_out:
        raise APIError(504, f"the request took longer than {request.app.state.server.config.timeout_s}s",
                       code="timeout")
    if job.last is None:  # cancelled before it started
        raise APIError(499, "the request was cancelled")
    return "".join(parts), job.last


async def stream_chunks(job: Job, first: GenerationChunk | None) -> AsyncIterator[GenerationChunk]:
    """The rest of a streamed answer. If the client goes away, Starlette cancels this
    generator and `finally` cancels the generation (it stops before its next token)."""
    try:
        chunk = first
        while chunk is not None:
            yield chunk
            chunk = await job.next()
    except Exception as exc:  # noqa: BLE001 - headers are sent: the caller turns it into an error event
        raise _fail(exc) from None
    finally:
        _stop_timer(job)
        job.cancel_job()  # no-op when it finished


def _stop_timer(job: Job) -> None:
    if job.timer is not None:
        job.timer.cancel()


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

def create_app(config: ServerConfig, model=None) -> FastAPI:
    """Build the app; pass `model` now or later through `app.state.server.set_model`."""
    from edgeinfer.server import llama_api, ollama_api, openai_api

    state = ServerState(config)
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
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body(request.url.path, 500, f"internal error: {type(exc).__name__}"),
                            status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
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

    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
    app.add_middleware(SecurityMiddleware, allowed_hosts=config.allowed_hosts, api_key=config.api_key,
                       cors_origins=config.cors_origins, max_body_bytes=config.max_body_bytes,
                       on_response=count)
    return app
