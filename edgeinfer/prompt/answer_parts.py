"""What a chat answer is read into: its tool calls (`ToolCall`) and its parts (`ParsedOutput`).

Kept apart from the parsers (edgeinfer.prompt.tool_calls, edgeinfer.prompt.harmony) so each
can build them without importing the other.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    @property
    def arguments_json(self) -> str:
        """OpenAI's `function.arguments` (a JSON string)."""
        return json.dumps(self.arguments, ensure_ascii=False)

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function",
             "function": {"name": self.name, "arguments": self.arguments_json}}
        if index is not None:
            d["index"] = index
        return d

    def ollama(self) -> dict:
        return {"function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall]
    reasoning: str | None = None


def partial_suffix(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`: text a
    streaming reader holds back until it knows whether a tag begins there."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if tag.startswith(text[-k:]):
                best = k
                break
    return best


def merge_runs(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Reader events with each run of text of one kind joined into one event and empty text
    dropped; every tool call stays its own event."""
    out: list[tuple[str, Any]] = []
    for kind, value in events:
        if kind != "tool_call" and not value:
            continue
        if out and kind != "tool_call" and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


class IncrementalReader:
    """The skeleton of a streamed answer's reader (edgeinfer.prompt.tool_calls.ToolCallStream,
    edgeinfer.prompt.harmony.HarmonyStream): `push(text)` and `flush()` run the reader's state
    machine until it makes no more progress and return its events. A subclass keeps `_buf` and
    `_state`, takes one step in `_step(events, final)` and shapes what it returns in
    `_events(events)`."""

    _buf: str
    _state: str

    def push(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        return self._drain(final=False)

    def flush(self) -> list[tuple[str, Any]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        while True:
            before = (self._state, len(self._buf))
            self._step(events, final)
            if (self._state, len(self._buf)) == before:
                break
        return self._events(events)

    def _step(self, events: list, final: bool) -> None:
        raise NotImplementedError

    def _events(self, events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        raise NotImplementedError


class CallAnswerStream:
    """A family's stream reader (push / flush, as IncrementalReader) whose content events read
    as the whole answer's parse does around calls: whitespace next to a call (the "\\n"
    between two calls) is never content, and under a forced call (`forced`: the grammar
    allowed nothing but calls) no text is. Whitespace is held until text follows it;
    what is still held at the end is dropped after a call and shown otherwise."""

    def __init__(self, inner, *, forced: bool = False) -> None:
        self._inner, self._forced = inner, forced
        self._held = ""      # whitespace-only content not yet shown
        self._calls = False  # a call was read

    def push(self, text: str) -> list[tuple[str, Any]]:
        return self._shaped(self._inner.push(text), final=False)

    def flush(self) -> list[tuple[str, Any]]:
        return self._shaped(self._inner.flush(), final=True)

    def _shaped(self, events: list[tuple[str, Any]], final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for kind, value in events:
            if kind == "tool_call":
                self._held, self._calls = "", True
                out.append((kind, value))
            elif kind != "content":
                out.append((kind, value))
            elif self._forced:
                continue
            elif not value.strip():
                self._held += value
            else:
                out.append((kind, self._held + value))
                self._held = ""
        if final and self._held and not self._calls:
            out.append(("content", self._held))
        if final:
            self._held = ""
        return merge_runs(out)
