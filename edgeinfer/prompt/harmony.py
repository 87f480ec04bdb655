"""OpenAI's harmony format (gpt-oss): read an answer's channels, and hand a history back to its template.

The template primes the answer with `<|start|>assistant`; the model then writes messages

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{"a": 1}<|call|>

A header (everything before `<|message|>`) names the channel, maybe a recipient (`to=`, before
or after the channel) and a content type (`<|constrain|>json` or a bare `json`); the body runs
to `<|end|>`, `<|return|>` or `<|call|>` (the last two end generation: they are EOG tokens and
seldom reach the text) or to the next `<|start|>`. As llama.cpp's parser (common/parsers/gpt-oss.cpp):

- analysis -> reasoning; final, and commentary without a recipient (a preamble) -> content;
- `to=functions.NAME` (on commentary or analysis) -> a tool call, its body the JSON arguments;
- a stray `<|channel|>commentary to=assistant` before the real channel is skipped (the last
  channel of a header wins).

Unlike llama.cpp, nothing the model wrote is dropped: a call that is not readable (arguments
that are not a JSON object, a recipient that is not `functions.*` such as the built-in
`python`, or any call when the request had no tools) stays content as it was written, and text
without a header (a model that ignores the format) is content. Only an unfinished header at
the very end (structure cut off by max_tokens, no message text) is left out.

`HarmonyStream` is incremental (push text, get ("reasoning" | "content", text) and
("tool_call", ToolCall) events, as edgeinfer.prompt.tool_calls.ToolCallStream); `parse` reads
a whole answer through it, so both always agree.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from edgeinfer.prompt.answer_parts import IncrementalReader, ParsedOutput, ToolCall, merge_runs, partial_suffix

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
# where a body ends: its own end, or the next message's start when the model skipped `<|end|>`
_BODY_ENDS = (END, RETURN, CALL, START)
_HEADER_MAX = 512  # a header longer than this is not one: its text is content
_HEAD_PART = re.compile(r"\s*(<\|start\|>|<\|channel\|>|<\|constrain\|>|to=[^\s<]+|[^\s<]+)")


def is_harmony(template_source: str | None) -> bool:
    """Whether a chat template speaks harmony (llama.cpp's test: it writes `<|channel|>`)."""
    return CHANNEL in (template_source or "")


# -- headers --------------------------------------------------------------------------------------

class _Header:
    """A message header read: its channel, recipient and content type (None when absent)."""

    def __init__(self) -> None:
        self.channel: str | None = None
        self.recipient: str | None = None
        self.ctype: str | None = None


def _read_header(text: str, complete: bool) -> _Header | None:
    """The header `text` (what precedes `<|message|>`), or None when it is not a header.
    `complete=False` checks a header still being written (it may lack its channel yet)."""
    pos, parts = 0, []
    while pos < len(text):
        m = _HEAD_PART.match(text, pos)
        if m is None:
            if text[pos:].strip():
                return None  # a lone "<" or other text a header never holds
            break
        parts.append(m.group(1))
        pos = m.end()
    head, i = _Header(), 0
    if parts[:1] == [START]:
        i = 1
        if i < len(parts) and parts[i] not in (CHANNEL, CONSTRAIN) and not parts[i].startswith("to="):
            i += 1  # the role ("assistant")
    if i < len(parts) and parts[i] != CHANNEL and not parts[i].startswith("to="):
        return None  # a header opens with its channel or its recipient
    expect = None  # what the previous special token names next
    for part in parts[i:]:
        if expect is not None:
            if part in (START, CHANNEL, CONSTRAIN) or part.startswith("to="):
                return None
            if expect == "channel":
                head.channel = part  # the last wins: a stray "commentary to=assistant" comes first
            else:
                head.ctype = part
            expect = None
        elif part == CHANNEL:
            expect = "channel"
        elif part == CONSTRAIN:
            expect = "ctype"
        elif part == START:
            return None
        elif part.startswith("to="):
            if part != "to=assistant":  # addressed back to the assistant: no recipient
                head.recipient = part[3:]
        elif head.channel is not None:
            head.ctype = part  # a bare content type ("commentary json", as the template writes)
        else:
            return None
    if complete and (head.channel is None or expect is not None):
        return None
    return head


# -- the stream -----------------------------------------------------------------------------------

class HarmonyStream(IncrementalReader):
    """Incremental harmony reader: `push(text)` and `flush()` return events, ("reasoning", text),
    ("content", text) or ("tool_call", ToolCall). `tools`: whether `to=functions.*` messages
    are read as calls (otherwise they stay content). Text that may still be a header or the
    start of a body's end is held until it is known."""

    def __init__(self, *, tools: bool = True) -> None:
        self.tools = tools
        self._buf = ""
        self._state = "header"   # header, reasoning, content, call
        self._head_text = ""     # a call's header as written (content again if the call is unreadable)
        self._name = ""          # the called function

    def _step(self, events, final: bool) -> None:
        if self._state == "header":
            self._step_header(events, final)
        else:
            self._step_body(events, final)

    def _events(self, events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return merge_runs(events)

    def _step_header(self, events, final: bool) -> None:
        if not self._buf:
            return
        at = self._buf.find(MESSAGE)
        if at >= 0 and at <= _HEADER_MAX:
            head = _read_header(self._buf[:at], complete=True)
            if head is None:
                self._not_a_header(events)
                return
            written, self._buf = self._buf[:at + len(MESSAGE)], self._buf[at + len(MESSAGE):]
            self._open(head, written, events)
            return
        cut = len(self._buf) - partial_suffix(self._buf, (MESSAGE, START, CHANNEL, CONSTRAIN, "to="))
        maybe = len(self._buf) <= _HEADER_MAX and _read_header(self._buf[:cut], complete=False) is not None
        if not maybe:
            self._not_a_header(events)
        elif final:
            self._buf = ""  # an unfinished header: structure only, no message text
            self._state = "content"

    def _not_a_header(self, events) -> None:
        """The text is content as written; a `<|start|>` it opens with goes with it (else the
        body would end right there and hand the same text back to the header)."""
        lead = len(self._buf) - len(self._buf.lstrip())
        if self._buf.startswith(START, lead):
            n = lead + len(START)
            events.append(("content", self._buf[:n]))
            self._buf = self._buf[n:]
        self._state = "content"

    def _open(self, head: _Header, written: str, events) -> None:
        recipient = head.recipient
        if recipient is None:
            self._state = "reasoning" if head.channel == "analysis" else "content"
        elif self.tools and recipient.startswith("functions.") and len(recipient) > len("functions."):
            self._state, self._name, self._head_text = "call", recipient[len("functions."):], written
        else:  # a built-in tool (python, browser) or no tools asked for: content as written
            events.append(("content", written))
            self._state = "content"

    def _step_body(self, events, final: bool) -> None:
        ends = [(self._buf.find(t), t) for t in _BODY_ENDS]
        found = min(((i, t) for i, t in ends if i >= 0), default=None)
        if found is None and not final:
            if self._state != "call":
                keep = partial_suffix(self._buf, _BODY_ENDS)
                self._emit(events, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
            return  # a call's arguments are read whole
        at, tag = found if found is not None else (len(self._buf), "")
        self._emit(events, self._buf[:at])
        self._buf = self._buf[at + (0 if tag == START else len(tag)):]  # <|start|> opens the next header
        self._state = "header"

    def _emit(self, events, text: str) -> None:
        if self._state == "call":
            call = _call(self._name, text)
            if call is not None:
                events.append(("tool_call", call))
            else:
                events.append(("content", self._head_text + text))
            self._head_text = ""
            return
        events.append(("reasoning" if self._state == "reasoning" else "content", text))


def _call(name: str, body: str) -> ToolCall | None:
    """The call of `name` with the JSON object `body`, or None when it is not one."""
    try:
        args = json.loads(body)
    except ValueError:
        return None
    return ToolCall(name, args) if isinstance(args, dict) else None


def parse(text: str, *, tools: bool = True) -> ParsedOutput:
    """A whole answer: content, tool calls and reasoning (None when it had no analysis)."""
    stream = HarmonyStream(tools=tools)
    events = stream.push(text) + stream.flush()
    reasoning = [v for k, v in events if k == "reasoning"]
    return ParsedOutput("".join(v for k, v in events if k == "content"),
                        [v for k, v in events if k == "tool_call"],
                        "".join(reasoning) if reasoning else None)


# -- history --------------------------------------------------------------------------------------

_THINK_BLOCK = re.compile(r"\s*<think>(.*?)</think>\s*", re.S)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Messages as the gpt-oss template reads them: an assistant's reasoning in `thinking`
    (from `reasoning_content`, which the server passes, or from a leading `<think>` block,
    which is how `edgeinfer run` and the TUI keep an answer), and, as llama.cpp does, no
    `content` beside reasoning and tool calls (the template refuses both)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant":
            content = m.get("content")
            if isinstance(content, str) and "thinking" not in m and "reasoning_content" not in m:
                block = _THINK_BLOCK.match(content)
                if block is not None:
                    m["reasoning_content"], m["content"] = block.group(1).strip(), content[block.end():]
            if isinstance(m.get("reasoning_content"), str):
                m["thinking"] = m.pop("reasoning_content")
                if m.get("tool_calls"):
                    m.pop("content", None)
        out.append(m)
    return out
