"""A chat answer's text as each dialect shows it: content, tool calls and reasoning, whole or streamed.

The model writes one text; when the request had tools, or the template thinks (Qwen 3's
`<think>...</think>`), or speaks harmony (gpt-oss's channels: analysis is the reasoning,
final the content, `to=functions.NAME` a call), an `OutputReader` splits it with
edgeinfer.prompt.tool_calls (and edgeinfer.prompt.harmony):

- OpenAI: `message.content` (null when the answer is only calls), `message.tool_calls`
  ([{id, type: "function", function: {name, arguments: JSON text}}]) with finish_reason
  "tool_calls", and llama-server's `message.reasoning_content`; streamed, `delta.content`,
  `delta.reasoning_content` and `delta.tool_calls` (a call's first delta has its index, id,
  type, name and arguments "", the next its index and the arguments), as the official
  openai client accumulates them;
- Ollama: `message.content`, `message.thinking` and `message.tool_calls`
  ([{function: {name, arguments: object}}]), streamed as they complete.

Text that is not a call stays content, but call markup never does: a call cut off by
max_tokens (the finish_reason says "length") or unreadable is dropped, and so is everything
that is not a call when the request forced one (tool_choice "required" or a function).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from edgeinfer.server.constraints import channel_format, speaks_harmony, thinks
from edgeinfer.prompt.tool_calls import ParsedOutput, ToolCallStream, answer_stream, parse_output


@dataclass(frozen=True)
class OutputReader:
    """How to read one request's answers: `fmt` the model's tool-call family, `tools` whether
    calls are looked for, `reasoning` whether a `<think>` block is split out, `think_started`
    whether the prompt already opened it."""

    fmt: str
    tools: bool
    reasoning: bool
    think_started: bool = False
    forced: bool = False  # the request forced a call: nothing but calls could be written

    def parse(self, text: str) -> ParsedOutput:
        return parse_output(text, self.fmt, reasoning=self.reasoning, think_started=self.think_started,
                            tools=self.tools, forced=self.forced)

    def stream(self) -> ToolCallStream:
        return answer_stream(self.fmt, reasoning=self.reasoning, think_started=self.think_started,
                             tools=self.tools, forced=self.forced)


def reader_for(model, *, tools: bool, thinking: bool | None = None, forced: bool = False) -> OutputReader | None:
    """The reader for a chat request (None: the text is all content). A harmony or Gemma 4
    answer is always read: its channels are structure, never content."""
    channels = channel_format(model)
    if channels is not None:  # harmony, Gemma 4: channels are structure, never content
        return OutputReader(channels, tools, True, forced=tools and forced)
    reasoning = thinks(model) and thinking is not False
    if not tools and not reasoning:
        return None
    return OutputReader(model.tool_format, tools, reasoning,
                        reasoning and _prompt_opens_think(model, thinking), tools and forced)


_opens: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_opens_lock = threading.Lock()


def _prompt_opens_think(model, thinking: bool | None) -> bool:
    """Whether the template's generation prompt ends inside `<think>` (QwQ, R1, Qwen3
    thinking-2507): the answer then begins with reasoning and no opening tag."""
    template = model.template
    with _opens_lock:
        known = _opens.setdefault(template, {})
        if thinking in known:
            return known[thinking]
    kwargs = {} if thinking is None else {"enable_thinking": bool(thinking)}
    try:
        text = template.render_prompt([{"role": "user", "content": "x"}], add_bos=False,
                                      add_generation_prompt=True, **kwargs)
    except Exception:  # noqa: BLE001 - a template that cannot render this fails the request later
        text = ""
    opens = text.rstrip().endswith("<think>")
    with _opens_lock:
        _opens[template][thinking] = opens
    return opens


# -- OpenAI -----------------------------------------------------------------------------------

def openai_message(reader: OutputReader | None, text: str, finish: str) -> tuple[dict, str]:
    """A whole answer's `message` and its finish_reason ("tool_calls" when it made calls)."""
    if reader is None:
        return {"role": "assistant", "content": text}, finish
    p = reader.parse(text)
    msg: dict = {"role": "assistant", "content": p.content if p.content or not p.tool_calls else None}
    if p.reasoning is not None:
        msg["reasoning_content"] = p.reasoning
    if p.tool_calls:
        msg["tool_calls"] = [c.openai() for c in p.tool_calls]
        if finish == "stop":
            finish = "tool_calls"
    return msg, finish


class OpenAIDeltas:
    """Streamed deltas, per choice: `push(index, text)` and `finish(index)` return the
    `delta` objects to send; `finish_reason(index, reason)` says "tool_calls" after calls."""

    def __init__(self, reader: OutputReader) -> None:
        self.reader = reader
        self._streams: dict[int, ToolCallStream] = {}
        self._calls: dict[int, int] = {}

    def push(self, index: int, text: str) -> list[dict]:
        if index not in self._streams:
            self._streams[index], self._calls[index] = self.reader.stream(), 0
        return self._deltas(index, self._streams[index].push(text)) if text else []

    def finish(self, index: int) -> list[dict]:
        stream = self._streams.get(index)
        return self._deltas(index, stream.flush()) if stream is not None else []

    def finish_reason(self, index: int, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self._calls.get(index) else reason

    def _deltas(self, index: int, events: list) -> list[dict]:
        out: list[dict] = []
        for kind, value in events:
            if kind == "tool_call":
                k = self._calls[index]
                self._calls[index] = k + 1
                out.append({"tool_calls": [{"index": k, "id": value.id, "type": "function",
                                            "function": {"name": value.name, "arguments": ""}}]})
                out.append({"tool_calls": [{"index": k, "function": {"arguments": value.arguments_json}}]})
                continue
            key = "reasoning_content" if kind == "reasoning" else "content"
            if out and set(out[-1]) == {key}:
                out[-1][key] += value  # one delta for a run of the same kind
            else:
                out.append({key: value})
        return out


# -- Ollama -----------------------------------------------------------------------------------

def ollama_message(reader: OutputReader | None, text: str) -> dict:
    """A whole answer's Ollama `message`."""
    if reader is None:
        return {"role": "assistant", "content": text}
    p = reader.parse(text)
    msg: dict = {"role": "assistant", "content": p.content}
    if p.reasoning is not None:
        msg["thinking"] = p.reasoning
    if p.tool_calls:
        msg["tool_calls"] = [c.ollama() for c in p.tool_calls]
    return msg


class OllamaPieces:
    """Streamed Ollama messages: `push(text)` and `finish()` return the `message` objects
    of the lines to send (content, thinking, or a completed call each)."""

    def __init__(self, reader: OutputReader) -> None:
        self._stream = reader.stream()

    def push(self, text: str) -> list[dict]:
        return self._messages(self._stream.push(text)) if text else []

    def finish(self) -> list[dict]:
        return self._messages(self._stream.flush())

    @staticmethod
    def _messages(events: list) -> list[dict]:
        out: list[dict] = []
        for kind, value in events:
            if kind == "tool_call":
                out.append({"role": "assistant", "content": "", "tool_calls": [value.ollama()]})
            elif kind == "reasoning":
                out.append({"role": "assistant", "content": "", "thinking": value})
            else:
                out.append({"role": "assistant", "content": value})
        return out


# -- requests ---------------------------------------------------------------------------------

def chat_plan(model, messages: list[dict], *, tools: list | None = None, tool_choice: Any = None,
              parallel_tool_calls: bool | None = None, think: bool | None = None,
              effort: str | None = None, effort_field: str = "reasoning_effort",
              constraint=None, default_think: bool | None = None) -> tuple[dict, OutputReader | None]:
    """The Model.chat keywords for a chat request's tools, thinking switch, reasoning effort
    and constraint (checked: 400s name the field), and the reader for its answers. `think`
    false on a harmony model comes from chat_template_kwargs (Ollama's is checked before).
    `default_think` (serve --reasoning on/off) applies where neither the request nor a
    /think or /no_think in it says."""
    from edgeinfer.server.constraints import effort_keywords, harmony_think, thinking_switch, tool_keywords

    kw = tool_keywords(model, tools, tool_choice, parallel_tool_calls)
    kw.update(effort_keywords(model, effort, effort_field))
    harmony_think(model, think, "chat_template_kwargs.enable_thinking")
    # harmony has no switch, so neither the request's nor Qwen's /no_think applies
    thinking = thinking_switch(messages, think) if thinks(model) and not speaks_harmony(model) else None
    if thinking is None and thinks(model) and not speaks_harmony(model):
        thinking = default_think
    if thinking is not None:
        kw["enable_thinking"] = thinking
    if constraint is not None:
        kw["constraint"] = constraint
    calls = bool(kw.get("tools")) and kw.get("tool_choice") != "none"
    forced = kw.get("tool_choice") == "required" or isinstance(kw.get("tool_choice"), dict)
    return kw, reader_for(model, tools=calls, thinking=thinking, forced=forced)


def ollama_history(messages) -> list[dict]:
    """Ollama messages (OllamaMessage) as the template reads them: an assistant's
    `thinking` as `reasoning_content`, its `tool_calls`, a tool message's `tool_name` as `name`."""
    out = []
    for m in messages:
        d: dict = {"role": m.role, "content": m.content}
        if m.thinking:
            d["reasoning_content"] = m.thinking
        if m.tool_calls:
            d["tool_calls"] = [{"type": "function", **({"id": c.id} if c.id else {}),
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in m.tool_calls]
        if m.tool_name:
            d["name"] = m.tool_name
        out.append(d)
    return out
