"""Embeddings in every dialect: OpenAI `/v1/embeddings`, Ollama `/api/embed` and the legacy
`/api/embeddings`, llama-server `/embedding` and `/embeddings`. Each request runs on the
worker as one job (edgeinfer.embedding does the work); usage counts its tokens."""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal, Union

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from edgeinfer.embedding import POOLING_NAMES, POOLING_NONE, POOLING_RANK, Embeddings, embed
from edgeinfer.server import llama_compat
from edgeinfer.results import FinishReason, GenerationChunk, Timings, Usage
from edgeinfer.server.errors import APIError
from edgeinfer.server.requests import read_body
from edgeinfer.server.schemas import Body, KeepAlive, OllamaOptions
from edgeinfer.server.streaming import collect

router = APIRouter()

MAX_INPUTS = 2048   # OpenAI's own limit on inputs per request
MAX_IDS = 1 << 20
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
Texts = Union[str, Annotated[list[str], Field(max_length=MAX_INPUTS)]]
Ids = Union[Annotated[list[TokenId], Field(min_length=1, max_length=MAX_IDS)],
            Annotated[list[Annotated[list[TokenId], Field(max_length=MAX_IDS)]], Field(max_length=MAX_INPUTS)]]
Dimensions = Annotated[int, Field(ge=1, le=1 << 20)]
# llama-server's input forms beside texts and ids: ids and text mixed in one input,
# {"prompt_string": text}, {"content": [{"type": "text", "text": ...}]} (llama_compat reads them)
Part = Union[int, str, dict, Annotated[list[Union[int, str]], Field(max_length=MAX_IDS)]]
Inputs = Union[str, dict, Annotated[list[Part], Field(max_length=MAX_IDS)]]


class OpenAIEmbeddingRequest(Body):
    input: Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions | None = None
    user: str | None = None


class OllamaEmbedRequest(Body):
    model: str | None = None
    input: Texts = []
    truncate: bool = True     # Ollama's default: cut a long input to the context
    dimensions: Dimensions | None = None
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None


class OllamaEmbeddingsRequest(Body):
    model: str | None = None
    prompt: str = ""
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None


class LlamaEmbeddingRequest(Body):
    content: Inputs | None = None
    input: Inputs | None = None
    model: str | None = None
    embd_normalize: Annotated[int, Field(ge=-1, le=64)] = 2   # llama.cpp's common_embd_normalize
    encoding_format: Literal["float", "base64"] = "float"


def _pooling(state) -> int | None:
    """The server's --pooling (None: the file's)."""
    name = state.config.pooling
    return None if name is None else {v: k for k, v in POOLING_NAMES.items()}[name]


async def _run(request: Request, model, inputs, **kw) -> Embeddings:
    """One job on the worker: the embeddings, and a final chunk with the usage."""
    state, box = request.app.state.server, {}
    kw.setdefault("pooling", _pooling(state))
    if kw["pooling"] == POOLING_RANK:
        raise APIError(400, "this server runs with --pooling rank (a reranker): embeddings need another pooling")

    def start(cancel):
        t0 = time.perf_counter()
        box["result"] = got = embed(model, inputs, cancel=cancel, **kw)
        now = time.perf_counter()
        yield GenerationChunk(text="", token=None, finish_reason=FinishReason.STOP,
                              usage=Usage(prompt_tokens=got.prompt_tokens, completion_tokens=0),
                              timings=Timings.from_clock(t0, None, now, got.prompt_tokens, 0))

    await collect(state.submit(start), request)
    return box["result"]


def _encoded(vector: list[float], encoding: str) -> Any:
    if encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
    return vector


@router.post("/v1/embeddings")
async def openai_embeddings(request: Request) -> JSONResponse:
    state = request.app.state.server
    req = await read_body(request, OpenAIEmbeddingRequest)
    model = state.require_model()
    state.check_model_name(req.model)
    if req.input == [] or req.input == "":
        raise APIError(400, "invalid field 'input': it is empty", param="input")
    if _pooling(state) == POOLING_NONE:
        raise APIError(400, "pooling type 'none' is not OpenAI compatible: it gives a vector per token; use "
                            "/embeddings, or serve with another --pooling", param="input")
    inputs = llama_compat.embedding_inputs(model, req.input, "input")
    got = await _run(request, model, inputs, dimensions=req.dimensions)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
            for i, v in enumerate(got.vectors)]
    return JSONResponse({"object": "list", "data": data, "model": state.model_name,
                         "usage": {"prompt_tokens": got.prompt_tokens, "total_tokens": got.prompt_tokens}})


async def _ollama_model(request: Request, req):
    state = request.app.state.server
    state.apply_keep_alive(req.keep_alive)
    model = await state.ensure_model()
    state.check_model_name(req.model)
    if _pooling(state) == POOLING_NONE:
        raise APIError(400, "this server runs with --pooling none (a vector per token), which Ollama's "
                            "endpoints cannot send; use /embeddings")
    o = req.options
    if o is not None and o.num_ctx is not None and o.num_ctx > model.n_ctx:
        raise APIError(400, f"num_ctx {o.num_ctx} is larger than the loaded context of {model.n_ctx} "
                            f"tokens; restart the server with --ctx-size {o.num_ctx}")
    return state, model


@router.post("/api/embed")
async def ollama_embed(request: Request) -> JSONResponse:
    t0 = time.perf_counter()
    req = await read_body(request, OllamaEmbedRequest)
    state, model = await _ollama_model(request, req)
    inputs = [req.input] if isinstance(req.input, str) else req.input
    inputs = [t for t in inputs if t]  # as Ollama: empty strings embed to nothing
    got = await _run(request, model, inputs, truncate=req.truncate, dimensions=req.dimensions) \
        if inputs else Embeddings([], [])
    return JSONResponse({"model": state.model_name, "embeddings": got.vectors,
                         "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
                         "prompt_eval_count": got.prompt_tokens})


@router.post("/api/embeddings")
async def ollama_embeddings(request: Request) -> JSONResponse:
    """Ollama's older endpoint: one prompt, its vector not normalised (as Ollama's)."""
    req = await read_body(request, OllamaEmbeddingsRequest)
    _, model = await _ollama_model(request, req)
    if not req.prompt:
        return JSONResponse({"embedding": []})
    got = await _run(request, model, req.prompt, truncate=True, normalize=-1)
    return JSONResponse({"embedding": got.vectors[0]})


@router.post("/embedding")
@router.post("/embeddings")
async def llama_embedding(request: Request) -> JSONResponse:
    """llama-server's own form: a list of {index, embedding: [vector]}."""
    state = request.app.state.server
    req = await read_body(request, LlamaEmbeddingRequest)
    model = state.require_model()
    state.check_model_name(req.model)
    inputs = req.input if req.input is not None else req.content
    if inputs is None or inputs == [] or inputs == "":
        raise APIError(400, "give the text to embed in 'content' (or 'input')", param="content")
    field = "input" if req.input is not None else "content"
    got = await _run(request, model, llama_compat.embedding_inputs(model, inputs, field), normalize=req.embd_normalize)
    if _pooling(state) == POOLING_NONE:  # a vector per token, as they are
        return JSONResponse([{"index": i, "embedding": [_encoded(t, req.encoding_format) for t in v]}
                             for i, v in enumerate(got.vectors)])
    return JSONResponse([{"index": i, "embedding": [_encoded(v, req.encoding_format)]}
                         for i, v in enumerate(got.vectors)])
