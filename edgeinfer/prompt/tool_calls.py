"""Tool calling, the model side: render tools through the chat template, parse each family's calls.

Families (`detect_format(template_source)`):
- "hermes": Qwen 2.5 / Qwen 3 / Hermes, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, content around them allowed;
- "llama3": Llama 3.1 / 3.2, the answer is `{"name": ..., "parameters": {...}}` (after an
  optional `<|python_tag|>`; several calls separated by `;`);
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the control token may be
  missing from decoded text: a leading JSON array of calls reads the same);
- "harmony": gpt-oss, OpenAI's harmony channels; a call is a message `to=functions.NAME`
  whose body is the JSON arguments, reasoning the analysis channel (edgeinfer.prompt.harmony);
- "gemma4": Gemma 4, `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>` in its own
  value notation, reasoning its `<|channel>thought ... <channel|>` (edgeinfer.prompt.gemma4_format);
- "generic": the documented fallback for any other template: an answer that is exactly a
  JSON object {"name", "arguments"} (or a list of them, or {"tool_calls": [...]}) is a call.

Text the parser cannot read as a call stays content: nothing is ever dropped.
`ToolCallStream` does the same incrementally: it holds back text that may begin a call and
emits each call once complete (the server's `delta.tool_calls`); `answer_stream` picks it, or
harmony's own stream for a harmony template. `split_reasoning` moves
Qwen 3's `<think>...</think>` to a separate field. `tool_constraint` builds the grammar that
makes a call's arguments validate against the function's schema (tool_choice "required" or
a named function), or a lazy one for "auto" (free text until the family's trigger).
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping, Sequence

from edgeinfer.errors import EdgeInferError
from edgeinfer.prompt import gemma4_format, harmony, schema_rules
from edgeinfer.prompt.answer_parts import (CallAnswerStream, IncrementalReader, ParsedOutput, ToolCall,
                                           partial_suffix)
from edgeinfer.prompt.tool_polyfill import needs_polyfill, polyfilled

__all__ = ["ToolCall", "ParsedOutput", "ToolsNotSupportedError", "ToolCallError", "detect_format",
           "supports_tools", "normalize_tools", "normalize_messages", "render_with_tools",
           "parse_tool_calls", "split_reasoning", "parse_output", "ToolCallStream", "answer_stream",
           "tool_constraint"]

FORMATS = ("hermes", "llama3", "mistral", "harmony", "gemma4", "generic")
# formats whose answers are channels written with control tokens: always read (never shown as
# they are), with their markup tokens shown in the decoded text (`markup_token_ids`)
CHANNEL_FORMATS = {"harmony": (harmony.START, harmony.CHANNEL, harmony.CONSTRAIN, harmony.MESSAGE, harmony.END),
                   "gemma4": gemma4_format.MARKUP}


class ToolsNotSupportedError(EdgeInferError):
    """The model's chat template has no `tools` variable: it cannot be given tools (HTTP 400)."""


class ToolCallError(EdgeInferError):
    """Bad `tools` / `tool_choice` / tool messages in a request (HTTP 400)."""


# ---------------------------------------------------------------------------
# Templates
# ---------------------------------------------------------------------------

def supports_tools(template_source: str) -> bool:
    """Whether the template reads the `tools` variable (HF convention)."""
    return re.search(r"\btools\b", template_source or "") is not None


def detect_format(template_source: str) -> str:
    src = template_source or ""
    if harmony.is_harmony(src):  # before hermes: its channels are the whole answer's structure
        return "harmony"
    if gemma4_format.is_gemma4(src):
        return "gemma4"
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_tag|>" in src or ('"parameters"' in src and "ipython" in src):
        return "llama3"
    return "generic"


def markup_token_ids(tokenizer, fmt: str) -> frozenset[int]:
    """The control tokens a `fmt` answer's structure is written with (harmony's channels,
    Gemma 4's): the decoder shows them as text for the readers (llama-server's preserved
    tokens). Empty for formats written in plain text."""
    ids = (tokenizer.token_id(t) for t in CHANNEL_FORMATS.get(fmt, ()))
    return frozenset(i for i in ids if i is not None)


def template_history(messages: Sequence[Mapping[str, Any]], template_source: str) -> list[dict]:
    """The history reshaped for a channel format's template (reasoning where it reads it)."""
    fmt = detect_format(template_source)
    if fmt == "harmony":
        return harmony.template_messages(messages)
    if fmt == "gemma4":
        return gemma4_format.template_messages(messages, template_source)
    return list(messages)


def normalize_tools(tools: Any) -> list[dict]:
    """Check OpenAI-style tools ({"type": "function", "function": {name, description, parameters}});
    a bare {name, parameters} is wrapped. ToolCallError names the first bad entry."""
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise ToolCallError("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ToolCallError(f"tools[{i}] must be an object")
        fn = tool.get("function") if "function" in tool else tool
        if tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise ToolCallError(f"tools[{i}]: only type 'function' tools are supported")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolCallError(f"tools[{i}]: function name must be 1-64 letters, digits, _ . -")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise ToolCallError(f"tools[{i}] ({name}): parameters must be a JSON schema object")
        out.append({"type": "function", "function": {**fn, "name": name, "parameters": dict(params)}})
    return out


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """OpenAI messages as templates expect them: a tool call's `arguments` as a dict
    (OpenAI sends a JSON string; templates apply `tojson`)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                c = dict(c)
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass  # keep the text: the template writes it as it is
                c["function"] = fn
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out


def render_with_tools(template, messages: Sequence[Mapping[str, Any]], tools: Any = None, *,
                      add_bos: bool, enable_thinking: bool | None = None,
                      reasoning_effort: str | None = None, cancel=None, add_generation_prompt: bool = True,
                      **kwargs: Any) -> str:
    """The prompt for `messages` (+ `tools`) through the model's own template
    (edgeinfer.prompt.chat_template.ChatTemplate.render_prompt: its budget applies); one
    that does not render tools gets them as text (edgeinfer.prompt.tool_polyfill); a
    channel template (harmony, Gemma 4) gets the history as it reads it (template_history)."""
    tools = normalize_tools(tools)
    if not supports_tools(template.source) and needs_polyfill(messages, tools):
        messages, tools = polyfilled(normalize_messages(messages), tools), []  # as llama-server's polyfill
    if enable_thinking is not None:
        kwargs["enable_thinking"] = bool(enable_thinking)
    if reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
    messages = template_history(normalize_messages(messages), template.source)
    text = template.render_prompt(messages, add_bos=add_bos, add_generation_prompt=add_generation_prompt,
                                  tools=tools or None, cancel=cancel, **kwargs)
    if gemma4_format.is_gemma4(template.source):
        text = gemma4_format.finish_prompt(text, add_generation_prompt)
    return text


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------

_DECODER = json.JSONDecoder()


def _call_from(obj: Any, args_key: str | None = None) -> ToolCall | None:
    """A ToolCall from {"name", "arguments"|"parameters"} (arguments as object or JSON text)."""
    if not isinstance(obj, dict):
        return None
    if "function" in obj and isinstance(obj["function"], dict) and "name" not in obj:
        obj = {**obj["function"], **({"id": obj["id"]} if "id" in obj else {})}
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    keys = (args_key,) if args_key else ("arguments", "parameters")
    args: Any = None
    for k in keys:
        if k in obj:
            args = obj[k]
            break
    else:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    call = ToolCall(name, args)
    if isinstance(obj.get("id"), str) and obj["id"]:
        call.id = obj["id"]
    return call


def _json_values(text: str) -> list[Any] | None:
    """All of `text` as JSON values separated by whitespace or ';', or None."""
    values, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n;":
            i += 1
        if i >= n:
            return values
        try:
            value, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def _calls_of(values: list[Any]) -> list[ToolCall] | None:
    calls = []
    for v in values:
        items = v if isinstance(v, list) else (v["tool_calls"] if isinstance(v, dict) and
                                               isinstance(v.get("tool_calls"), list) else [v])
        for item in items:
            c = _call_from(item)
            if c is None:
                return None
            calls.append(c)
    return calls or None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)


def parse_tool_calls(text: str, fmt: str, forced: bool = False) -> ParsedOutput:
    """Calls and the remaining content of one generated answer (no reasoning handling).

    Call markup never reaches the content: a call cut off before its end (max_tokens) or
    unreadable is dropped, and with `forced` (tool_choice "required" or a named function, where the grammar allowed
    nothing but calls) any text that is not a readable call, are dropped."""
    out = _parse_calls(text, fmt)
    if forced:
        out.content = ""
    return out


def _parse_calls(text: str, fmt: str) -> ParsedOutput:
    if fmt == "harmony":
        return harmony.parse(text, tools=True)
    if fmt == "gemma4":
        return gemma4_format.parse(text, tools=True)
    if fmt == "hermes":
        content, calls, pos = [], [], 0
        for m in _HERMES.finditer(text):
            call = None
            values = _json_values(m.group(1))
            if values and len(values) == 1:
                call = _call_from(values[0])
            content.append(text[pos:m.start()])  # a block that is no call (cut off, malformed) goes
            if call is not None:
                calls.append(call)
            pos = m.end()
        rest = text[pos:]
        cut = partial_suffix(rest.rstrip(), ("<tool_call>",)) if calls else 0
        if cut:  # a next call cut off inside its tag ("<tool", max_tokens) is markup too
            rest = rest.rstrip()[:-cut]
        content.append(rest)
        joined = "".join(content)
        return ParsedOutput(joined.strip() if pos else text, calls)
    if fmt == "mistral":
        at = text.find("[TOOL_CALLS]")
        head, body = (text[:at], text[at + len("[TOOL_CALLS]"):]) if at >= 0 else ("", text)
        if at < 0 and not body.lstrip().startswith("["):
            return ParsedOutput(text, [])
        unread = ParsedOutput(head.strip() if at >= 0 else text, [])  # [TOOL_CALLS] is markup
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\](.*)\Z", body, re.S)  # the v11+ layout
        if m:
            values = _json_values(m.group(2))
            call = _call_from({"name": m.group(1), "arguments": values[0]}) if values and len(values) == 1 else None
            return ParsedOutput(head.strip(), [call]) if call else unread
        values = _json_values(body)
        calls = _calls_of(values) if values else None
        return ParsedOutput(head.strip(), calls) if calls else unread
    if fmt in ("llama3", "generic"):
        body = text.strip()
        if fmt == "llama3" and body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        tagged = fmt == "llama3" and text.strip().startswith("<|python_tag|>")
        if not body.startswith(("{", "[")):
            return ParsedOutput("" if tagged else text, [])
        values = _json_values(body)
        calls = _calls_of(values) if values else None
        return ParsedOutput("", calls) if calls else ParsedOutput("" if tagged else text, [])
    raise ToolCallError(f"unknown tool-call format {fmt!r} (known: {', '.join(FORMATS)})")


def split_reasoning(text: str, started: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a `<think>...</think>` answer; `started`: the prompt opened
    the block (the answer then begins inside it). An unclosed block is all reasoning."""
    stripped = text.lstrip()
    if not started and not stripped.startswith("<think>"):
        return None, text
    body = stripped[len("<think>"):] if stripped.startswith("<think>") else text
    end = body.find("</think>")
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len("</think>"):].lstrip()


def parse_output(text: str, fmt: str, *, reasoning: bool = False, think_started: bool = False,
                 tools: bool = True, forced: bool = False) -> ParsedOutput:
    """Reasoning (when asked), then tool calls (when the request had tools), then content
    (`forced`: the request forced a call, see parse_tool_calls)."""
    if fmt in CHANNEL_FORMATS:  # its channels say which text is which
        out = harmony.parse(text, tools=tools) if fmt == "harmony" else gemma4_format.parse(text, tools=tools)
        if forced:
            out.content = ""
        return out
    thought = None
    if reasoning:
        thought, text = split_reasoning(text, think_started)
    out = parse_tool_calls(text, fmt, forced) if tools else ParsedOutput(text, [])
    out.reasoning = thought
    return out


def answer_stream(fmt: str, *, reasoning: bool = False, think_started: bool = False,
                  tools: bool = True, forced: bool = False):
    """The incremental reader of a `fmt` answer: harmony's, or a ToolCallStream. Both have
    push(text) / flush() returning the same events; with `tools`, shaped around the calls as
    the whole answer's parse is (CallAnswerStream: no call markup, whitespace or, when
    `forced`, any text as content)."""
    if fmt == "harmony":
        inner = harmony.HarmonyStream(tools=tools)
    elif fmt == "gemma4":
        inner = gemma4_format.Gemma4Stream(tools=tools)
    else:
        inner = ToolCallStream(fmt, reasoning=reasoning, think_started=think_started, tools=tools, forced=forced)
    return CallAnswerStream(inner, forced=forced) if tools else inner


class ToolCallStream(IncrementalReader):
    """Incremental `parse_output`: push text pieces, get events back.

    Events: ("reasoning", text), ("content", text), ("tool_call", ToolCall). Text that may
    be the start of a call is held until it is known; `flush()` at the end releases the
    rest. The content, reasoning and calls of all events equal `parse_output` of the whole
    text (the content may differ by surrounding whitespace).
    """

    def __init__(self, fmt: str, *, reasoning: bool = False, think_started: bool = False,
                 tools: bool = True, forced: bool = False) -> None:
        if fmt not in FORMATS or fmt in CHANNEL_FORMATS:
            raise ToolCallError(f"unknown tool-call format {fmt!r} (harmony, gemma4: use answer_stream)")
        self.fmt = fmt
        self.tools = tools
        self.forced = forced  # only calls could be written: unreadable text is a cut-off call
        self._buf = ""
        self._state = "think?" if reasoning else "content"
        self._think_started = think_started
        self._seen_content = False  # anything but whitespace emitted as content
        self._after_think = False
        self._calls_read = False  # a hermes call was read (a cut-off tag after it is markup)

    # -- internals -------------------------------------------------------------------------
    def _step(self, events, final) -> None:
        getattr(self, "_step_" + self._state.replace("?", "_q"))(events, final)

    def _events(self, events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return [e for e in events if e[0] == "tool_call" or e[1]]

    def _step_think_q(self, events, final) -> None:
        s = self._buf.lstrip()
        if self._think_started:
            self._buf, self._state = s, "think"
        elif s.startswith("<think>"):
            self._buf, self._state = s[len("<think>"):], "think"
        elif s and not "<think>".startswith(s):
            self._state = "content"
        elif final:
            self._state = "content"

    def _step_think(self, events, final) -> None:
        end = self._buf.find("</think>")
        if end >= 0:
            events.append(("reasoning", self._buf[:end]))
            self._buf, self._state = self._buf[end + len("</think>"):].lstrip(), "content"
            self._after_think = True  # the blank line after </think> is not content
            return
        keep = 0 if final else partial_suffix(self._buf, ("</think>",))
        events.append(("reasoning", self._buf[:len(self._buf) - keep]))
        self._buf = self._buf[len(self._buf) - keep:]

    def _step_content(self, events, final) -> None:
        if not self.tools:
            events.append(("content", self._buf))
            self._buf = ""
            return
        if self.fmt == "hermes":
            at = self._buf.find("<tool_call>")
            if at >= 0:
                self._emit_content(events, self._buf[:at])
                self._buf, self._state = self._buf[at:], "call"
                return
            keep = partial_suffix(self._buf if not final else self._buf.rstrip(), ("<tool_call>",))
            if final and keep:
                if self._calls_read:  # a next call cut off inside its tag: markup, as parse_tool_calls
                    self._buf = self._buf.rstrip()[:-keep]
                keep = 0
        else:
            at = self._buf.find("[TOOL_CALLS]") if self.fmt == "mistral" else -1
            if at >= 0:
                self._emit_content(events, self._buf[:at])
                self._buf, self._state = self._buf[at:], "held"
                return
            head = self._buf.lstrip()
            if not self._seen_content and (head.startswith(("{", "[")) or
                                           (self.fmt == "llama3" and head.startswith("<|python_tag|>"))):
                self._state = "held"  # a whole-answer call: known only at the end
                return
            if not self._seen_content and not head and not final:
                return  # leading whitespace: wait for the first character
            if not self._seen_content and self.fmt == "llama3" and "<|python_tag|>".startswith(head) and not final:
                return
            keep = 0 if final or self.fmt != "mistral" else partial_suffix(self._buf, ("[TOOL_CALLS]",))
        self._emit_content(events, self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]

    def _step_call(self, events, final) -> None:  # hermes, from "<tool_call>"
        end = self._buf.find("</tool_call>")
        if end < 0 and not final:
            return
        block = self._buf if end < 0 else self._buf[:end + len("</tool_call>")]
        parsed = parse_tool_calls(block, "hermes", self.forced)
        if parsed.tool_calls:
            self._calls_read = True
            events.extend(("tool_call", c) for c in parsed.tool_calls)
        else:
            self._emit_content(events, parsed.content)  # "" for a call cut off
        self._buf, self._state = self._buf[len(block):], "content"
        if not parsed.tool_calls:
            return
        self._buf = self._buf.lstrip() if not self._buf.strip() or self._buf.startswith("\n") else self._buf

    def _step_held(self, events, final) -> None:
        if not final:
            return
        parsed = parse_tool_calls(self._buf, self.fmt, self.forced)
        self._emit_content(events, parsed.content)
        events.extend(("tool_call", c) for c in parsed.tool_calls)
        self._buf, self._state = "", "content"

    def _emit_content(self, events, text: str) -> None:
        if self._after_think and not self._seen_content:
            text = text.lstrip()
        if text.strip():
            self._seen_content = True
        events.append(("content", text))


# ---------------------------------------------------------------------------
# Constraints
# ---------------------------------------------------------------------------

def _call_schema(tool: dict, args_key: str, index: int) -> dict:
    """One call's JSON: {"name": NAME, args_key: arguments}. The parameters move under the
    wrapper's $defs (as `t{index}`), and their "#/..." references are rewritten to point
    there: references resolve against the parameters' own root, as the tool wrote them."""
    fn = tool["function"]
    params = strict_arguments(fn["parameters"])
    call = {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}
    if _has_refs(params):
        key = f"t{index}"
        call["properties"][args_key] = {"$ref": f"#/$defs/{key}"}
        call["$defs"] = {key: _rebase_refs(params, f"#/$defs/{key}")}  # hoisted to the root by _rooted
    return call


def _rooted(schema: dict, calls: list[dict]) -> dict:
    """`schema` (the JSON a grammar matches, holding the calls) with the calls' $defs at its root."""
    defs = {k: v for c in calls for k, v in c.get("$defs", {}).items()}
    return {**schema, "$defs": defs} if defs else schema


def strict_arguments(schema: Any) -> Any:
    """A tool's parameter schema as llama.cpp's tool grammars read it
    (edgeinfer.prompt.schema_rules): every object closed to its declared properties where it
    does not say `additionalProperties` (OpenAI's strict mode; no parameters at all is the
    empty object), an explicit one followed, integers at most 16 digits."""
    return schema_rules.as_llama_cpp(schema, bare_objects=True)


def _has_refs(value: Any) -> bool:
    if isinstance(value, Mapping):
        return isinstance(value.get("$ref"), str) or any(_has_refs(v) for v in value.values())
    return isinstance(value, list) and any(_has_refs(v) for v in value)


def _rebase_refs(value: Any, root: str) -> Any:
    """`value` with each local "$ref" ("#" or "#/...") pointing below `root` instead."""
    if isinstance(value, Mapping):
        out = {k: _rebase_refs(v, root) for k, v in value.items()}
        ref = value.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = root + ref[1:]
        return out
    if isinstance(value, list):
        return [_rebase_refs(v, root) for v in value]
    return value


def _token_ref(tokenizer, text: str) -> str:
    """Lark for `text`: the special token by id when the vocabulary has it, else the literal."""
    tid = tokenizer.token_id(text) if tokenizer is not None else None
    if tid is not None:
        from edgeinfer.prompt.grammar import _special

        if _special(tokenizer, tid, text.encode()):
            return f"<[{tid}]>"
    return json.dumps(text)


def select_tools(tools: list[dict], tool_choice: Any) -> tuple[str, list[dict]]:
    """("none"|"auto"|"required", the tools a call may use) from OpenAI's tool_choice."""
    if tool_choice is None or tool_choice == "auto":
        return ("auto" if tools else "none"), tools
    if tool_choice == "none":
        return "none", []
    if tool_choice == "required":
        if not tools:
            raise ToolCallError('tool_choice "required" needs tools')
        return "required", tools
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") if "function" in tool_choice else tool_choice.get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ToolCallError(f"tool_choice names {name!r}, which is not among the tools")
        return "required", chosen
    raise ToolCallError(f'tool_choice must be "none", "auto", "required" or a function, got {tool_choice!r}')


def tool_constraint(tools: Any, tool_choice: Any, fmt: str, tokenizer=None, *,
                    parallel: bool = False):
    """The grammar for a tool request, or None (unconstrained).

    "required" / a named function: the answer is one call (more with `parallel`) in the
    family's syntax, its arguments valid against the function's parameter schema, and
    nothing after it (the grammar ends: generation stops there).
    "auto": free text, and a valid call once the family's trigger appears (hermes
    `<tool_call>`, mistral `[TOOL_CALLS]`, llama3 `<|python_tag|>`), the answer's end after
    it unless `parallel`; "generic" and "harmony" answers stay unconstrained under "auto".
    "none" or no tools: None. `parallel` is false by default, as llama-server's
    `parallel_tool_calls`: a second call a small budget cuts off would end in "length".
    """
    from edgeinfer.prompt import grammar

    mode, chosen = select_tools(normalize_tools(tools), tool_choice)
    if mode == "none" or not chosen:
        return None
    if fmt == "harmony":
        return None if mode == "auto" else _harmony_call(chosen, tokenizer)
    if fmt == "gemma4":
        return _gemma4_calls(chosen, tokenizer, mode, parallel)
    args_key = "parameters" if fmt == "llama3" else "arguments"
    calls = [_call_schema(t, args_key, i) for i, t in enumerate(chosen)]
    schemas = [{k: v for k, v in c.items() if k != "$defs"} for c in calls]
    any_call = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    # %json does not get the defaults. A forced call is all the answer is: at most one space
    # or newline between its tokens (grammar.COMPACT_JSON_LAYOUT); under "auto" the call
    # follows free text the model chose to write, and keeps the pretty-printing layout.
    layout = {"x-guidance": dict(grammar.JSON_LAYOUT if mode == "auto" else grammar.COMPACT_JSON_LAYOUT)}
    array = {"type": "array", "items": any_call, "minItems": 1, **({} if parallel else {"maxItems": 1}), **layout}
    array = _rooted(array, calls)
    any_call = _rooted({**any_call, **layout}, calls)
    if mode == "auto":
        if fmt == "hermes":
            trig, body = "<tool_call>", f'"\\n" %json {json.dumps(any_call, ensure_ascii=False)} "\\n" ' \
                                        f'{_token_ref(tokenizer, "</tool_call>")}'
        elif fmt == "mistral":
            trig, body = "[TOOL_CALLS]", f"%json {json.dumps(array, ensure_ascii=False)}"
        elif fmt == "llama3":
            trig, body = "<|python_tag|>", f"%json {json.dumps(any_call, ensure_ascii=False)}"
        else:
            return None
        if tokenizer is not None and tokenizer.token_id(trig) is None and trig.startswith("<"):
            return None  # the vocabulary cannot emit the trigger as one token: leave auto free
        return grammar.lark(_free_text_then_calls(_token_ref(tokenizer, trig), body, parallel))
    call_rule = "%json " + json.dumps(any_call, ensure_ascii=False)
    if fmt == "hermes":
        open_tag, close_tag = _token_ref(tokenizer, "<tool_call>"), _token_ref(tokenizer, "</tool_call>")
        one = f'{open_tag} "\\n" {call_rule} "\\n" {close_tag}'
        sep = '"\\n"'
    elif fmt == "mistral":
        head = _token_ref(tokenizer, "[TOOL_CALLS]")
        return grammar.lark(f"start: {head} %json {json.dumps(array, ensure_ascii=False)}\n")
    elif fmt == "llama3":
        one, sep = call_rule, '"; "'
    else:
        one, sep = call_rule, '"\\n"'
    body = f"call ({sep} call)*" if parallel else "call"
    return grammar.lark(f"start: {body}\ncall: {one}\n")


def _free_text_then_calls(trigger: str, body: str, parallel: bool) -> str:
    """Lark for tool_choice "auto": free text, and after each trigger a call (`body`); with
    `parallel` false, the answer ends after its one call (llama.cpp's lazy grammar). The
    trigger and the call's closing tag are special tokens where the vocabulary has them
    (what the model emits), else text; a text trigger is matched lazily, as llguidance's
    structural tags do."""
    head = ["%llguidance {}", "start: call* TEXT" if parallel else "start: TEXT | call", "TEXT: /(.|\\n)*/"]
    if trigger.startswith("<["):
        return "\n".join(head + [f"call: TEXT {trigger} {body}"]) + "\n"
    return "\n".join(head + [f"call_trigger[lazy]: TEXT {trigger}", f"call: call_trigger {body}"]) + "\n"


def _gemma4_calls(chosen: list[dict], tokenizer, mode: str, parallel: bool):
    """Gemma 4 calls of the chosen functions (edgeinfer.prompt.gemma4_grammar): "required",
    maybe a thought, then the calls; "auto", free text until `<|tool_call>`, then a call
    (llama.cpp's lazy trigger)."""
    from edgeinfer.prompt import grammar

    from edgeinfer.prompt import gemma4_grammar

    marks = {t: _token_ref(tokenizer, t) for t in gemma4_format.MARKUP}
    try:
        body, rules = gemma4_grammar.calls_grammar(chosen, marks)
    except ValueError as e:
        raise ToolCallError(f"tools: {e}") from None
    trigger = marks[gemma4_format.CALL_OPEN]
    if mode == "auto":
        if not trigger.startswith("<["):
            return None  # the vocabulary cannot emit the trigger as one token: leave auto free
        return grammar.lark(_free_text_then_calls(trigger, body, parallel) + "\n".join(rules) + "\n")
    head = [f"start: thought? call{'+' if parallel else ''}", f"call: {trigger} {body}",
            gemma4_grammar.thought_rule(marks)]
    return grammar.lark("\n".join(head + rules) + "\n")


def _harmony_call(chosen: list[dict], tokenizer):
    """A harmony answer that is one call (generation ends at its `<|call|>`): maybe an
    analysis message first, then `<|channel|>commentary to=functions.NAME <|constrain|>json
    <|message|>` and arguments valid against NAME's schema (llama.cpp's gpt-oss grammar)."""
    from edgeinfer.prompt import grammar

    ch, msg, end, start = (_token_ref(tokenizer, t) for t in (harmony.CHANNEL, harmony.MESSAGE,
                                                                 harmony.END, harmony.START))
    constrain = _token_ref(tokenizer, harmony.CONSTRAIN)
    calls = []
    for tool in chosen:
        fn = tool["function"]
        args = {**strict_arguments(fn["parameters"]), "x-guidance": dict(grammar.COMPACT_JSON_LAYOUT)}
        calls.append(f'"commentary to=functions.{fn["name"]} " {constrain} "json" {msg} '
                     f'%json {json.dumps(args, ensure_ascii=False)}')
    return grammar.lark(f"start: analysis? call\n"
                        f'analysis: {ch} "analysis" {msg} /(.|\\n)*/ {end} {start} "assistant"\n'
                        f"call: {ch} ({' | '.join(calls)})\n")

