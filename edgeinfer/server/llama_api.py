"""llama-server-compatible endpoints: /completion, /infill, /tokenize, /detokenize,
/apply-template, /props — what llama.vim / llama.vscode and llama-server scripts call."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from edgeinfer.errors import EdgeInferError
from edgeinfer.server.errors import APIError
from edgeinfer.server.constraints import add_constraint, compiled, llama_constraint
from edgeinfer.server.fim import fim_start
from edgeinfer.server.requests import chat_message, check_ids, read_body
from edgeinfer.server.schemas import (ApplyTemplateRequest, DetokenizeRequest, InfillRequest,
                                      LlamaCompletionRequest, LlamaSampling, TokenizeRequest)
from edgeinfer.server import logprobs as lp_format
from edgeinfer.server.streaming import collect_chunks, first_chunk, sse, sse_response, stream_events
from edgeinfer.server.usage import llama_timings

router = APIRouter()
_STOP_TYPE = {"stop": "eos", "length": "limit", "cancelled": "none"}


# edgeinfer's fixed chain, and the settings that take each sampler out of it
CHAIN = ("penalties", "top_k", "top_p", "min_p", "temperature")
_OFF = {"penalties": {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0},
        "top_k": {"top_k": 0}, "top_p": {"top_p": 1.0}, "min_p": {"min_p": 0.0},
        "temperature": {"temperature": 1.0}}  # no temperature sampler: the raw distribution


def sampling_of(state, req: LlamaSampling) -> dict:
    params = state.sampling(max_tokens=req.n_predict, temperature=req.temperature, top_k=req.top_k,
                            top_p=req.top_p, min_p=req.min_p, seed=req.seed, stop=req.stop,
                            repeat_penalty=req.repeat_penalty, repeat_last_n=req.repeat_last_n,
                            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty)
    if req.samplers is not None:
        params.update(sampler_chain(req.samplers))
    if req.n_keep:
        params["n_keep"] = req.n_keep  # what a context shift keeps (Model passes it on)
    if req.n_probs:
        params.update(logprobs=req.n_probs, post_sampling_probs=req.post_sampling_probs)
    for key, value in (("draft_max", req.speculative_n_max), ("draft_min", req.speculative_n_min),
                       ("draft_p_min", req.speculative_p_min)):
        if value is not None:
            params[key] = value  # Model turns them into the request's Speculation
    return params


def sampler_chain(names: list[str]) -> dict:
    """llama-server's `samplers`: a sampler left out of the list does not run. edgeinfer's
    order is fixed, so the listed ones must come in that order. dry, top_n_sigma, typ_p and
    xtc do nothing at their defaults (their settings are refused), so listing them is
    harmless; llama.cpp's `infill` sampler (which editor plugins list) has no counterpart
    here: FIM completions are sampled by the rest of the chain and end at EOG as usual."""
    ours = [n for n in names if n in CHAIN]
    if ours != sorted(ours, key=CHAIN.index) or len(set(ours)) != len(ours):
        raise APIError(400, f"invalid field 'samplers': {names} cannot run in that order: this server runs "
                            f"{', '.join(CHAIN)} in that order", param="samplers")
    out: dict = {}
    for name in CHAIN:
        if name not in names:
            out.update(_OFF[name])
    return out


class _Stop:
    """The request's cancel flag, which a limit below can also raise."""

    def __init__(self, cancel) -> None:
        self.cancel, self.hit = cancel, False

    def is_set(self) -> bool:
        return self.hit or self.cancel.is_set()


def limited(start, t_max_predict_ms: int | None, n_indent: int):
    """llama-server's `t_max_predict_ms` (after a newline, stop once that long has passed
    since the first token) and `n_indent` (stop at a line indented less than that, cutting
    the line after its indentation) around a worker start function; both end "length"."""
    if not t_max_predict_ms and not n_indent:
        return start

    def run(cancel) -> Iterator:
        flag = _Stop(cancel)
        text, sent, line, scan, t_first = "", 0, None, 0, None
        for chunk in start(flag):
            if flag.hit:  # the generator's closing chunk: its held-back text is past the limit
                if chunk.finish_reason is not None:
                    yield replace(chunk, text="", finish_reason="length")
                continue
            if chunk.finish_reason is None and t_first is None:
                t_first = time.perf_counter()
            text += chunk.text
            cut = None
            while n_indent and cut is None:
                if line is None:
                    nl = text.find("\n", scan)
                    if nl < 0:
                        scan = len(text)
                        break
                    line = nl + 1
                i = line
                while i < len(text) and text[i] in " \t":
                    i += 1
                if i == len(text):
                    break  # only indentation so far
                if i - line < n_indent:
                    cut = i
                scan, line = i, None
            if cut is not None:
                flag.hit = True
                text = text[:cut]
            elif t_max_predict_ms and t_first is not None and "\n" in text \
                    and (time.perf_counter() - t_first) * 1e3 > t_max_predict_ms:
                flag.hit = True
            piece, sent = text[sent:], len(text)
            yield replace(chunk, text=piece)  # (no early return: the generator must run to its end)

    return run


def final_body(state, text: str, last, params: dict) -> dict:
    u = last.usage
    return {"index": 0, "content": text, "tokens": [], "id_slot": 0, "stop": True,
            "model": state.model_name, "tokens_predicted": u.completion_tokens,
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
    pieces = lp_format.Pieces(state.model.tokenizer)

    def probs(lps: list) -> dict:
        """llama-server's completion_probabilities, when n_probs asked for them."""
        if not req.n_probs:
            return {}
        return {"completion_probabilities": lp_format.llama_server(pieces, lps, req.post_sampling_probs)}

    if not req.stream:
        chunks, last = await collect_chunks(job, request)
        text = "".join(c.text for c in chunks)
        body = {**final_body(state, text, last, params), **probs([c.logprobs for c in chunks if c.logprobs])}
        return JSONResponse(pick_fields(body, req.response_fields))
    first = await first_chunk(job, request)
    held: list = []  # probabilities of tokens whose text is still held back (a stop string's start)

    def on_chunk(chunk) -> list[dict]:
        if chunk.logprobs is not None:
            held.append(chunk.logprobs)
        if not chunk.text:
            return []
        body = {"index": 0, "content": chunk.text, "tokens": [], "stop": False, "id_slot": 0, **probs(held[:])}
        held.clear()
        return [body]

    def closing(last) -> list[dict]:
        tail = probs(held) if held else {}
        return [pick_fields({**final_body(state, "", last, params), **tail}, req.response_fields)]

    return sse_response(stream_events(job, first, request.url.path, sse, None, closing, on_chunk=on_chunk))


@router.post("/completion")
@router.post("/completions")
async def completion(request: Request):
    state = request.app.state.server
    req = await read_body(request, LlamaCompletionRequest)
    model = state.require_model()
    params = sampling_of(state, req)
    prompt = req.prompt
    check_ids(model, prompt if isinstance(prompt, list) else [])
    run = add_constraint(params, await compiled(state, llama_constraint, req.grammar, req.json_schema,
                                                req.response_format))
    start = limited(lambda cancel: model.generate(prompt, stream=True, cancel=cancel, **run),  # noqa: E731
                    req.t_max_predict_ms, req.n_indent)
    return await _run(request, req, start, params)


@router.post("/infill")
async def infill(request: Request):
    state = request.app.state.server
    req = await read_body(request, InfillRequest)
    model = state.require_model()
    params = sampling_of(state, req)
    extra = [(c.filename, c.text) for c in req.input_extra]
    run = add_constraint(params, await compiled(state, llama_constraint, req.grammar, req.json_schema, None))
    start = fim_start(model, run, prefix=req.input_prefix, suffix=req.input_suffix, extra=extra,
                      prompt=req.prompt)
    return await _run(request, req, limited(start, req.t_max_predict_ms, req.n_indent), params)


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
    state = request.app.state.server
    req = await read_body(request, ApplyTemplateRequest)
    model = state.require_model()
    from edgeinfer.prompt.tool_calls import normalize_messages

    messages = normalize_messages([chat_message(m) for m in req.messages])  # call arguments as objects
    return JSONResponse({"prompt": await _off_loop(request, lambda: model.apply_chat_template(messages))})


@router.get("/props")
async def props(request: Request) -> JSONResponse:
    state = request.app.state.server
    model = state.require_model()
    template = getattr(getattr(model, "template", None), "source", "") or ""
    return JSONResponse({
        "default_generation_settings": {"n_ctx": model.n_ctx, "params": dict(state.config.sampling)},
        "total_slots": 1, "model_alias": state.model_name, "model_path": str(model.path),
        "chat_template": template, "modalities": {"vision": False, "audio": False},
        "build_info": "edgeinfer"})


async def _off_loop(request: Request, fn):
    """Tokenizer work runs on (at most two) threads, never on the event loop."""
    state = request.app.state.server
    if state.tokenizer_limiter is None:
        state.tokenizer_limiter = anyio.CapacityLimiter(2)
    try:
        return await anyio.to_thread.run_sync(fn, limiter=state.tokenizer_limiter)
    except EdgeInferError as exc:
        raise APIError(400, str(exc)) from None

