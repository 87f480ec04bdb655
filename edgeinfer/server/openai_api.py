"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from edgeinfer.server.app import (APIError, collect, first_chunk, llama_timings, read_body,
                                  stream_chunks, usage_dict)
from edgeinfer.server.errors import error_body
from edgeinfer.server.fim import fim_start
from edgeinfer.server.schemas import ChatCompletionRequest, CompletionRequest, OpenAIMessage, OpenAISampling
from edgeinfer.server.worker import Job

router = APIRouter()

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


def message_text(m: OpenAIMessage) -> str:
    """OpenAI content may be a string or a list of parts; only text parts are supported."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for part in m.content:
        if part.type != "text":
            raise APIError(400, f"invalid field 'messages': content part type {part.type!r} is not supported "
                                "(text only)",
                           param="messages")
        parts.append(part.text or "")
    return "".join(parts)


def chat_message(m: OpenAIMessage) -> dict:
    """The template's view of a message; `name` goes along for templates that use it."""
    out = {"role": m.role, "content": message_text(m)}
    if m.name is not None:
        out["name"] = m.name
    return out


def sampling_of(state, req: OpenAISampling, max_tokens: int | None) -> dict:
    if req.n != 1:
        raise APIError(400, f"invalid field 'n': n={req.n} is not supported: this server returns one "
                            "choice (n=1)", param="n")
    if req.logprobs:
        raise APIError(400, "invalid field 'logprobs': log probabilities are not produced", param="logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    return state.sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, min_p=req.min_p, seed=req.seed,
                          repeat_penalty=req.repeat_penalty, repeat_last_n=req.repeat_last_n,
                          presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, stop=stop)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = request.app.state.server
    model = state.require_model()
    meta = {"n_ctx": model.n_ctx, "n_ctx_train": model.config.n_ctx_train}
    return JSONResponse({"object": "list", "data": [{
        "id": state.config.model_name, "object": "model", "created": int(time.time()),
        "owned_by": "edgeinfer", "meta": meta}]})


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = request.app.state.server
    req = await read_body(request, ChatCompletionRequest)
    model = state.require_model()
    state.check_model_name(req.model)
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(400, f"invalid field 'response_format': type {req.response_format.type!r} is not "
                            "supported (only 'text')",
                       param="response_format")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_of(state, req, max_tokens)
    messages = [chat_message(m) for m in req.messages]
    job = state.submit(lambda cancel: model.chat(messages, stream=True, cancel=cancel, **params))
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": ident, "created": created, "model": state.config.model_name, "system_fingerprint": "edgeinfer"}
    if not req.stream:
        text, last = await collect(job, request)
        return JSONResponse({**head, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": _FINISH[last.finish_reason]}],
            "usage": usage_dict(last), "timings": llama_timings(last)})
    first = await first_chunk(job, request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def delta(d: dict, finish: str | None) -> dict:
        body = {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return body

    async def events() -> AsyncIterator[str]:
        yield sse(delta({"role": "assistant", "content": ""}, None))
        async for ev in _stream_body(job, first, request.url.path, include_usage, head, "chat.completion.chunk",
                                     lambda text: delta({"content": text}, None),
                                     lambda finish: delta({}, finish)):
            yield ev

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/completions")
async def completions(request: Request):
    state = request.app.state.server
    req = await read_body(request, CompletionRequest)
    model = state.require_model()
    state.check_model_name(req.model)
    if req.echo:
        raise APIError(400, "invalid field 'echo': echoing the prompt is not supported", param="echo")
    params = sampling_of(state, req, req.max_tokens)
    prompt = req.prompt[0] if isinstance(req.prompt, list) and isinstance(req.prompt[0], str) else req.prompt
    if req.suffix is not None:
        if not isinstance(prompt, str):
            raise APIError(400, "suffix needs a text prompt", param="suffix")
        start = fim_start(model, params, prefix=prompt, suffix=req.suffix)
    else:
        from edgeinfer.server.llama_api import check_ids

        check_ids(model, prompt if isinstance(prompt, list) else [])
        start = lambda cancel: model.generate(prompt, stream=True, cancel=cancel, **params)  # noqa: E731
    job = state.submit(start)
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": ident, "created": created, "model": state.config.model_name, "system_fingerprint": "edgeinfer"}
    if not req.stream:
        text, last = await collect(job, request)
        return JSONResponse({**head, "object": "text_completion", "choices": [{
            "text": text, "index": 0, "logprobs": None, "finish_reason": _FINISH[last.finish_reason]}],
            "usage": usage_dict(last), "timings": llama_timings(last)})
    first = await first_chunk(job, request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def piece(text: str, finish: str | None) -> dict:
        body = {**head, "object": "text_completion",
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return body

    events = _stream_body(job, first, request.url.path, include_usage, head, "text_completion",
                          lambda text: piece(text, None), lambda finish: piece("", finish))
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


async def _stream_body(job: Job, first, path: str, include_usage: bool, head: dict, obj: str,
                       on_text, on_finish) -> AsyncIterator[str]:
    """SSE events for a streamed answer: text pieces, the finish chunk, usage, [DONE]."""
    last = None
    try:
        async for chunk in stream_chunks(job, first):
            if chunk.text:
                yield sse(on_text(chunk.text))
            if chunk.finish_reason is not None:
                last = chunk
    except APIError as exc:
        yield sse(error_body(path, exc.status, exc.message, code=exc.code))
        return
    if job.timed_out:
        yield sse(error_body(path, 504, "the request timed out", code="timeout"))
        return
    if last is None:
        return
    yield sse(on_finish(_FINISH[last.finish_reason]))
    if include_usage:
        yield sse({**head, "object": obj, "choices": [], "usage": usage_dict(last)})
    yield "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
