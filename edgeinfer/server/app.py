"""The FastAPI app, assembled: exception handlers, middleware, the dialects' routers,
/health and /metrics.

The app exists before the model does: `/health` answers 503 until `set_model` is called
(`edgeinfer serve` loads the model on a thread while uvicorn already listens). After that
the model may be unloaded (Ollama's `keep_alive`) and is loaded again by the next request
that needs it; `/health` stays 200 meanwhile, as the server itself is up.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from edgeinfer.server import anthropic_api, embeddings_api, llama_api, models_api, ollama_api, openai_api, slot_api
from edgeinfer.server import rerank_api, responses_api
from edgeinfer.server.access_log import AccessLogMiddleware
from edgeinfer.server.cors import CORS, origin_policy
from edgeinfer.server.errors import APIError, error_body, error_response
from edgeinfer.server.model_gate import ModelGate
from edgeinfer.server.security import SecurityMiddleware
from edgeinfer.server.state import ServerConfig, ServerState

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger("edgeinfer.server")

# Paths that answer without loading a model: they neither load it again nor hold it loaded.
NO_MODEL_PATHS = frozenset({"/health", "/metrics", "/", "/openapi.json", "/api/version", "/api/ps", "/api/tags",
                            "/v1/models", "/models", "/api/pull", "/api/delete", "/api/copy", "/api/create"})


def create_app(config: ServerConfig, model=None, loader: Callable[[], Any] | None = None) -> FastAPI:
    """Build the app; pass `model` now or later through `app.state.server.set_model`.

    `loader` loads the model again after keep_alive unloaded it (without one, the model
    given is kept referenced and handed back)."""
    state = ServerState(config, loader)
    if model is not None:
        state.set_model(model)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        import asyncio

        from edgeinfer.server.http_protocol import install_accept_errors

        state.loop = asyncio.get_running_loop()
        install_accept_errors(state.loop)  # out of file descriptors: one line, not a traceback per accept
        state.worker.start()
        try:
            yield
        finally:
            state.worker.stop()

    from edgeinfer import __version__
    from edgeinfer.server import openapi

    app = FastAPI(title="edgeinfer", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", lifespan=lifespan)
    openapi.install(app)
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

    routers = (models_api.router, openai_api.router, responses_api.router, ollama_api.router, llama_api.router,
               embeddings_api.router, rerank_api.router, slot_api.router, anthropic_api.router)
    for router in routers:  # models_api first: its model listings answer for every dialect
        app.include_router(router)

    # bounded label values for the request counter: the paths we serve, else "other"
    known = {getattr(r, "path", None) for router in (app.router, *routers) for r in router.routes} - {None}

    def count(path: str, status: int) -> None:
        state.metrics.requests.labels(endpoint=path if path in known else "other", status=str(status)).inc()

    app.add_middleware(ModelGate, state=state, paths=known - NO_MODEL_PATHS)
    app.add_middleware(CORS, policy=origin_policy(config.cors_origins))  # loopback pages by default
    app.add_middleware(SecurityMiddleware, allowed_hosts=config.allowed_hosts, api_key=config.api_key,
                       cors_origins=config.cors_origins, max_body_bytes=config.max_body_bytes,
                       on_response=count)
    app.add_middleware(AccessLogMiddleware)
    return app
