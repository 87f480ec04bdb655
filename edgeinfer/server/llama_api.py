"""llama-server-compatible endpoints: /completion, /infill, /tokenize, /detokenize,
/apply-template, /props — what llama.vim / llama.vscode and llama-server scripts call."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from edgeinfer.server.errors import APIError
from edgeinfer.server.off_loop import off_loop
from edgeinfer.server.state import kv_cache_types
from edgeinfer.server.constraints import add_constraint, compiled, llama_constraint
from edgeinfer.server.fim import fim_start
from edgeinfer.server.images import MARKER, RequestImages, has_image_input, with_markers
from edgeinfer.server.llama_compat import MediaPrompt
from edgeinfer.server.requests import chat_message, check_ids, read_body
from edgeinfer.server.schemas import (ApplyTemplateRequest, DetokenizeRequest, InfillRequest,
                                      LlamaCompletionRequest, LlamaSampling, TokenizeRequest)
from edgeinfer.server import llama_compat
from edgeinfer.server import logprobs as lp_format
from edgeinfer.server.choices import in_turn
from edgeinfer.server.streaming import collect_chunks, first_chunk, sse, sse_response, stream_events
from edgeinfer.server.tool_output import chat_plan
from edgeinfer.server.usage import llama_timings

router = APIRouter()
_STOP_TYPE = {"stop": "eos", "length": "limit", "cancelled": "none"}


# edgeinfer's fixed chain, and the settings that take each sampler out of it
CHAIN = ("penalties", "top_k", "top_p", "min_p", "temperature")
_OFF = {"penalties": {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0},
        "top_k": {"top_k": 0}, "top_p": {"top_p": 1.0}, "min_p": {"min_p": 0.0},
        "temperature": {"temperature": 1.0}}  # no temperature sampler: the raw distribution


def sampling_of(state, req: LlamaSampling, model=None) -> dict:
    """The request's sampling settings over the server's (`serve -n` is the n_predict of a
    request without one); `model` reads logit_bias against its vocabulary."""
    bias = llama_compat.logit_bias(model, req.logit_bias) if model is not None else None
    params = state.sampling(max_tokens=req.n_predict, temperature=req.temperature, top_k=req.top_k,
                            top_p=req.top_p, min_p=req.min_p, seed=req.seed, stop=req.stop,
                            repeat_penalty=req.repeat_penalty, repeat_last_n=req.repeat_last_n,
                            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                            logit_bias=bias)
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


def truncated(last, n_ctx: int) -> bool:
    """llama-server's `truncated`: the window filled up (the answer ended for want of room,
    or a context shift dropped tokens to go on), seen from the tokens the request ran."""
    u = last.usage
    return u is not None and last.finish_reason == "length" and u.prompt_tokens + u.completion_tokens >= n_ctx


def final_body(state, text: str, last, params: dict, index: int = 0, tokens: list[int] | None = None,
               prompt: str | None = None) -> dict:
    u = last.usage
    settings = {k: v for k, v in params.items() if k != "logit_bias"}
    if params.get("logit_bias"):
        settings["logit_bias"] = [[t, b if b != float("-inf") else False] for t, b in params["logit_bias"].items()]
    return {"index": index, "content": text, "tokens": tokens or [], "id_slot": 0, "stop": True,
            "model": state.model_name, "tokens_predicted": u.completion_tokens,
            "tokens_evaluated": u.prompt_tokens, "tokens_cached": u.cached_tokens,
            "generation_settings": {"n_ctx": state.model.n_ctx, "n_predict": params.get("max_tokens", -1),
                                    **settings},
            "has_new_line": "\n" in text, "truncated": truncated(last, state.model.n_ctx),
            "stop_type": _STOP_TYPE[last.finish_reason], "stopping_word": "",
            "timings": llama_timings(last), **({"prompt": prompt} if prompt is not None else {})}


def _with_progress(run: dict, req: LlamaSampling) -> dict:
    """return_progress on a stream: the generation yields PromptProgress chunks while the prompt runs."""
    return {**run, "prompt_progress": True} if req.return_progress and req.stream else run


def _with_verbose(body: dict, verbose: bool) -> dict:
    """llama-server's `verbose`: the body again under `__verbose` (its OpenAI routes carry only this part)."""
    return {**body, "__verbose": dict(body)} if verbose else body


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


def batched(starts: list):
    """One worker start function for several prompts, answered one after another; chunks
    carry their prompt's `index`, and a closing total (index -1) follows (choices.total)."""
    return starts[0] if len(starts) == 1 else in_turn(starts)


async def _run(request: Request, req: LlamaSampling, starts: list, params: dict, batch: bool = False,
               texts: list[str] | None = None):
    """Answer one prompt (a JSON object) or a batch (a list of them, by index), whole or streamed;
    `texts`: each prompt as its final result shows it (llama-server's `prompt`)."""
    texts = texts or [None] * len(starts)
    state = request.app.state.server
    verbose = state.config.verbose if req.verbose is None else req.verbose
    job = state.submit(batched(starts))
    pieces = lp_format.Pieces(state.model.tokenizer)
    t0 = time.perf_counter()

    def probs(lps: list) -> dict:
        """llama-server's completion_probabilities, when n_probs asked for them."""
        if not req.n_probs:
            return {}
        return {"completion_probabilities": lp_format.llama_server(pieces, lps, req.post_sampling_probs)}

    if not req.stream:
        chunks, _ = await collect_chunks(job, request)
        bodies = []
        for i in range(len(starts)):
            mine = [c for c in chunks if c.index == i]
            last = next((c for c in reversed(mine) if c.finish_reason is not None), None)
            if last is None:
                continue
            tokens = [c.token for c in mine if c.token is not None] if req.return_tokens else None
            body = {**final_body(state, "".join(c.text for c in mine), last, params, i, tokens, texts[i]),
                    **probs([c.logprobs for c in mine if c.logprobs])}
            bodies.append(pick_fields(_with_verbose(body, verbose), req.response_fields))
        return JSONResponse(bodies if batch else bodies[0])
    first = await first_chunk(job, request)
    held: dict[int, list] = {}    # probabilities of tokens whose text is still held back (a stop string's start)
    tokens: dict[int, list] = {}  # ids of tokens whose text is still held back
    counts: dict[int, int] = {}

    def on_chunk(chunk) -> list[dict]:
        i = chunk.index
        if i < 0:
            return []
        if chunk.prompt_progress is not None:  # return_progress
            return [{"index": i, "content": "", "tokens": [], "stop": False, "id_slot": 0,
                     "prompt_progress": chunk.prompt_progress.to_dict()}]
        lps, toks = held.setdefault(i, []), tokens.setdefault(i, [])
        if chunk.logprobs is not None:
            lps.append(chunk.logprobs)
        if chunk.token is not None and chunk.finish_reason is None:
            toks.append(chunk.token)
            counts[i] = counts.get(i, 0) + 1
        out = []
        if chunk.text:
            body = {"index": i, "content": chunk.text, "tokens": toks[:], "stop": False, "id_slot": 0,
                    **probs(lps[:])}
            if req.timings_per_token:
                ms = (time.perf_counter() - t0) * 1e3
                body["timings"] = {"predicted_n": counts[i], "predicted_ms": ms}
            out.append(body)
            lps.clear()
            toks.clear()
        if chunk.finish_reason is not None:
            tail = probs(lps) if lps else {}
            body = {**final_body(state, "", chunk, params, i, prompt=texts[i]), **tail}
            out.append(pick_fields(_with_verbose(body, verbose), req.response_fields))
        return out

    return sse_response(stream_events(job, first, request.url.path, sse, None, lambda last: [],
                                      on_chunk=on_chunk))


@router.post("/completion")
@router.post("/completions")
async def completion(request: Request):
    state = request.app.state.server
    req = await read_body(request, LlamaCompletionRequest)
    model = state.require_model()
    params = sampling_of(state, req, model)
    images = RequestImages(state, model)

    def read_prompts() -> tuple[list[list[int] | MediaPrompt], bool, list[str]]:
        """The request's prompts as ids, tokenized once here as generate would, and their pieces
        (the result's `prompt`), in one trip off the event loop; a prompt with images stays
        text (Model.generate places them at its markers) and shows as that text."""
        prompts, batch = llama_compat.prompts(model, req.prompt, images=images)
        ids = [p if isinstance(p, (list, MediaPrompt)) else model.tokenize(p) for p in prompts]
        return ids, batch, [p.text if isinstance(p, MediaPrompt) else model.tokenizer.detokenize(p, as_pieces=True)
                            for p in ids]

    prompts, batch, texts = await off_loop(request, read_prompts)
    data = await images.resolve()
    run = add_constraint(params, await compiled(state, llama_constraint, req.grammar, req.json_schema,
                                                req.response_format))
    run = _with_progress(run, req)

    def start_for(prompt):
        if isinstance(prompt, MediaPrompt):
            shown = data[prompt.first:prompt.first + prompt.count]
            return limited(lambda cancel: model.generate(prompt.text, stream=True, cancel=cancel, images=shown,
                                                         **run),
                           req.t_max_predict_ms, req.n_indent)
        return limited(lambda cancel: model.generate(prompt, stream=True, cancel=cancel, **run),
                       req.t_max_predict_ms, req.n_indent)

    return await _run(request, req, [start_for(p) for p in prompts], params, batch, texts)


@router.post("/infill")
async def infill(request: Request):
    state = request.app.state.server
    req = await read_body(request, InfillRequest)
    model = state.require_model()
    params = sampling_of(state, req, model)
    extra = [(c.filename, c.text) for c in req.input_extra]
    run = add_constraint(params, await compiled(state, llama_constraint, req.grammar, req.json_schema, None))
    run = _with_progress(run, req)
    start = fim_start(model, run, prefix=req.input_prefix, suffix=req.input_suffix, extra=extra,
                      prompt=req.prompt)
    return await _run(request, req, [limited(start, req.t_max_predict_ms, req.n_indent)], params)


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = request.app.state.server
    req = await read_body(request, TokenizeRequest)
    model = state.require_model()
    ids = await off_loop(request, lambda: model.tokenize(req.content, add_special=req.add_special,
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
    return JSONResponse({"content": await off_loop(request, lambda: model.detokenize(req.tokens))})


@router.post("/apply-template")
async def apply_template(request: Request) -> JSONResponse:
    state = request.app.state.server
    req = await read_body(request, ApplyTemplateRequest)
    model = state.require_model()
    from edgeinfer.prompt.tool_calls import normalize_messages

    # call arguments as objects; image parts checked, and shown as the marker where each goes
    images = RequestImages(state, model)
    messages = normalize_messages(with_markers([chat_message(m, images, f"messages.{i}")
                                                for i, m in enumerate(req.messages)]))
    add_generation_prompt, prefill = llama_compat.prefill_mode(messages, req.add_generation_prompt,
                                                               req.continue_final_message)
    think = req.chat_template_kwargs.enable_thinking if req.chat_template_kwargs is not None else None
    # the thinking switch as a chat request gets it (its own, a /no_think, else serve --reasoning)
    extra, _ = chat_plan(model, messages, think=think, default_think=state.config.default_think)
    kwargs = {"enable_thinking": extra["enable_thinking"]} if "enable_thinking" in extra else {}
    tools = req.tools or None

    def render() -> str:
        if tools:
            from edgeinfer.prompt.tool_calls import render_with_tools

            draw = lambda ms, gen: render_with_tools(model.template, ms, tools, add_bos=False,  # noqa: E731
                                                     add_generation_prompt=gen, **kwargs)
        else:
            draw = lambda ms, gen: model.apply_chat_template(ms, add_generation_prompt=gen, **kwargs)  # noqa: E731
        if prefill:
            return llama_compat.continued(lambda ms: draw(ms, False), messages)
        return draw(messages, add_generation_prompt)

    return JSONResponse({"prompt": await off_loop(request, render)})


@router.get("/props")
async def props(request: Request) -> JSONResponse:
    state = request.app.state.server
    model = state.require_model()
    template = getattr(getattr(model, "template", None), "source", "") or ""
    return JSONResponse({
        "default_generation_settings": {"n_ctx": model.n_ctx, "params": dict(state.config.sampling)},
        "total_slots": 1, "model_alias": state.model_name, "model_path": str(model.path), **kv_cache_types(model),
        "chat_template": template, "modalities": {"vision": has_image_input(model), "audio": False},
        "media_marker": MARKER,
        "build_info": "edgeinfer"})
