"""Anthropic's Messages API: POST /v1/messages (whole, or streamed as its SSE events) and /v1/messages/count_tokens.

What Claude Code and the Anthropic SDKs speak, mapped onto the chat path the OpenAI dialect
uses (edgeinfer.server.tool_output.chat_plan, Model.chat):

- `system` (a string or text blocks, joined by a blank line) is the template's system message;
  `messages` (consecutive turns of one role merged, as Anthropic merges them) become the
  template's messages: text blocks the content, an assistant's `tool_use` blocks its
  `tool_calls`, its `thinking` blocks its `reasoning_content`, a `tool_result` block a tool
  message (its text; `is_error` writes "Error: " before it). A user turn's image blocks
  (base64 or url sources: edgeinfer.server.images), a tool_result's too (a screenshot), go to
  Model.chat as image parts, for a model served with --mmproj; document input is a 400. A final assistant message is
  continued (Anthropic's prefill), in a conversation without images.
- `tools` ({name, description, input_schema}) and `tool_choice` (auto, any = OpenAI's
  "required", tool = a named function, none; `disable_parallel_tool_use`) go to the
  constrained tool grammar as OpenAI's do; `thinking` (enabled, disabled, adaptive = the
  template's default) is the template's `enable_thinking`; its budget_tokens is bounded here
  by max_tokens only. `output_config.format` (a JSON schema) constrains the answer and
  `output_config.effort` is the template's reasoning_effort, where the template reads one.
- The answer is content blocks: `thinking` (a template's reasoning), `text`, `tool_use`;
  stop_reason end_turn, max_tokens, stop_sequence (with the string) or tool_use; usage with
  `cache_read_input_tokens`, the prompt tokens the prefix cache served (`input_tokens` the
  rest, as Anthropic counts them). Streamed: message_start (sent once the prompt is
  tokenized, its token counts in it), ping (then one per prefill chunk: a long prompt keeps
  the connection busy), content_block_start / _delta (text_delta, thinking_delta,
  input_json_delta) / _stop, message_delta (stop_reason, usage), message_stop.
- Claude Code puts a per-request stamp in its system prompt (`x-anthropic-billing-header:
  ...; cch=XXXXX;`) that would end every prefix-cache hit there; it is written as "fffff",
  as llama-server does.

Errors have Anthropic's shape (edgeinfer.server.errors); `x-api-key` is checked against
--api-key as `Authorization: Bearer` is (edgeinfer.server.security).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from edgeinfer.server import llama_compat
from edgeinfer.server.anthropic_schemas import (AnthropicCountTokensRequest, AnthropicMessagesBase,
                                                AnthropicMessagesRequest, TextBlock)
from edgeinfer.server.constraints import compile_constraint, compiled, harmony_think, speaks_harmony, thinks
from edgeinfer.server.errors import APIError
from edgeinfer.server.off_loop import off_loop
from edgeinfer.server.chat_start import chat_start
from edgeinfer.server.images import RequestImages
from edgeinfer.server.requests import joined_parts, read_body
from edgeinfer.server.streaming import collect_chunks, first_chunk, sse_response, stream_events
from edgeinfer.server.tool_output import OutputReader, chat_plan

router = APIRouter()

_BILLING = re.compile(r"\A(x-anthropic-billing-header:[^\n]*?\bcch=)([0-9A-Za-z]+);")


def _bad(field: str, why: str) -> APIError:
    return APIError(400, f"invalid field {field!r}: {why}", param=field)


# -- the request ------------------------------------------------------------------------------

@dataclass
class Plan:
    """A request read: the template's messages, the Model.chat keywords, the answer's reader."""

    messages: list[dict]
    extra: dict
    reader: OutputReader | None
    add_generation_prompt: bool
    prefill: bool


def _text(blocks, field: str) -> str:
    """A string, or text blocks joined by a blank line; any other block is a 400."""
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, b in enumerate(blocks):
        if b.type != "text":
            raise _refused(b.type, f"{field}.{j}", "in a tool_result")
        parts.append(b.text)
    return "\n\n".join(parts)


def _tool_content(blocks, field: str, is_error: bool, images) -> str | list[dict]:
    """A tool_result's content: its text ("Error: " before it for is_error), or with image blocks
    (a screenshot a tool took) its text and image parts, each image read by `images`."""
    if blocks is None or isinstance(blocks, str) or not any(b.type == "image" for b in blocks):
        text = _text(blocks, field)
        return "Error: " + text if is_error else text
    if images is None:
        j = next(j for j, b in enumerate(blocks) if b.type == "image")
        raise _refused("image", f"{field}.{j}")
    parts = [{"type": "text", "text": "Error: "}] if is_error else []
    for j, b in enumerate(blocks):
        if b.type == "text":
            parts.append({"type": "text", "text": b.text})
        elif b.type == "image":
            parts.append(images.anthropic(b.source, f"{field}.{j}.source"))
        else:
            raise _refused(b.type, f"{field}.{j}", "in a tool_result")
    if is_error and len(parts) > 1 and parts[1]["type"] == "text":  # "Error: " runs into its text
        parts[:2] = [{"type": "text", "text": "Error: " + parts[1]["text"]}]
    return joined_parts(parts)


def _refused(kind: str, field: str, where: str = "") -> APIError:
    if kind == "image" and where:
        return _bad(field, f"an image cannot be {where} (images go in user messages' content)")
    if kind == "image":
        return _bad(field, "images are not counted by this endpoint")
    if kind == "document":
        return _bad(field, "document input is not supported yet")
    if kind == "redacted_thinking":
        return _bad(field, "redacted_thinking blocks cannot be read here (only Anthropic's API decrypts them)")
    return _bad(field, f"a {kind} block cannot be {where}")


def _system(system) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return _unstamped(system)
    return "\n\n".join(_unstamped(b.text) for b in system)


def _unstamped(text: str) -> str:
    return _BILLING.sub(lambda m: m.group(1) + "f" * len(m.group(2)) + ";", text, count=1)


def conversation(req: AnthropicMessagesBase, images=None) -> list[dict]:
    """The request's system prompt and messages as the chat template's messages (checked:
    each tool_result answers an earlier tool_use; refused blocks are a 400 naming them); a user
    turn's image blocks are read by `images` (edgeinfer.server.images.RequestImages; without
    it they are a 400) and make its content text and image parts."""
    out: list[dict] = []
    system = _system(req.system)
    if system is not None:
        out.append({"role": "system", "content": system})
    calls: dict[str, str] = {}  # tool_use id -> tool name
    turns: list[tuple[str, list]] = []   # (role, [(field, block)]): consecutive turns of one role merged
    for i, m in enumerate(req.messages):
        field = f"messages.{i}.content"
        blocks = [(field, TextBlock(type="text", text=m.content))] if isinstance(m.content, str) else \
            [(f"{field}.{j}", b) for j, b in enumerate(m.content)]
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((m.role, blocks))
    for role, blocks in turns:
        if role == "assistant":
            out.append(_assistant(blocks, calls))
        else:
            out.extend(_user(role, blocks, calls, images))
    return out


def _assistant(blocks: list, calls: dict[str, str]) -> dict:
    texts, reasoning, tool_calls = [], [], []
    for field, b in blocks:
        if b.type == "text":
            texts.append(b.text)
        elif b.type == "thinking":
            reasoning.append(b.thinking)
        elif b.type == "tool_use":
            if b.id in calls:
                raise _bad(field + ".id", f"tool_use id {b.id!r} is used twice")
            calls[b.id] = b.name
            tool_calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        else:
            raise _refused(b.type, field, "in an assistant message")
    msg: dict = {"role": "assistant", "content": "\n\n".join(texts)}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    if reasoning:
        msg["reasoning_content"] = "\n\n".join(reasoning)
    return msg


def _user(role: str, blocks: list, calls: dict[str, str], images) -> list[dict]:
    """A user (or system) turn: its text (and image) runs as messages, each tool_result a tool
    message, in order."""
    out: list[dict] = []
    parts: list[dict] = []

    def flush() -> None:
        if any(p["type"] == "image_url" for p in parts):
            out.append({"role": role, "content": joined_parts(parts)})
        elif parts:
            out.append({"role": role, "content": "\n\n".join(p["text"] for p in parts)})
        parts.clear()

    for field, b in blocks:
        if b.type == "text":
            parts.append({"type": "text", "text": b.text})
        elif b.type == "image" and role == "user" and images is not None:
            parts.append(images.anthropic(b.source, field + ".source"))
        elif b.type == "image" and role == "user":
            raise _refused(b.type, field)
        elif b.type == "tool_result" and role == "user":
            name = calls.get(b.tool_use_id)
            if name is None:
                raise _bad(field + ".tool_use_id", f"no earlier tool_use has the id {b.tool_use_id!r}")
            flush()
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "name": name,
                        "content": _tool_content(b.content, field + ".content", bool(b.is_error), images)})
        else:
            raise _refused(b.type, field, f"in a {role} message")
    flush()
    if not out:  # an empty turn is still a turn
        out.append({"role": role, "content": ""})
    return out


def tools_of(req: AnthropicMessagesBase) -> list[dict] | None:
    if req.tools is None:
        return None
    return [{"type": "function", "function": {
        "name": t.name, **({"description": t.description} if t.description is not None else {}),
        "parameters": t.input_schema}} for t in req.tools]


def tool_choice_of(req: AnthropicMessagesBase) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    tc = req.tool_choice
    if tc is None:  # Messages' default: parallel tool use (the server's elsewhere is one call)
        return None, True
    if tc.name is not None and tc.type != "tool":
        raise _bad("tool_choice.name", "it goes with type 'tool' only")
    if tc.type == "none" and tc.disable_parallel_tool_use is not None:
        raise _bad("tool_choice.disable_parallel_tool_use", "it does not go with type 'none'")
    if tc.type == "tool":
        if tc.name is None:
            raise _bad("tool_choice.name", "type 'tool' needs the tool's name")
        choice: Any = {"type": "function", "function": {"name": tc.name}}
    else:
        choice = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
    return choice, not tc.disable_parallel_tool_use


def thinking_of(model, req: AnthropicMessagesBase, max_tokens: int | None) -> bool | None:
    """The template's enable_thinking for Anthropic's `thinking` (None: the template's default,
    or serve --reasoning's)."""
    t = req.thinking
    if t is None:
        return None
    if t.type != "enabled" and t.budget_tokens is not None:
        raise _bad("thinking.budget_tokens", "it goes with type 'enabled' only")
    if t.type == "disabled" and t.display is not None:
        raise _bad("thinking.display", "it does not go with type 'disabled'")
    if t.type == "adaptive":
        return None
    if t.type == "disabled":
        harmony_think(model, False, "thinking")
        return False if thinks(model) else None
    if t.budget_tokens is None:
        raise _bad("thinking.budget_tokens", "type 'enabled' needs a budget_tokens")
    if max_tokens is not None and t.budget_tokens >= max_tokens:
        raise _bad("thinking.budget_tokens", f"it must be less than max_tokens ({max_tokens})")
    if not thinks(model):
        raise _bad("thinking", "this model does not support thinking")
    return None if speaks_harmony(model) else True


async def plan_of(state, model, req: AnthropicMessagesBase, max_tokens: int | None, constrain: bool,
                  images=None) -> Plan:
    messages = conversation(req, images)
    if images is not None:
        await images.resolve()
    choice, parallel = tool_choice_of(req)
    think = thinking_of(model, req, max_tokens)
    oc = req.output_config
    constraint = None
    if constrain and oc is not None and oc.format is not None:
        constraint = await compiled(state, compile_constraint, "output_config.format.schema",
                                    json_schema=oc.format.schema_)
    extra, reader = chat_plan(model, messages, tools=tools_of(req), tool_choice=choice, parallel_tool_calls=parallel,
                              think=think, effort=oc.effort if oc is not None else None,
                              effort_field="output_config.effort", constraint=constraint,
                              default_think=state.config.default_think)
    add_generation_prompt, prefill = llama_compat.prefill_mode(messages, None, None)
    if prefill and extra.get("tools"):
        raise _bad("messages", "a final assistant message cannot be continued in a request with tools")
    return Plan(messages, extra, reader, add_generation_prompt, prefill)


# -- the answer -------------------------------------------------------------------------------

def _tool_use(call) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments}


def content_blocks(reader: OutputReader | None, text: str, omit_thinking: bool) -> list[dict]:
    """A whole answer's content blocks: thinking, text, tool_use."""
    if reader is None:
        return [{"type": "text", "text": text}] if text.strip() else []
    p = reader.parse(text)
    out: list[dict] = []
    if p.reasoning:
        out.append({"type": "thinking", "thinking": "" if omit_thinking else p.reasoning, "signature": ""})
    if p.content.strip():
        out.append({"type": "text", "text": p.content})
    out.extend(_tool_use(c) for c in p.tool_calls)
    return out


def stop_of(last, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if last.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if last.stop_word is not None:
        return "stop_sequence", last.stop_word
    return "end_turn", None


def usage_of(prompt: int, cached: int, output: int) -> dict:
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": output}


def _final_usage(last) -> dict:
    u = last.usage
    return usage_of(u.prompt_tokens, u.cached_tokens, u.completion_tokens) if u is not None else usage_of(0, 0, 0)


class StreamedBlocks:
    """The content block events of a streamed answer: each reader event opens, fills or closes
    a block (a tool_use block whole: start, its input as one input_json_delta, stop). A text
    block opens at its first visible character: whitespace alone (between two calls, at the
    end) makes none, as it makes none in a whole answer."""

    def __init__(self, reader: OutputReader | None, omit_thinking: bool) -> None:
        self._stream = reader.stream() if reader is not None else None
        self._omit = omit_thinking
        self._index = -1
        self._open: str | None = None   # "text" or "thinking"
        self._blank = ""                # whitespace before a text block opens
        self.called = False

    def push(self, text: str) -> list[dict]:
        if not text:
            return []
        return self._events(self._stream.push(text) if self._stream is not None else [("content", text)])

    def finish(self) -> list[dict]:
        out = self._events(self._stream.flush()) if self._stream is not None else []
        return out + self._close()

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._index}]

    def _start(self, block: dict) -> list[dict]:
        out = self._close()
        self._index += 1
        return out + [{"type": "content_block_start", "index": self._index, "content_block": block}]

    def _events(self, events: list) -> list[dict]:
        out: list[dict] = []
        for kind, value in events:
            if kind == "tool_call":
                self._blank = ""
                out += self._start(_tool_use(value) | {"input": {}})
                out.append({"type": "content_block_delta", "index": self._index,
                            "delta": {"type": "input_json_delta", "partial_json": value.arguments_json}})
                out.append({"type": "content_block_stop", "index": self._index})
                self.called = True
                continue
            if not value:
                continue
            block = "thinking" if kind == "reasoning" else "text"
            if block == "text" and self._open != "text":
                if not value.strip():
                    self._blank += value
                    continue
                value, self._blank = self._blank + value, ""
            if self._open != block:
                out += self._start({"type": "text", "text": ""} if block == "text" else
                                   {"type": "thinking", "thinking": "", "signature": ""})
                self._open = block
            if block == "thinking" and self._omit:
                continue
            delta = {"type": "text_delta", "text": value} if block == "text" else \
                {"type": "thinking_delta", "thinking": value}
            out.append({"type": "content_block_delta", "index": self._index, "delta": delta})
        return out


def sse_event(obj: dict) -> str:
    """One of Anthropic's server-sent events: named by its type."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


# -- the endpoints ----------------------------------------------------------------------------

@router.post("/v1/messages")
async def messages(request: Request):
    state = request.app.state.server
    req = await read_body(request, AnthropicMessagesRequest)
    model = state.require_model()
    state.check_model_name(req.model)
    plan = await plan_of(state, model, req, req.max_tokens, constrain=True, images=RequestImages(state, model))
    params = state.sampling(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                            top_k=req.top_k, stop=req.stop_sequences)
    if req.stream:
        params["prompt_progress"] = True   # message_start as soon as the prompt's tokens are known
    chat = chat_start(model, plan.messages, plan.extra, plan.add_generation_prompt, plan.prefill)
    job = state.submit(chat(params))
    omit = req.thinking is not None and req.thinking.display == "omitted"
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": state.model_name}
    if not req.stream:
        chunks, last = await collect_chunks(job, request)
        content = content_blocks(plan.reader, "".join(c.text for c in chunks), omit)
        reason, sequence = stop_of(last, any(b["type"] == "tool_use" for b in content))
        return JSONResponse({**head, "content": content, "stop_reason": reason, "stop_sequence": sequence,
                             "usage": _final_usage(last)})
    first = await first_chunk(job, request)
    blocks = StreamedBlocks(plan.reader, omit)
    started = False

    def on_chunk(chunk) -> list[dict]:
        nonlocal started
        out: list[dict] = []
        progress = chunk.prompt_progress
        if not started:
            started = True
            usage = usage_of(progress.total, progress.cache, 0) if progress is not None else usage_of(0, 0, 0)
            out += [{"type": "message_start", "message": {**head, "content": [], "stop_reason": None,
                                                          "stop_sequence": None, "usage": usage}},
                    {"type": "ping"}]
        elif progress is not None:
            out.append({"type": "ping"})   # a prefill chunk done: the connection stays busy
        if progress is not None:
            return out
        out += blocks.push(chunk.text)
        if chunk.finish_reason is not None:
            out += blocks.finish()
            reason, sequence = stop_of(chunk, blocks.called)
            out += [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": _final_usage(chunk)},
                    {"type": "message_stop"}]
        return out

    return sse_response(stream_events(job, first, request.url.path, sse_event, None, lambda last: [],
                                      on_chunk=on_chunk))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    """The templated prompt's tokens, as /v1/messages would make them (tools and thinking
    switch included; output_config.format changes no prompt, so it is not compiled here)."""
    state = request.app.state.server
    req = await read_body(request, AnthropicCountTokensRequest)
    model = state.require_model()
    state.check_model_name(req.model)
    plan = await plan_of(state, model, req, None, constrain=False)
    template_kw = {k: plan.extra[k] for k in ("enable_thinking", "reasoning_effort") if k in plan.extra}
    ids = await off_loop(request, lambda: llama_compat.chat_prompt_ids(
        model, plan.messages, add_generation_prompt=plan.add_generation_prompt, prefill=plan.prefill,
        tools=plan.extra.get("tools"), **template_kw))
    return JSONResponse({"input_tokens": len(ids)})
