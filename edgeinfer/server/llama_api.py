"""llama-server-compatible endpoints: /completion, /infill, /tokenize, /detokenize,
/apply-template, /props — what llama.vim / llama.vscode and llama-server scripts call."""

from __future__ import annotations

import json
from typing import AsyncIterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from edgeinfer.errors import EdgeInferError
from edgeinfer.server.app import (APIError, collect, first_chunk, llama_timings, read_body,
                                  stream_chunks)
from edgeinfer.server.errors import error_body
from edgeinfer.server.fim import fim_start
from edgeinfer.server.schemas import (ApplyTemplateRequest, DetokenizeRequest, InfillRequest,
                                      LlamaCompletionRequest, LlamaSampling, TokenizeRequest)

router = APIRouter()
_STOP_TYPE = {"stop": "eos", "length": "limit", "cancelled": "none"}


def sampling_of(state, req: LlamaSampling) -> dict:
    return state.sampling(max_tokens=req.n_predict, temperature=req.temperature, top_k=req.top_k,
                          top_p=req.top_p, min_p=req.min_p, seed=req.seed, stop=req.stop,
                          repeat_penalty=req.repeat_penalty, repeat_last_n=req.repeat_last_n,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty)


def final_body(state, text: str, last, params: dict) -> dict:
    u = last.usage
    return {"index": 0, "content": text, "tokens": [], "id_slot": 0, "stop": True,
            "model": state.config.model_name, "tokens_predicted": u.completion_tokens,
            "tokens_evaluated": u.prompt_tokens, "tokens_cached": u.cached_tokens,
            "generation_settings": {"n_ctx": state.model.n_ctx, **params},
            "has_new_line": "\n" in text, "truncated": False,
            "stop_type": _STOP_TYPE[last.finish_reason], "stopping_word": "",
            "timings": llama_timings(last)}


def pick_fields(body: dict, fields: list[str] | None) -> dict:
    """llama-server's `response_fields`: keep only these "a/b" paths, keyed by the path."""
    if not fields:
        return body
    out = {}
    for path in fields:
        node = body
        for key in path.split("/"):
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            out[path] = node
    return out


async def _run(request: Request, req: LlamaSampling, start, params: dict):
    state = request.app.state.server
    job = state.submit(start)
    if not req.stream:
        text, last = await collect(job, request)
        return JSONResponse(pick_fields(final_body(state, text, last, params), req.response_fields))
    first = await first_chunk(job, request)

    async def events() -> AsyncIterator[str]:
        parts, last = [], None
        try:
            async for chunk in stream_chunks(job, first):
                if chunk.text:
                    parts.append(chunk.text)
                    yield _sse({"index": 0, "content": chunk.text, "tokens": [], "stop": False, "id_slot": 0})
                if chunk.finish_reason is not None:
                    last = chunk
        except APIError as exc:
            yield _sse(error_body(request.url.path, exc.status, exc.message))
            return
        if job.timed_out:
            yield _sse(error_body(request.url.path, 504, "the request timed out"))
        elif last is not None:
            body = final_body(state, "", last, params)
            yield _sse(pick_fields(body, req.response_fields))

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


@router.post("/completion")
@router.post("/completions")
async def completion(request: Request):
    state = request.app.state.server
    req = await read_body(request, LlamaCompletionRequest)
    model = state.require_model()
    params = sampling_of(state, req)
    prompt = req.prompt
    check_ids(model, prompt if isinstance(prompt, list) else [])
    return await _run(request, req, lambda cancel: model.generate(prompt, stream=True, cancel=cancel, **params),
                      params)


@router.post("/infill")
async def infill(request: Request):
    state = request.app.state.server
    req = await read_body(request, InfillRequest)
    model = state.require_model()
    params = sampling_of(state, req)
    extra = [(c.filename, c.text) for c in req.input_extra]
    start = fim_start(model, params, prefix=req.input_prefix, suffix=req.input_suffix, extra=extra,
                      prompt=req.prompt)
    return await _run(request, req, start, params)


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = request.app.state.server
    req = await read_body(request, TokenizeRequest)
    model = state.require_model()
    ids = await _off_loop(request, lambda: model.tokenize(req.content, add_special=req.add_special,
                                                 parse_special=req.parse_special))
    if not req.with_pieces:
        return JSONResponse({"tokens": ids})
    tok = model.tokenizer
    out = []
    for i in ids:
        raw = tok.token_to_piece(i)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)  # llama-server sends bytes that are not valid UTF-8 as a list
        out.append({"id": i, "piece": piece})
    return JSONResponse({"tokens": out})


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = request.app.state.server
    req = await read_body(request, DetokenizeRequest)
    model = state.require_model()
    check_ids(model, req.tokens)
    return JSONResponse({"content": await _off_loop(request, lambda: model.detokenize(req.tokens))})


@router.post("/apply-template")
async def apply_template(request: Request) -> JSONResponse:
    from edgeinfer.server.openai_api import message_text

    state = request.app.state.server
    req = await read_body(request, ApplyTemplateRequest)
    model = state.require_model()
    messages = [{"role": m.role, "content": message_text(m)} for m in req.messages]
    return JSONResponse({"prompt": await _off_loop(request, lambda: model.apply_chat_template(messages))})


@router.get("/props")
async def props(request: Request) -> JSONResponse:
    state = request.app.state.server
    model = state.require_model()
    template = getattr(getattr(model, "template", None), "source", "") or ""
    return JSONResponse({
        "default_generation_settings": {"n_ctx": model.n_ctx, "params": dict(state.config.sampling)},
        "total_slots": 1, "model_alias": state.config.model_name, "model_path": str(model.path),
        "chat_template": template, "modalities": {"vision": False, "audio": False},
        "build_info": "edgeinfer"})


def check_ids(model, ids: list[int]) -> None:
    n = model.tokenizer.vocab_size
    bad = next((i for i in ids if i >= n), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range (the vocabulary has {n} tokens)")


async def _off_loop(request: Request, fn):
    """Tokenizer work runs on (at most two) threads, never on the event loop."""
    state = request.app.state.server
    if getattr(state, "tokenizer_limiter", None) is None:
        state.tokenizer_limiter = anyio.CapacityLimiter(2)
    try:
        return await anyio.to_thread.run_sync(fn, limiter=state.tokenizer_limiter)
    except EdgeInferError as exc:
        raise APIError(400, str(exc)) from None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
