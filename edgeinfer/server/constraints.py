"""Request fields that shape an answer, read into Model keywords: structured output, tools, thinking.

Every dialect's way of asking for constrained output ends here as one compiled
`edgeinfer.prompt.grammar.Constraint` (built in the endpoint, so a bad schema or grammar is a
400 naming the field before anything runs):

- OpenAI `response_format`: {"type": "text"}, {"type": "json_object"} (any JSON object),
  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}};
- Ollama `format`: "json" or a JSON schema;
- llama-server `grammar` (GBNF), `json_schema`, and `response_format` as OpenAI's.

Tools (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`; Ollama's `tools`) are
checked here and handed to `Model.chat`, which renders them through the model's template
and constrains the calls (edgeinfer.prompt.tool_calls). Thinking: Ollama's `think`, or a
`/think` / `/no_think` in the last user message, sets the template's `enable_thinking`; a
level (Ollama's `think: "low"`, OpenAI's `reasoning_effort`) is the template's
`reasoning_effort`, for templates that read it (gpt-oss). A harmony model always reasons:
asking it not to is a 400.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import queue
import threading
import time
from typing import Any, Callable, Mapping

from edgeinfer.errors import EdgeInferError
from edgeinfer.prompt.harmony import is_harmony
from edgeinfer.server.errors import APIError

log = logging.getLogger("edgeinfer.server")

EFFORTS = ("low", "medium", "high")  # gpt-oss's reasoning levels (its template's `reasoning_effort`)


def _bad(field: str, exc: Exception | str) -> APIError:
    return APIError(400, f"invalid field {field!r}: {exc}", param=field)


# -- compiling off the event loop ----------------------------------------------------------
# A grammar compiles on one of these threads (large stacks: edgeinfer.prompt.grammar), never
# on the event loop: /health and the other requests go on meanwhile. The compile counts in
# the request's --timeout (state.submit starts the clock where the compile started), and a
# compile that takes longer than COMPILE_BUDGET_S is a 400: the grammar's bounds keep real
# compiles to milliseconds, so one that long is too costly for this server.
COMPILE_BUDGET_S = 5.0
COMPILE_THREADS = 2
request_clock: contextvars.ContextVar[float | None] = contextvars.ContextVar("edgeinfer_request_clock",
                                                                            default=None)


class _Compilers:
    """COMPILE_THREADS threads with large stacks, taking compile jobs from one queue."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        with self._lock:
            if not self._threads:
                from edgeinfer.big_stack import start_thread

                self._threads = [start_thread(self._run, f"edgeinfer-grammar-{i}")
                                 for i in range(COMPILE_THREADS)]
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def _run(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # the request gave up (timed out, went away) before it started
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the request
                future.set_exception(exc)


_compilers = _Compilers()


async def compiled(state, fn: Callable[..., Any], *args: Any, **kwargs: Any):
    """`fn(*args, **kwargs)` (one of the constraint readers below) run on a grammar thread:
    its result, its APIError; a 400 past COMPILE_BUDGET_S, a 504 past the request's timeout."""
    now = time.monotonic()
    if request_clock.get() is None:
        request_clock.set(now)
    budget, timed_out = COMPILE_BUDGET_S, False
    timeout = state.config.timeout_s
    if timeout:
        left = timeout - (now - request_clock.get())
        if left < budget:
            budget, timed_out = max(0.0, left), True
    future = _compilers.submit(lambda: fn(*args, **kwargs))
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), budget)
    except asyncio.TimeoutError:
        future.cancel()
        if timed_out:
            raise APIError(504, f"the request took longer than {timeout}s (compiling its grammar)",
                           code="timeout") from None
        log.warning("a grammar took longer than %gs to compile; refused", COMPILE_BUDGET_S)
        raise APIError(400, f"the grammar or schema is too costly to compile (over {COMPILE_BUDGET_S:g}s); "
                            "make it smaller or shallower") from None


def compile_constraint(field: str, **request: Any):
    """`edgeinfer.prompt.grammar.from_request(**request)`, its GrammarError a 400 naming `field`."""
    from edgeinfer.prompt import grammar

    try:
        return grammar.from_request(**request)
    except EdgeInferError as exc:
        raise _bad(field, exc) from None


def response_format(rf: Any, field: str = "response_format"):
    """The Constraint for OpenAI's `response_format` (a ResponseFormat or its dict), or None."""
    if rf is None:
        return None
    if not isinstance(rf, Mapping):
        rf = rf.model_dump(exclude_none=True, by_alias=True)
    kind = rf.get("type", "text")
    if kind == "text":
        if rf.get("json_schema") is not None or rf.get("schema") is not None:
            raise _bad(field, "json_schema and schema are only read with type 'json_schema' or 'json_object'")
        return None
    if kind == "json_object":
        if rf.get("schema") is not None:  # llama-server: the schema beside type json_object
            return compile_constraint(field + ".schema", json_schema=rf["schema"])
        return compile_constraint(field, json=True)
    if kind != "json_schema":
        raise _bad(field, f"type {kind!r} is not supported (text, json_object or json_schema)")
    spec = rf.get("json_schema")
    if not isinstance(spec, Mapping):
        raise _bad(field + ".json_schema", "it must be an object with a 'schema'")
    if "schema" not in spec:
        # llama-server also takes the schema itself here
        schema = {k: v for k, v in spec.items() if k not in ("name", "strict", "description")}
        if not schema:
            raise _bad(field + ".json_schema", "it has no 'schema'")
    else:
        schema = spec["schema"]
    # strict: the answer is this JSON and nothing else, so at most one space or newline
    # between its tokens (grammar.COMPACT_JSON_LAYOUT); otherwise the pretty-printing layout
    return compile_constraint(field + ".json_schema", json_schema=schema, compact=spec.get("strict") is True)


def ollama_format(fmt: Any, field: str = "format"):
    """The Constraint for Ollama's `format`: "json", a JSON schema (object), or nothing."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return compile_constraint(field, json=True)
    if isinstance(fmt, Mapping):
        return compile_constraint(field, json_schema=dict(fmt))
    raise _bad(field, f'expected "json" or a JSON schema object, got {fmt!r}')


def llama_constraint(grammar: str | None, json_schema: Any, rf: Any):
    """llama-server's `grammar`, `json_schema` and `response_format`: at most one."""
    given = [n for n, v in (("grammar", grammar), ("json_schema", json_schema), ("response_format", rf))
             if v is not None and not (n == "response_format" and _is_text(rf))]
    if len(given) > 1:
        raise _bad(given[1], f"give only one of grammar, json_schema and response_format (got {', '.join(given)})")
    if grammar is not None:
        return compile_constraint("grammar", grammar=grammar)
    if json_schema is not None:
        return compile_constraint("json_schema", json_schema=json_schema)
    return response_format(rf)


def _is_text(rf: Any) -> bool:
    kind = rf.get("type", "text") if isinstance(rf, Mapping) else getattr(rf, "type", "text")
    return kind == "text"


def add_constraint(params: dict, constraint) -> dict:
    """`params` with the constraint for the Model call (the shown settings keep its kind only)."""
    if constraint is None:
        return params
    return {**params, "constraint": constraint}


# -- tools ------------------------------------------------------------------------------------

def tool_keywords(model, tools: list | None, tool_choice: Any = None,
                  parallel_tool_calls: bool | None = None) -> dict:
    """Model.chat keywords for a request's tools, checked: a 400 naming the field for a bad
    tool or choice (a template that cannot render tools gets them as text:
    edgeinfer.prompt.tool_polyfill)."""
    from edgeinfer.prompt.tool_calls import ToolCallError, normalize_tools, select_tools

    try:
        normalized = normalize_tools(tools)
    except ToolCallError as exc:
        raise _bad("tools", exc) from None
    if tool_choice is not None and not normalized and tool_choice != "none":
        raise _bad("tool_choice", "it needs tools")
    if not normalized:
        return {}
    try:
        mode, _ = select_tools(normalized, tool_choice)
    except ToolCallError as exc:
        raise _bad("tool_choice", exc) from None
    out: dict = {"tools": normalized}
    if tool_choice is not None:
        out["tool_choice"] = tool_choice
    if parallel_tool_calls is not None:
        out["parallel_tool_calls"] = parallel_tool_calls
    if mode == "none":
        out["tool_choice"] = "none"
    return out


# -- thinking ---------------------------------------------------------------------------------

def _source(model) -> str:
    return getattr(getattr(model, "template", None), "source", "") or ""


def channel_format(model) -> str | None:
    """The model's chat format when its answers are channels written with control tokens
    (harmony, gemma4: edgeinfer.prompt.tool_calls.CHANNEL_FORMATS), else None."""
    from edgeinfer.prompt.tool_calls import CHANNEL_FORMATS, detect_format

    fmt = detect_format(_source(model))
    return fmt if fmt in CHANNEL_FORMATS else None


def speaks_harmony(model) -> bool:
    """Whether the model's template is harmony's (gpt-oss): its answers are channels."""
    return is_harmony(_source(model))


def thinks(model) -> bool:
    """Whether the model's template writes `<think>` blocks (Qwen 3, DeepSeek R1, QwQ...) or
    harmony's analysis channel (gpt-oss)."""
    source = _source(model)
    return "<think>" in source or "enable_thinking" in source or is_harmony(source)


def harmony_think(model, think: bool | None, field: str) -> None:
    """A harmony model cannot be told not to reason (its template has no switch): false is a
    400 naming `field`; true, or nothing, is what it does anyway."""
    if think is False and speaks_harmony(model):
        raise _bad(field, "this model always reasons (harmony's analysis channel); "
                          f"lower its reasoning_effort ({', '.join(EFFORTS)}) instead")


def effort_keywords(model, effort: Any, field: str = "reasoning_effort") -> dict:
    """Model.chat's `reasoning_effort`, checked: one of EFFORTS, for a template that reads it."""
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise _bad(field, f"expected one of {', '.join(EFFORTS)}, got {effort!r}")
    if "reasoning_effort" not in _source(model):
        raise _bad(field, "this model's chat template takes no reasoning effort")
    return {"reasoning_effort": effort}


def thinking_switch(messages: list[dict], think: bool | None) -> bool | None:
    """The template's `enable_thinking`: the request's own choice, else a `/no_think` or
    `/think` at the end of the last user message (Qwen 3's soft switch), else None."""
    if think is not None:
        return think
    for m in reversed(messages):
        if m.get("role") == "user":
            text = m.get("content") if isinstance(m.get("content"), str) else ""
            tail = text.rstrip()
            if tail.endswith("/no_think"):
                return False
            if tail.endswith("/think"):
                return True
            return None
    return None


def ollama_think(model, think: Any, raw: bool = False) -> tuple[bool | None, str | None]:
    """Ollama's `think` as (enable_thinking, reasoning_effort): true or false, or a level
    ("low", "medium", "high") for a template that takes one (gpt-oss). A 400 for true on a
    model that does not think, false on one that always does, a level elsewhere; false on
    a model that does not think asks for nothing."""
    if think is None:
        return None, None
    if isinstance(think, str):
        if raw:
            raise _bad("think", "it needs the chat template (raw is true)")
        effort = effort_keywords(model, think, "think")["reasoning_effort"]
        return None, effort
    if not thinks(model):
        if think:
            raise _bad("think", "this model does not support thinking")
        return None, None
    if raw and think:
        raise _bad("think", "it needs the chat template (raw is true)")
    if raw:
        return None, None
    harmony_think(model, think, "think")
    return (None if speaks_harmony(model) else think), None
