"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request is a chat request by another name: its input items become the template's messages
(edgeinfer.server.responses_input), its tools, tool_choice, text.format and reasoning the same
Model.chat keywords /v1/chat/completions makes (edgeinfer.server.tool_output.chat_plan), and the
answer is read into output items (edgeinfer.server.responses_output), whole or as typed SSE
events with sequence numbers. Responses are kept (edgeinfer.server.responses_store) unless
`store` is false, so `previous_response_id` goes on from one without resending it: the
conversation renders as it did, and the prefix cache serves its tokens (usage's cached_tokens).

Deliberate choices: `truncation: "auto"` leaves out the oldest turns (from a user message on;
instructions and leading system messages stay) until the prompt fits the context with room
for max_output_tokens (up to half of it); `reasoning.effort` "none" turns a template's thinking
off and low/medium/high go to templates that read a level (gpt-oss), anything else is a 400;
`include: ["reasoning.encrypted_content"]` returns the reasoning in a form this server reads
back, so stateless clients (store: false) keep it.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from edgeinfer.server import responses_input
from edgeinfer.server.constraints import compile_constraint, compiled, harmony_think
from edgeinfer.server.errors import APIError
from edgeinfer.server.images import RequestImages
from edgeinfer.server.requests import read_body
from edgeinfer.server.responses_output import Output, new_id, usage_of
from edgeinfer.server.responses_schemas import ResponsesRequest, TextFormat
from edgeinfer.server.responses_store import store_of
from edgeinfer.server.streaming import SSE_HEADERS, collect_chunks, first_chunk, stream_chunks
from edgeinfer.server.tool_output import chat_plan

router = APIRouter()


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", kind="invalid_request_error")


def _text_format(fmt: TextFormat | None):
    """The Constraint for `text.format` (compiled on a grammar thread), or None."""
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.schema_ is not None:
            raise APIError(400, "invalid field 'text.format.schema': it is read only with type 'json_schema'",
                           param="text.format.schema")
        return None
    if fmt.type == "json_object":
        return compile_constraint("text.format", json=True)
    if fmt.schema_ is None:
        raise APIError(400, "invalid field 'text.format.schema': type 'json_schema' needs a schema",
                       param="text.format.schema")
    # strict: at most one space or newline between the JSON's tokens (grammar.COMPACT_JSON_LAYOUT)
    return compile_constraint("text.format.schema", json_schema=fmt.schema_, compact=fmt.strict is True)


def _tools(req: ResponsesRequest) -> list[dict] | None:
    """Function tools in chat completions' shape (`strict` is not rendered: calls always
    validate against their parameters here)."""
    if req.tools is None:
        return None
    return [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
            for t in req.tools]


def _thinking(model, req: ResponsesRequest) -> tuple[bool | None, str | None]:
    """`reasoning.effort` as (enable_thinking, reasoning_effort)."""
    effort = req.reasoning.effort if req.reasoning else None
    if effort == "none":
        harmony_think(model, False, "reasoning.effort")
        return False, None
    return None, effort


def _knows_developer(model) -> bool:
    return "developer" in (getattr(getattr(model, "template", None), "source", "") or "")


def _fit(model, messages: list[dict], extra: dict, params: dict, cancel) -> list[dict]:
    """truncation "auto": the messages without their oldest turns, as few left out as lets the
    prompt fit the context with room for max_output_tokens (at most half of it)."""
    from edgeinfer.server.llama_compat import chat_prompt_ids

    n_ctx = getattr(getattr(model, "sessions", None), "n_ctx", None) or model.n_ctx
    wanted = params.get("max_tokens")
    limit = n_ctx - max(1, min(wanted if isinstance(wanted, int) and wanted > 0 else 0, n_ctx // 2))
    head = next((i for i, m in enumerate(messages) if m["role"] not in ("system", "developer")), len(messages))
    starts = [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]
    kw = {k: extra[k] for k in ("enable_thinking", "reasoning_effort") if k in extra}

    def kept(k: int) -> list[dict]:  # the first k turns left out
        return messages if k == 0 else messages[:head] + messages[starts[k - 1]:]

    def fits(k: int) -> bool:
        ids = chat_prompt_ids(model, kept(k), add_generation_prompt=True, prefill=False, cancel=cancel,
                              tools=extra.get("tools"), **kw)
        return len(ids) < limit

    lo, hi = 0, len(starts)  # the fewest turns to leave out: kept(hi) is the shortest there is
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return kept(lo)


@router.post("/v1/responses")
async def create_response(request: Request):
    state = request.app.state.server
    req = await read_body(request, ResponsesRequest)
    model = state.require_model()
    state.check_model_name(req.model)
    store = store_of(request.app)
    previous: list[dict] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            raise APIError(400, f"Previous response with id {req.previous_response_id!r} not found.",
                           param="previous_response_id", code="previous_response_not_found")
        previous = found.conversation
    new_items = responses_input.items(req.input, store.find_item)
    keep_developer = _knows_developer(model)
    images = RequestImages(state, model)
    messages = responses_input.messages(previous + new_items, keep_developer, len(previous), images)
    await images.resolve()
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise APIError(400, "invalid field 'input': there is nothing to answer (no input, no previous response)",
                       param="input")
    params = state.sampling(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p)
    think, effort = _thinking(model, req)
    fmt = req.text.format if req.text else None
    extra, reader = chat_plan(model, messages, tools=_tools(req), tool_choice=req.tool_choice,
                              parallel_tool_calls=req.parallel_tool_calls, think=think, effort=effort,
                              effort_field="reasoning.effort", default_think=state.config.default_think,
                              constraint=await compiled(state, _text_format, fmt))
    truncate = req.truncation == "auto"
    if truncate and len(images):  # its fit is counted in text tokens: an image's tokens are the encoder's
        raise APIError(400, "invalid field 'truncation': \"auto\" is not supported in a conversation with images",
                       param="truncation")

    def start(cancel):
        shown = _fit(model, messages, extra, params, cancel) if truncate else messages
        return model.chat(shown, stream=True, cancel=cancel, **params, **extra)

    job = state.submit(start)
    sealed = responses_input.seal if req.include and "reasoning.encrypted_content" in req.include else None
    out = Output(reader, sealed)
    head = _head(req, state.model_name, params, fmt)

    def body(status: str, usage: dict | None = None, **more: Any) -> dict:
        return {**head, "status": status, "output": out.items, "usage": usage, **more}

    def finished(last) -> dict:
        incomplete = last.finish_reason == "length"
        final = body("incomplete" if incomplete else "completed", usage_of(last, out.reasoning_tokens),
                     completed_at=None if incomplete else int(time.time()),
                     incomplete_details={"reason": "max_output_tokens"} if incomplete else None)
        if req.store and last.finish_reason != "cancelled":  # (cancelled: the client is gone)
            store.put(final, previous + new_items + out.items)
        return final

    if not req.stream:
        chunks, last = await collect_chunks(job, request)
        for chunk in chunks:
            out.push(chunk)
        out.finish(last.finish_reason == "length")
        return JSONResponse(finished(last))
    first = await first_chunk(job, request)
    return _sse(_events(job, first, out, body, finished))


async def _events(job, first, out: Output, body, finished) -> AsyncIterator[dict]:
    """The stream's events in order: created, in_progress, the output's, then completed or
    incomplete (or an error and failed, once the headers are out)."""
    yield {"type": "response.created", "response": body("in_progress")}
    yield {"type": "response.in_progress", "response": body("in_progress")}
    last = None
    try:
        async for chunk in stream_chunks(job, first):
            for event in out.push(chunk):
                yield event
            if chunk.finish_reason is not None:
                last = chunk
    except APIError as exc:
        for event in _failed(body, exc):
            yield event
        return
    if job.timed_out:
        for event in _failed(body, APIError(504, "the request timed out", code="timeout")):
            yield event
        return
    if last is None or last.finish_reason == "cancelled":  # the client is gone
        return
    for event in out.finish(last.finish_reason == "length"):
        yield event
    final = finished(last)
    yield {"type": f"response.{final['status']}", "response": final}


def _failed(body, exc: APIError) -> list[dict]:
    """OpenAI's `error` event, then response.failed (the headers are out: no status code)."""
    code = exc.code or ("server_error" if exc.status >= 500 else "invalid_request_error")
    return [{"type": "error", "code": code, "message": exc.message, "param": exc.param},
            {"type": "response.failed", "response": body("failed", error={"code": code, "message": exc.message})}]


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def encode() -> AsyncIterator[str]:
        seq = 0
        async for event in events:
            data = json.dumps({**event, "sequence_number": seq}, ensure_ascii=False)
            yield f"event: {event['type']}\ndata: {data}\n\n"
            seq += 1

    return StreamingResponse(encode(), media_type="text/event-stream", headers=SSE_HEADERS)


def _head(req: ResponsesRequest, model_name: str, params: dict, fmt: TextFormat | None) -> dict:
    """The response object's fields that echo the request, as OpenAI's SDK reads them."""
    from edgeinfer.sampling import SamplingParams

    sampling = SamplingParams(**{k: v for k, v in params.items() if k in ("temperature", "top_p")})
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
              "strict": True if t.strict is None else t.strict} for t in req.tools or []]
    return {"id": new_id("resp"), "object": "response", "created_at": int(time.time()), "background": False,
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": req.max_tool_calls,
            "model": model_name, "parallel_tool_calls": req.parallel_tool_calls is True,  # one call unless asked
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "service_tier": "default", "store": req.store, "temperature": sampling.temperature,
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"},
                     "verbosity": "medium"},
            "tool_choice": req.tool_choice or "auto", "tools": tools, "top_logprobs": 0, "top_p": sampling.top_p,
            "truncation": req.truncation or "disabled", "user": req.user, "metadata": req.metadata or {}}


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> JSONResponse:
    name = next(iter(request.query_params), None)
    if name is not None:  # stream, include[], starting_after: background responses are not kept here
        raise APIError(400, f"unsupported query parameter {name!r}: this server does not know it, so it cannot "
                            "honour it", param=name)
    found = store_of(request.app).get(response_id)
    if found is None:
        raise _not_found(response_id)
    return JSONResponse(found.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    if not store_of(request.app).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
