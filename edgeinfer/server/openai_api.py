"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from edgeinfer.server.errors import APIError
from edgeinfer.server.fim import fim_start
from edgeinfer.server.requests import chat_message, check_ids, read_body
from edgeinfer.server.schemas import ChatCompletionRequest, CompletionRequest, OpenAISampling
from edgeinfer.server.streaming import collect, first_chunk, sse, sse_response, stream_events
from edgeinfer.server.usage import llama_timings, usage_dict
from edgeinfer.server.worker import Job

router = APIRouter()

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}
_DONE = "data: [DONE]\n\n"


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

    return sse_response(events())


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
    return sse_response(events)


def _stream_body(job: Job, first, path: str, include_usage: bool, head: dict, obj: str,
                 on_text, on_finish) -> AsyncIterator[str]:
    """SSE events for a streamed answer: text pieces, the finish chunk, usage, [DONE]."""
    def closing(last) -> list[dict]:
        out = [on_finish(_FINISH[last.finish_reason])]
        if include_usage:
            out.append({**head, "object": obj, "choices": [], "usage": usage_dict(last)})
        return out

    return stream_events(job, first, path, sse, on_text, closing, done=_DONE)
