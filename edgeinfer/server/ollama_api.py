"""Ollama-compatible endpoints: /api/generate, /api/chat, /api/tags, /api/show, /api/ps, /api/version.

Streaming is on by default (NDJSON, one object a line); the last object has `done: true`,
`done_reason` and the durations in nanoseconds.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from edgeinfer import __version__
from edgeinfer.server.errors import APIError
from edgeinfer.server.state import load_seconds
from edgeinfer.server.fim import fim_start
from edgeinfer.server.images import RequestImages
from edgeinfer.server.requests import check_ids, read_body
from edgeinfer.server.schemas import (OllamaBase, OllamaChatRequest, OllamaGenerateRequest)
from edgeinfer.server import logprobs as lp_format
from edgeinfer.server.constraints import add_constraint, compiled, ollama_format, ollama_think
from edgeinfer.server.tool_output import OllamaPieces, chat_plan, ollama_history, ollama_message
from edgeinfer.server.streaming import collect_chunks, first_chunk, stream_events

log = logging.getLogger("edgeinfer.server")
router = APIRouter()
NDJSON = "application/x-ndjson"
_DONE_REASON = {"stop": "stop", "length": "length", "cancelled": "stop"}


def iso(ts: float) -> str:
    """A wall-clock time as Ollama writes it (UTC, ending in Z)."""
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def now_iso() -> str:
    return iso(time.time())


async def params_of(state, req: OllamaBase, n_ctx: int) -> dict:
    """The request's sampling settings and its `format`'s constraint (compiled off the loop)."""
    params = sampling_of(state, req, n_ctx)
    return add_constraint(params, await compiled(state, ollama_format, req.format) if req.format else None)


def sampling_of(state, req: OllamaBase, n_ctx: int) -> dict:
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "invalid field 'top_logprobs': it needs logprobs: true", param="top_logprobs")
    asked = {"logprobs": req.top_logprobs or 0} if req.logprobs else {}
    o = req.options
    if o is None:
        return state.sampling(**asked)
    max_tokens = -1 if o.num_predict == -2 else o.num_predict
    stop = [o.stop] if isinstance(o.stop, str) else o.stop
    params = state.sampling(max_tokens=max_tokens, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p,
                            min_p=o.min_p, seed=o.seed, stop=stop, repeat_penalty=o.repeat_penalty,
                            repeat_last_n=o.repeat_last_n, presence_penalty=o.presence_penalty,
                            frequency_penalty=o.frequency_penalty, **asked)
    if o.num_keep is not None:
        params["n_keep"] = o.num_keep  # what a context shift keeps (Model passes it on)
    return params


# options with no effect on an answer here, and the values that would ask for something
_NO_EFFECT = {"use_mmap": False, "use_mlock": True, "numa": True, "low_vram": True, "logits_all": True,
              "penalize_newline": None, "main_gpu": None, "mirostat_tau": None, "mirostat_eta": None}


def load_overrides(req: OllamaBase) -> dict:
    """edgeinfer.load keywords for the request's load-time options (num_ctx, num_batch,
    num_thread, num_gpu): the model is reloaded with them where they differ. The options that
    change nothing here are reported in one log line."""
    o = req.options
    if o is None:
        return {}
    over: dict = {}
    if o.num_ctx is not None:
        over["n_ctx"] = o.num_ctx
    if o.num_batch is not None:
        over["prefill_chunk"] = o.num_batch
    if o.num_thread is not None:
        over["threads"] = o.num_thread or None
    if o.num_gpu is not None:
        over["gpu_layers"] = "auto" if o.num_gpu < 0 else o.num_gpu
    ignored = [f"{k}={json.dumps(getattr(o, k))}" for k, v in _NO_EFFECT.items()
               if getattr(o, k) is not None and (v is None or getattr(o, k) == v)]
    if ignored:
        log.info("options %s: accepted; they change nothing on this server", ", ".join(ignored))
    return over


def final_stats(last, load_s: float) -> dict:
    """The final line's stats, as Ollama counts them: total_duration is the load (when this
    request had to load the model), the prompt's evaluation and the generation; the time a
    request waited in the queue for another's answer is not in it."""
    u, t = last.usage, last.timings
    total = load_s + t.prompt_s + t.gen_s
    return {"done": True, "done_reason": _DONE_REASON[last.finish_reason],
            "total_duration": int(total * 1e9), "load_duration": int(load_s * 1e9),
            "prompt_eval_count": u.prompt_tokens, "prompt_eval_duration": int(t.prompt_s * 1e9),
            "eval_count": u.completion_tokens, "eval_duration": int(t.gen_s * 1e9)}


def load_response(state, reason: str = "load") -> JSONResponse:
    """Ollama answers an empty prompt by loading the model (done_reason "load"), or with
    keep_alive 0 by unloading it ("unload", which is how `ollama stop` works)."""
    return JSONResponse({"model": state.model_name, "created_at": now_iso(), "response": "",
                         "done": True, "done_reason": reason})


@router.post("/api/generate")
async def generate(request: Request):
    state = request.app.state.server
    req = await read_body(request, OllamaGenerateRequest)
    keep = state.apply_keep_alive(req.keep_alive)
    if keep == 0 and not req.prompt and req.suffix is None and not req.images:
        state.check_model_name(req.model)
        return load_response(state, "unload")  # the model goes as this answer does (ModelGate)
    model = await state.ensure_model(load_overrides(req))
    load_s = load_seconds.get()  # Ollama's load_duration: what loading the model took for this request
    state.check_model_name(req.model)
    images = RequestImages(state, model)
    pictures = [images.base64(b, f"images.{k}") for k, b in enumerate(req.images or [])]
    if pictures and req.suffix is not None:
        raise APIError(400, "invalid field 'images': images cannot be combined with suffix (fill-in-the-middle)",
                       param="images")
    if pictures and req.context:  # the ids handed back would hold the images' positions, which no id names
        raise APIError(400, "invalid field 'context': it cannot be combined with images", param="context")
    if req.template:
        raise APIError(400, "invalid field 'template': template overrides are not supported; start the "
                            "server with --chat-template")
    params = await params_of(state, req, model.n_ctx)
    thinking, effort = ollama_think(model, req.think, raw=req.raw or req.suffix is not None)
    reader = None  # a thinking template's answer: its reasoning goes to `thinking`
    if not req.prompt and req.suffix is None and not req.context and not pictures:
        return load_response(state)
    data = await images.resolve()
    tokens: list[int] = []  # the prompt's ids, then the answer's: the `context` to hand back
    if req.suffix is not None:
        if req.context:
            raise APIError(400, "invalid field 'context': it cannot be combined with suffix "
                                "(fill-in-the-middle)", param="context")
        start = fim_start(model, params, prefix=req.prompt, suffix=req.suffix)
    else:
        if req.context:
            check_ids(model, req.context, "context")
        params["context"] = req.context
        if not pictures:  # with images the answer has no `context`: their positions have no token ids
            params["on_prompt"] = tokens.extend
        if req.raw:  # images at the prompt's <__media__> markers, else before its text
            with_images = {"images": data} if data else {}
            start = lambda cancel: model.generate(req.prompt, stream=True, cancel=cancel, **params,  # noqa: E731
                                                  **with_images)
        else:
            messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
                [{"role": "user", "content": [*pictures, {"type": "text", "text": req.prompt}] if pictures
                  else req.prompt}]
            extra, reader = chat_plan(model, messages, think=thinking, effort=effort, effort_field="think",
                                      default_think=state.config.default_think)
            start = lambda cancel: model.chat(messages, stream=True, cancel=cancel, **params, **extra)  # noqa: E731
        start = _recording(start, tokens)
    job = state.submit(start)
    head = {"model": state.model_name}

    def context() -> dict:
        return {"context": tokens} if req.suffix is None and not pictures else {}

    lps = _logprobs_of(req, model)
    if not req.stream:
        text, last, got = await _collect(job, request, lps)
        return JSONResponse({**head, "created_at": now_iso(), **_response(ollama_message(reader, text)), **got,
                             **final_stats(last, load_s), **context()})
    first = await first_chunk(job, request)
    events = _ndjson(job, first, request.url.path, head, load_s, lambda text: {"response": text}, context, lps,
                     split=(OllamaPieces(reader), _response) if reader is not None else None)
    return StreamingResponse(events, media_type=NDJSON)


def _response(message: dict) -> dict:
    """/api/generate's fields for a message: `response`, and `thinking` when there is some."""
    return {"response": message["content"], **({"thinking": message["thinking"]} if "thinking" in message else {})}


def _recording(start, tokens: list[int]):
    """A start function that also appends each generated token id to `tokens`."""
    def run(cancel):
        for chunk in start(cancel):
            if chunk.token is not None:
                tokens.append(chunk.token)
            yield chunk
    return run


@router.post("/api/chat")
async def chat(request: Request):
    state = request.app.state.server
    req = await read_body(request, OllamaChatRequest)
    keep = state.apply_keep_alive(req.keep_alive)
    if keep == 0 and not req.messages:
        state.check_model_name(req.model)
        return JSONResponse({"model": state.model_name, "created_at": now_iso(),
                             "message": {"role": "assistant", "content": ""}, "done": True,
                             "done_reason": "unload"})
    model = await state.ensure_model(load_overrides(req))
    load_s = load_seconds.get()  # Ollama's load_duration: what loading the model took for this request
    state.check_model_name(req.model)
    images = RequestImages(state, model)
    messages = ollama_history(req.messages)
    for i, m in enumerate(req.messages):
        if m.images:  # Ollama's images go before the message's text
            if m.role != "user":
                raise APIError(400, f"invalid field 'messages.{i}.images': images go in user messages, not in a "
                                    f"{m.role} message", param=f"messages.{i}.images")
            pictures = [images.base64(b, f"messages.{i}.images.{k}") for k, b in enumerate(m.images)]
            messages[i]["content"] = [*pictures, *([{"type": "text", "text": m.content}] if m.content else [])]
    await images.resolve()
    params = await params_of(state, req, model.n_ctx)
    thinking, effort = ollama_think(model, req.think)
    if not req.messages:
        return JSONResponse({"model": state.model_name, "created_at": now_iso(),
                             "message": {"role": "assistant", "content": ""}, "done": True,
                             "done_reason": "load"})
    extra, reader = chat_plan(model, messages, tools=req.tools, think=thinking, effort=effort,
                              effort_field="think", default_think=state.config.default_think)
    job = state.submit(lambda cancel: model.chat(messages, stream=True, cancel=cancel, **params, **extra))
    head = {"model": state.model_name}

    def message(text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    lps = _logprobs_of(req, model)
    if not req.stream:
        text, last, got = await _collect(job, request, lps)
        return JSONResponse({**head, "created_at": now_iso(), "message": ollama_message(reader, text), **got,
                             **final_stats(last, load_s)})
    first = await first_chunk(job, request)
    events = _ndjson(job, first, request.url.path, head, load_s, message, lps=lps,
                     split=(OllamaPieces(reader), lambda m: {"message": m}) if reader is not None else None)
    return StreamingResponse(events, media_type=NDJSON)


def _logprobs_of(req: OllamaBase, model):
    """Ollama's `logprobs` field for a list of token logprobs, or None when not asked for."""
    if not req.logprobs:
        return None
    pieces = lp_format.Pieces(model.tokenizer)
    return lambda lps: {"logprobs": lp_format.ollama(pieces, lps)}


async def _collect(job, request: Request, lps) -> tuple[str, object, dict]:
    """A whole answer: its text, the final chunk, and the `logprobs` field when asked for."""
    chunks, last = await collect_chunks(job, request)
    got = lps([c.logprobs for c in chunks if c.logprobs is not None]) if lps is not None else {}
    return "".join(c.text for c in chunks), last, got


def _ndjson(job, first, path: str, head: dict, load_s: float, body, tail=dict, lps=None,
           split=None) -> AsyncIterator[str]:
    """NDJSON lines for a streamed answer: a line a text piece (with its tokens' logprobs when
    asked for), then the final one with the stats. `split`: (OllamaPieces, the line's fields
    for one of its messages) when thinking or tool calls are read out of the text."""
    held: list = []  # logprobs of tokens whose text is still held back

    def on_chunk(chunk) -> list[dict]:
        if chunk.logprobs is not None:
            held.append(chunk.logprobs)
        if split is None:
            bodies = [body(chunk.text)] if chunk.text else []
        else:
            pieces, shape = split
            found = pieces.push(chunk.text) + (pieces.finish() if chunk.finish_reason is not None else [])
            bodies = [shape(m) for m in found]
        lines = []
        for b in bodies:
            lines.append({**head, "created_at": now_iso(), **b, **(lps(held[:]) if lps is not None else {}),
                          "done": False})
            held.clear()
        return lines

    return stream_events(job, first, path, _line,
                         lambda text: {**head, "created_at": now_iso(), **body(text), "done": False},
                         lambda last: [{**head, "created_at": now_iso(), **body(""),
                                        **(lps(held) if lps is not None and held else {}),
                                        **final_stats(last, load_s), **tail()}],
                         on_chunk=on_chunk if lps is not None or split is not None else None)


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


@router.get("/api/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})
