"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from edgeinfer.server.errors import APIError
from edgeinfer.server.fim import fim_start
from edgeinfer.server.requests import chat_message, check_ids, read_body
from edgeinfer.server.schemas import ChatCompletionRequest, CompletionRequest, OpenAISampling
from edgeinfer.server import logprobs as lp_format
from dataclasses import replace

from edgeinfer.server.choices import gather, several, total
from edgeinfer.server import llama_compat
from edgeinfer.server.constraints import add_constraint, compiled, llama_constraint
from edgeinfer.server.tool_output import OpenAIDeltas, chat_plan, openai_message
from edgeinfer.server.streaming import collect_chunks, first_chunk, sse, sse_response, stream_events
from edgeinfer.server.llama_api import final_body
from edgeinfer.server.usage import llama_timings, usage_dict
from edgeinfer.server.worker import Job
from edgeinfer.server.chat_start import chat_start
from edgeinfer.server.images import RequestImages, with_markers

router = APIRouter()

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}
_DONE = "data: [DONE]\n\n"


def sampling_of(state, req: OpenAISampling, max_tokens: int | None, logprobs: int | None = None,
                model=None) -> dict:
    """The request's sampling settings over the server's; llama-server's `n_predict` stands for
    max_tokens where that is not given; `model` reads logit_bias against its vocabulary."""
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if max_tokens is None:
        max_tokens = req.n_predict
    bias = llama_compat.logit_bias(model, req.logit_bias) if model is not None else None
    return state.sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, min_p=req.min_p, seed=req.seed,
                          repeat_penalty=req.repeat_penalty, repeat_last_n=req.repeat_last_n,
                          presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, stop=stop, logprobs=logprobs,
                          logit_bias=bias)


def _partial_timings(t0: float, n: int) -> dict:
    """llama-server's timings_per_token: the generation's timings so far, on each chunk."""
    ms = (time.perf_counter() - t0) * 1e3
    return {"predicted_n": n, "predicted_ms": ms, "predicted_per_second": n / ms * 1e3 if ms > 0 else 0.0}


@router.post("/v1/chat/completions")
@router.post("/chat/completions")   # llama-server serves it unprefixed too
async def chat_completions(request: Request):
    state = request.app.state.server
    req = await read_body(request, ChatCompletionRequest)
    model = state.require_model()
    state.check_model_name(req.model)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "invalid field 'top_logprobs': it needs logprobs: true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_of(state, req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, model)
    if req.return_progress and req.stream:
        params["prompt_progress"] = True
    images = RequestImages(state, model)
    messages = [chat_message(m, images, f"messages.{i}") for i, m in enumerate(req.messages)]
    await images.resolve()
    add_generation_prompt, prefill = llama_compat.prefill_mode(messages, req.add_generation_prompt,
                                                               req.continue_final_message)
    kwargs = req.chat_template_kwargs
    effort, effort_field = _effort(req)
    extra, reader = chat_plan(model, messages, tools=req.tools, tool_choice=req.tool_choice,
                              parallel_tool_calls=req.parallel_tool_calls,
                              think=kwargs.enable_thinking if kwargs else None,
                              effort=effort, effort_field=effort_field, default_think=state.config.default_think,
                              constraint=await compiled(state, llama_constraint, req.grammar, req.json_schema,
                                                        req.response_format))
    chat = chat_start(model, messages, extra, add_generation_prompt, prefill)
    shown = await _shown_prompt(state, req, lambda: llama_compat.chat_prompt_ids(
        model, with_markers(messages), add_generation_prompt=add_generation_prompt, prefill=prefill,
        tools=extra.get("tools"),
        **{k: extra[k] for k in ("enable_thinking", "reasoning_effort") if k in extra}), model)
    t0 = time.perf_counter()
    counts: dict[int, int] = {}
    job = state.submit(several(chat, req.n, params))
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": ident, "created": created, "model": state.model_name, "system_fingerprint": "edgeinfer"}
    pieces = lp_format.Pieces(model.tokenizer)

    def logprobs(lps: list) -> dict | None:
        return {"content": lp_format.openai_chat(pieces, lps), "refusal": None} if req.logprobs else None

    if not req.stream:
        chunks, last = await collect_chunks(job, request)
        answers = [(c, *openai_message(reader, c.text, _FINISH[c.finish_reason])) for c in gather(chunks, req.n)]
        return JSONResponse({**head, "object": "chat.completion", "choices": [{
            "index": c.index, "message": message, "logprobs": logprobs(c.logprobs), "finish_reason": finish}
            for c, message, finish in answers],
            "usage": usage_dict(last), "timings": llama_timings(last),
            **_verbose(state, shown, answers[0][0].text if answers else "", last, params)})
    first = await first_chunk(job, request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def delta(index: int, d: dict, finish: str | None, lps: list, last=None) -> dict:
        body = {**head, "object": "chat.completion.chunk", "choices": [
            {"index": index, "delta": d, "logprobs": logprobs(lps) if lps else None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        if last is not None:
            body["timings"] = llama_timings(last)
            body.update(_verbose(state, shown, "", last, params))
        elif req.timings_per_token:
            body["timings"] = _partial_timings(t0, counts.get(index, 0))
        return body

    pending: dict[int, list] = {}  # logprobs of tokens whose text is still held back
    deltas = OpenAIDeltas(reader) if reader is not None else None

    def on_chunk(chunk) -> list[dict]:
        if chunk.index < 0:
            return []  # the total of several choices: its usage closes the stream
        if chunk.prompt_progress is not None:  # return_progress: as llama-server, a chunk with no choices
            return [{**head, "object": "chat.completion.chunk", "choices": [],
                     "prompt_progress": chunk.prompt_progress.to_dict()}]
        out = []
        if chunk.index not in pending:
            pending[chunk.index] = []
            # a forced call has no content at all: null, as the unstreamed message's (and OpenAI's)
            opening = None if reader is not None and reader.forced else ""
            out.append(delta(chunk.index, {"role": "assistant", "content": opening}, None, []))
        held = pending[chunk.index]
        if chunk.logprobs is not None:
            held.append(chunk.logprobs)
        if chunk.token is not None and chunk.finish_reason is None:
            counts[chunk.index] = counts.get(chunk.index, 0) + 1
        parts = ([{"content": chunk.text}] if chunk.text else []) if deltas is None else \
            deltas.push(chunk.index, chunk.text)
        if chunk.finish_reason is not None and deltas is not None:
            parts += deltas.finish(chunk.index)
        for d in parts:  # content, reasoning_content or tool_calls (edgeinfer.server.tool_output)
            out.append(delta(chunk.index, d, None, held[:]))
            held.clear()
        if chunk.finish_reason is not None:
            finish = _FINISH[chunk.finish_reason]
            out.append(delta(chunk.index, {}, deltas.finish_reason(chunk.index, finish) if deltas else finish,
                             held[:], chunk))
            held.clear()
        return out

    return sse_response(_stream_body(job, first, request.url.path, include_usage, head, "chat.completion.chunk",
                                     on_chunk))


def _effort(req: ChatCompletionRequest) -> tuple[str | None, str]:
    """The reasoning effort asked for, and the field that asked: OpenAI's `reasoning_effort`
    or llama-server's `chat_template_kwargs.reasoning_effort` (the same, if both)."""
    nested = req.chat_template_kwargs.reasoning_effort if req.chat_template_kwargs else None
    if nested is not None and req.reasoning_effort is not None and nested != req.reasoning_effort:
        raise APIError(400, "invalid field 'chat_template_kwargs.reasoning_effort': it differs from "
                            "reasoning_effort", param="chat_template_kwargs.reasoning_effort")
    if nested is not None:
        return nested, "chat_template_kwargs.reasoning_effort"
    return req.reasoning_effort, "reasoning_effort"


@router.post("/v1/completions")
async def completions(request: Request):
    state = request.app.state.server
    req = await read_body(request, CompletionRequest)
    model = state.require_model()
    state.check_model_name(req.model)
    params = sampling_of(state, req, req.max_tokens, req.logprobs, model)
    # llama-server's grammar / json_schema on its OpenAI completions route too
    if req.grammar is not None or req.json_schema is not None:
        params = add_constraint(params, await compiled(state, llama_constraint, req.grammar, req.json_schema,
                                                       None))
    batch = _batch(req.prompt)
    if batch is not None and req.verbose:  # asked for explicitly; serve --verbose leaves batches alone
        raise APIError(400, "invalid field 'verbose': it takes one prompt, not a batch", param="verbose")
    if batch is not None:
        return await _batched_completions(request, req, model, batch, params)
    prompt = req.prompt[0] if isinstance(req.prompt, list) and isinstance(req.prompt[0], (str, list)) \
        else req.prompt
    if req.suffix is not None:
        if not isinstance(prompt, str):
            raise APIError(400, "suffix needs a text prompt", param="suffix")
        if req.echo:
            raise APIError(400, "invalid field 'echo': it cannot be combined with suffix (fill-in-the-middle)",
                           param="echo")
        start_for = lambda p: fim_start(model, p, prefix=prompt, suffix=req.suffix)  # noqa: E731
    else:
        check_ids(model, prompt if isinstance(prompt, list) else [])
        start_for = lambda p: lambda cancel: model.generate(prompt, stream=True, cancel=cancel, **p)  # noqa: E731
    echoed = (prompt if isinstance(prompt, str) else model.tokenizer.detokenize(prompt, skip_special=True)) \
        if req.echo else ""
    if req.verbose and req.suffix is not None:
        raise APIError(400, "invalid field 'verbose': it cannot be combined with suffix (fill-in-the-middle)",
                       param="verbose")
    shown = None if req.suffix is not None else await _shown_prompt(
        state, req, lambda: prompt if isinstance(prompt, list) else model.tokenize(prompt), model)
    prompt_lps: list = []  # with echo and logprobs: (token, logprob) of the prompt, made on the worker
    start = several(start_for, req.n, params)
    if req.echo and req.logprobs is not None:
        start = _with_prompt_logprobs(start, model, prompt, req.logprobs, prompt_lps)
    job = state.submit(start)
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": ident, "created": created, "model": state.model_name, "system_fingerprint": "edgeinfer"}
    pieces = lp_format.Pieces(model.tokenizer)
    prompt_len = len(echoed) if req.echo else \
        len(prompt if isinstance(prompt, str) else model.tokenizer.detokenize(prompt, skip_special=True))

    def text_start() -> int:
        """text_offset of the first token listed: 0 echoing the prompt, else the prompt's length.
        Echoed, a leading space the tokenizer added (SPM) is in the pieces, not in the text:
        offsets start that much below 0 and are clamped."""
        if not prompt_lps:
            return 0 if req.echo else prompt_len
        return prompt_len - sum(len(pieces(t)[0]) for t, _ in prompt_lps)

    def logprobs(items: list, offset: int) -> dict | None:
        return lp_format.openai_completion(pieces, items, offset) if req.logprobs is not None else None

    if not req.stream:
        chunks, last = await collect_chunks(job, request)
        choices = []
        for c in gather(chunks, req.n):
            items = prompt_lps + [(x.token, x) for x in c.logprobs]
            choices.append({"text": echoed + c.text, "index": c.index, "logprobs": logprobs(items, text_start()),
                            "finish_reason": _FINISH[c.finish_reason]})
        return JSONResponse({**head, "object": "text_completion", "choices": choices,
                             "usage": usage_dict(last), "timings": llama_timings(last),
                             **_verbose(state, shown, choices[0]["text"] if choices else "", last, params)})
    first = await first_chunk(job, request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def piece(index: int, text: str, finish: str | None, items: list, offset: int) -> dict:
        body = {**head, "object": "text_completion", "choices": [{
            "text": text, "index": index, "logprobs": logprobs(items, offset) if items else None,
            "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return body

    held: dict[int, list] = {}     # (token, logprob) pairs whose text is still held back
    offsets: dict[int, int] = {}   # characters sent so far (text_offset), per choice

    def on_chunk(chunk) -> list[dict]:
        i = chunk.index
        if i < 0:
            return []
        out = []
        if i not in held:
            held[i], offsets[i] = [], text_start()
            if req.echo:
                out.append(piece(i, echoed, None, prompt_lps, offsets[i]))
                offsets[i] = prompt_len
        if chunk.logprobs is not None:
            held[i].append((chunk.token, chunk.logprobs))
        if chunk.text or chunk.finish_reason is not None:
            if chunk.text or held[i]:
                out.append(piece(i, chunk.text, None, held[i][:], offsets[i]))
                offsets[i] += sum(len(pieces(t)[0]) for t, _ in held[i])
                held[i].clear()
            if chunk.finish_reason is not None:
                out.append({**piece(i, "", _FINISH[chunk.finish_reason], [], offsets[i]),
                            **_verbose(state, shown, "", chunk, params)})
        return out

    return sse_response(_stream_body(job, first, request.url.path, include_usage, head, "text_completion",
                                     on_chunk))


async def _shown_prompt(state, req: OpenAISampling, ids, model) -> str | None:
    """With llama-server's `verbose` (the request's, else serve --verbose): the prompt as the
    model sees it (its tokens' pieces), made off the event loop; None otherwise."""
    if not (req.verbose if req.verbose is not None else state.config.verbose):
        return None
    return await anyio.to_thread.run_sync(lambda: model.tokenizer.detokenize(ids(), as_pieces=True))


def _verbose(state, shown: str | None, content: str, last, params: dict) -> dict:
    """llama-server's `__verbose` debug field: the /completion body of the answer, prompt included."""
    if shown is None or last is None or last.usage is None:
        return {}
    return {"__verbose": final_body(state, content, last, params, prompt=shown)}


def _batch(prompt) -> list | None:
    """Several prompts (a list of texts or of token lists, more than one): each its own answer."""
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        return prompt
    return None


async def _batched_completions(request: Request, req: CompletionRequest, model, prompts: list, params: dict):
    """/v1/completions with several prompts, as llama-server answers them: prompt i's n
    choices have indexes i*n .. i*n+n-1, run one after another on the worker."""
    state = request.app.state.server
    for field, value in (("suffix", req.suffix), ("echo", req.echo or None)):
        if value is not None:
            raise APIError(400, f"invalid field {field!r}: it takes one prompt, not a list of them", param=field)
    for p in prompts:
        check_ids(model, p if isinstance(p, list) else [], "prompt")
    n = req.n
    runs = [several(lambda q, p=p: lambda cancel: model.generate(p, stream=True, cancel=cancel, **q), n, params)
            for p in prompts]

    def start(cancel):
        finals = []
        for i, run in enumerate(runs):
            for chunk in run(cancel):
                if chunk.index < 0:
                    continue  # a prompt's own total of its n choices: the request's total closes
                if chunk.finish_reason is not None:
                    finals.append(chunk)
                yield replace(chunk, index=i * n + chunk.index)
            if cancel.is_set():
                break
        yield total(finals)

    job = state.submit(start)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name,
            "system_fingerprint": "edgeinfer"}
    pieces = lp_format.Pieces(model.tokenizer)
    starts = [len(p if isinstance(p, str) else model.tokenizer.detokenize(p, skip_special=True)) for p in prompts]
    count = len(prompts) * n

    def logprobs(items: list, offset: int) -> dict | None:
        return lp_format.openai_completion(pieces, items, offset) if req.logprobs is not None else None

    if not req.stream:
        chunks, last = await collect_chunks(job, request)
        choices = [{"text": c.text, "index": c.index,
                    "logprobs": logprobs([(x.token, x) for x in c.logprobs], starts[c.index // n]),
                    "finish_reason": _FINISH[c.finish_reason]} for c in gather(chunks, count)]
        return JSONResponse({**head, "object": "text_completion", "choices": choices,
                             "usage": usage_dict(last), "timings": llama_timings(last)})
    first = await first_chunk(job, request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    held: dict[int, list] = {}
    offsets: dict[int, int] = {}

    def piece(index: int, text: str, finish: str | None, items: list) -> dict:
        body = {**head, "object": "text_completion", "choices": [{
            "text": text, "index": index, "logprobs": logprobs(items, offsets[index]) if items else None,
            "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return body

    def on_chunk(chunk) -> list[dict]:
        i = chunk.index
        if i < 0:
            return []
        if i not in held:
            held[i], offsets[i] = [], starts[i // n]
        if chunk.logprobs is not None:
            held[i].append((chunk.token, chunk.logprobs))
        out = []
        if chunk.text or (chunk.finish_reason is not None and held[i]):
            out.append(piece(i, chunk.text, None, held[i][:]))
            offsets[i] += sum(len(pieces(t)[0]) for t, _ in held[i])
            held[i].clear()
        if chunk.finish_reason is not None:
            out.append(piece(i, "", _FINISH[chunk.finish_reason], []))
        return out

    return sse_response(_stream_body(job, first, request.url.path, include_usage, head, "text_completion",
                                     on_chunk))


def _with_prompt_logprobs(start, model, prompt, top_n: int, out: list):
    """A start function that first fills `out` with the prompt's (token, logprob) pairs
    (a leading control token such as BOS, which has no text, left out)."""
    def run(cancel):
        pairs = model.prompt_logprobs(prompt, top_n)
        if pairs and model.tokenizer.token_to_piece(pairs[0][0], special=False) == b"":
            pairs = pairs[1:]
        out.extend(pairs)
        yield from start(cancel)
    return run


def _stream_body(job: Job, first, path: str, include_usage: bool, head: dict, obj: str,
                 on_chunk) -> AsyncIterator[str]:
    """SSE events for a streamed answer: what `on_chunk` makes of each chunk (pieces, each
    choice's finish), then the usage (all choices together), then [DONE]."""
    def closing(last) -> list[dict]:
        return [{**head, "object": obj, "choices": [], "usage": usage_dict(last)}] if include_usage else []

    return stream_events(job, first, path, sse, None, closing, done=_DONE, on_chunk=on_chunk)
