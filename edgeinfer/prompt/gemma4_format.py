"""Gemma 4's answer format: read its thought channel and tool calls, and shape a history for its template.

The template opens the answer with `<|turn>model\\n`; the model then writes

    <|channel>thought\\n...reasoning...<channel|>The answer.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

As llama.cpp reads it (common/parsers/gemma4.cpp, its PEG_GEMMA4 format):
- `<|channel>thought` ... `<channel|>` is reasoning; a `<|channel>` not followed by `thought`
  (an empty channel) and a stray `<channel|>` are markup, as is a leading `<|turn>model\\n`;
- `<|tool_call>call:NAME{...}<tool_call|>` is a call (when the request had tools). Its
  arguments are Gemma's notation, not JSON: `{key:value,...}` with bare keys, strings between
  `<|"|>` quote tokens, arrays `[...]`, JSON numbers, `true`, `false`, `null` (`read_value`).
  A call cut off or unreadable is dropped: its markup never reaches the content;
- everything else is content.

The markup (`MARKUP`) is control tokens; the decoder shows them as text where a request reads
this format (llama-server's preserved tokens: edgeinfer.prompt.tool_calls.markup_token_ids).

`Gemma4Stream` is incremental (push text, get ("reasoning" | "content", text) and
("tool_call", ToolCall) events); `parse` reads a whole answer through it, so both agree.
`template_messages` and `finish_prompt` are the history side, as llama.cpp's workarounds.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from edgeinfer.prompt.answer_parts import IncrementalReader, ParsedOutput, ToolCall, merge_runs, partial_suffix

TURN_MODEL = "<|turn>model\n"
CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
THOUGHT = "thought"
# the control tokens an answer's structure is written with (llama.cpp's preserved_tokens, and
# the string quote, which sits inside a call's arguments)
MARKUP = (CHANNEL_OPEN, CHANNEL_CLOSE, CALL_OPEN, CALL_CLOSE, "<|turn>", QUOTE)
_OPENAI_TOOL_MESSAGES = "{#- OpenAI Chat Completions:"  # the official template's own tool-message handling


def is_gemma4(template_source: str | None) -> bool:
    """Whether a chat template writes Gemma 4's calls (llama.cpp's test)."""
    return "'<|tool_call>call:'" in (template_source or "")


# -- argument values ------------------------------------------------------------------------------

class NotAValue(ValueError):
    """Text that is not a Gemma 4 value."""


_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORDS = {"true": True, "false": False, "null": None}
_JSON = json.JSONDecoder()
_NAME = re.compile(r"[\w.\-]+")  # a function name (no spaces, no markup)
MAX_DEPTH = 64  # nesting a call's arguments may have (deeper is not read: no unbounded recursion)


def read_value(text: str, i: int = 0, depth: int = 0) -> tuple[Any, int]:
    """The value at text[i:] (after whitespace) and the index past it; NotAValue if none."""
    if depth > MAX_DEPTH:
        raise NotAValue("nested too deeply")
    i = _skip_space(text, i)
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise NotAValue("an unclosed string")
        return text[i + len(QUOTE):end], end + len(QUOTE)
    if text.startswith('"', i):  # a JSON string: not Gemma's own, read all the same
        try:
            return _JSON.raw_decode(text, i)
        except ValueError:
            raise NotAValue("a bad JSON string") from None
    if text.startswith("{", i):
        return _read_dict(text, i + 1, depth)
    if text.startswith("[", i):
        return _read_list(text, i + 1, depth)
    for word, value in _WORDS.items():
        if text.startswith(word, i):
            return value, i + len(word)
    m = _NUMBER.match(text, i)
    if m is None:
        raise NotAValue(f"no value at {text[i:i + 20]!r}")
    return json.loads(m.group()), m.end()


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _after_member(text: str, i: int, close: str, what: str) -> tuple[bool, int]:
    """After an object's or array's member: (True, past `close`) at its end, (False, past
    the comma) before the next member."""
    i = _skip_space(text, i)
    if text.startswith(",", i):
        return False, i + 1
    if text.startswith(close, i):
        return True, i + 1
    raise NotAValue(f"an unclosed {what}")


def _read_dict(text: str, i: int, depth: int) -> tuple[dict, int]:
    out: dict[str, Any] = {}
    i = _skip_space(text, i)
    if text.startswith("}", i):
        return out, i + 1
    while True:
        i = _skip_space(text, i)
        if text.startswith(QUOTE, i):  # a quoted key (the template's escape_keys form)
            key, i = read_value(text, i, depth + 1)
            i = _skip_space(text, i)
        else:
            end = i
            while end < len(text) and text[end] not in ":}":
                end += 1
            key, i = text[i:end].strip(), end
            if not key:
                raise NotAValue("an empty key")
        if not text.startswith(":", i):
            raise NotAValue(f"no ':' after the key {key!r}")
        out[key], i = read_value(text, i + 1, depth + 1)
        done, i = _after_member(text, i, "}", "object")
        if done:
            return out, i


def _read_list(text: str, i: int, depth: int) -> tuple[list, int]:
    out: list[Any] = []
    i = _skip_space(text, i)
    if text.startswith("]", i):
        return out, i + 1
    while True:
        value, i = read_value(text, i, depth + 1)
        out.append(value)
        done, i = _after_member(text, i, "]", "array")
        if done:
            return out, i


def read_call(body: str) -> ToolCall | None:
    """`call:NAME{...}` (a call's text between its markers) as a ToolCall, or None."""
    body = body.strip()
    if not body.startswith("call:"):
        return None
    brace = body.find("{")
    name = body[len("call:"):brace].strip() if brace > 0 else ""
    if not _NAME.fullmatch(name):
        return None
    try:
        args, end = read_value(body, brace)
    except NotAValue:
        return None
    if not isinstance(args, dict) or body[end:].strip():
        return None
    return ToolCall(name, args)


# -- the stream -----------------------------------------------------------------------------------

class Gemma4Stream(IncrementalReader):
    """Incremental Gemma 4 reader: `push(text)` and `flush()` return events, ("reasoning", text),
    ("content", text) or ("tool_call", ToolCall). `tools`: whether calls are read (otherwise
    their text is content). Text that may still be markup is held until it is known."""

    def __init__(self, *, tools: bool = True) -> None:
        self.tools = tools
        self._buf = ""
        self._state = "start"  # start, content, channel, thought_start, thought, call
        self._calls_read = False  # a call was read (a tag cut off after it is markup)

    def _step(self, events, final: bool) -> None:
        getattr(self, "_step_" + self._state)(events, final)

    def _events(self, events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return merge_runs(events)

    def _step_start(self, events, final: bool) -> None:
        if self._buf.startswith(TURN_MODEL):  # the generation prompt, written again
            self._buf = self._buf[len(TURN_MODEL):]
            self._state = "content"
        elif final or not TURN_MODEL.startswith(self._buf):
            self._state = "content"

    def _step_content(self, events, final: bool) -> None:
        tags = (CHANNEL_OPEN, CHANNEL_CLOSE) + ((CALL_OPEN,) if self.tools else ())
        found = min(((self._buf.find(t), t) for t in tags if t in self._buf), default=None)
        if found is None:
            keep = 0 if final else partial_suffix(self._buf, tags)
            cut = partial_suffix(self._buf.rstrip(), tags) if final and self._calls_read else 0
            if cut:  # a next tag cut off (max_tokens) after a call: markup, not content
                self._buf = self._buf.rstrip()[:-cut]
            events.append(("content", self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
            return
        at, tag = found
        events.append(("content", self._buf[:at]))
        self._buf = self._buf[at + len(tag):]
        self._state = {CHANNEL_OPEN: "channel", CALL_OPEN: "call"}.get(tag, "content")  # a stray close: dropped

    def _step_channel(self, events, final: bool) -> None:
        """After `<|channel>`: a thought, or an empty channel (markup only)."""
        if self._buf.startswith(THOUGHT):
            self._buf = self._buf[len(THOUGHT):]
            self._state = "thought_start"
        elif final or not THOUGHT.startswith(self._buf):
            self._state = "content"

    def _step_thought_start(self, events, final: bool) -> None:
        """The whitespace after `thought` (the template writes a newline) is not reasoning."""
        self._buf = self._buf.lstrip(" \t\r\n")
        if self._buf or final:
            self._state = "thought"

    def _step_thought(self, events, final: bool) -> None:
        at = self._buf.find(CHANNEL_CLOSE)
        if at < 0:  # hold back what may be the close, and trailing whitespace (it may end the thought)
            keep = 0 if final else partial_suffix(self._buf, (CHANNEL_CLOSE,))
            text = self._buf[:len(self._buf) - keep]
            shown = text if final else text.rstrip(" \t\r\n")
            events.append(("reasoning", shown))
            self._buf = self._buf[len(shown):]
            return
        events.append(("reasoning", self._buf[:at].rstrip(" \t\r\n")))
        self._buf = self._buf[at + len(CHANNEL_CLOSE):]
        self._state = "content"

    def _step_call(self, events, final: bool) -> None:
        at = self._buf.find(CALL_CLOSE)
        if at < 0:
            if final:  # cut off: dropped (the finish reason says why)
                self._buf, self._state = "", "content"
            return
        call = read_call(self._buf[:at])
        if call is not None:
            self._calls_read = True
            events.append(("tool_call", call))
        self._buf = self._buf[at + len(CALL_CLOSE):]
        self._state = "content"


def parse(text: str, *, tools: bool = True) -> ParsedOutput:
    """A whole answer: content (trimmed), tool calls and reasoning (None when it had none)."""
    stream = Gemma4Stream(tools=tools)
    events = stream.push(text) + stream.flush()
    reasoning = [v for k, v in events if k == "reasoning"]
    content = "".join(v for k, v in events if k == "content")
    structured = any(k != "content" for k, _ in events)  # content beside thoughts and calls: trimmed
    return ParsedOutput(content.strip() if structured else content, [v for k, v in events if k == "tool_call"],
                        "".join(reasoning).strip() if reasoning else None)


# -- history --------------------------------------------------------------------------------------

_THINK_BLOCK = re.compile(r"\s*<think>(.*?)</think>\s*", re.S)


def template_messages(messages: Sequence[Mapping[str, Any]], template_source: str) -> list[dict]:
    """Messages as a Gemma 4 template reads them: an assistant's leading `<think>` block (how
    `edgeinfer run` and the TUI keep an answer) as `reasoning_content`; and, for a template
    older than the official one (no OpenAI tool-message handling), each assistant's calls,
    the tool results after them and the answer that follows folded into one assistant
    message with `tool_responses`, as llama.cpp's convert_tool_responses_gemma4 does."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if m.get("role") == "assistant" and isinstance(content, str) and "reasoning_content" not in m:
            block = _THINK_BLOCK.match(content)
            if block is not None:
                m["reasoning_content"], m["content"] = block.group(1).strip(), content[block.end():]
        out.append(m)
    if _OPENAI_TOOL_MESSAGES in template_source:
        return out
    return _fold_tool_responses(out)


def _fold_tool_responses(messages: list[dict]) -> list[dict]:
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        calls = list(m["tool_calls"])
        turn: dict = {"role": "assistant", "tool_calls": calls}
        if isinstance(m.get("reasoning_content"), str):
            turn["reasoning_content"] = m["reasoning_content"]
        responses = []
        i += 1
        while i < len(messages) and messages[i].get("role") == "tool":
            responses.append(_tool_response(messages[i], calls, len(responses)))
            i += 1
        if i < len(messages) and messages[i].get("role") == "assistant" and not messages[i].get("tool_calls") \
                and messages[i].get("content"):
            turn["content"] = messages[i]["content"]
            i += 1
        if responses:
            turn["tool_responses"] = responses
        out.append(turn)
    return out


def _tool_response(message: Mapping[str, Any], calls: list, index: int) -> dict:
    """{"name", "response"}: the result of the index-th call (its JSON read when it is JSON)."""
    body = message.get("content")
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            pass
    name = ""
    if index < len(calls):
        name = ((calls[index] or {}).get("function") or {}).get("name") or ""
    return {"name": name or message.get("tool_call_id") or message.get("name") or "", "response": body}


def finish_prompt(prompt: str, add_generation_prompt: bool) -> str:
    """The prompt with the model's turn opened where the template left it closed (after an
    assistant message with content and calls it writes no next turn; llama.cpp adds it)."""
    if add_generation_prompt and prompt.endswith("<turn|>\n"):
        return prompt + TURN_MODEL
    return prompt
