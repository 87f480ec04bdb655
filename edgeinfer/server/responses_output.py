"""A Responses API answer, built chunk by chunk: its output items and the stream events that make them.

The model's text goes through the request's reader (edgeinfer.server.tool_output: reasoning,
content and calls, as /v1/chat/completions splits them) and becomes, in order:
- `reasoning` items ({id "rs_...", summary [], content [{type reasoning_text, text}]}),
  streamed as content_part.added / response.reasoning_text.delta / .done / content_part.done;
- `message` items ({id "msg_...", role assistant, status, content [{type output_text, text,
  annotations []}]}), streamed as content_part.added / response.output_text.delta / .done /
  content_part.done;
- `function_call` items ({id "fc_...", call_id, name, arguments, status}), streamed as
  response.function_call_arguments.delta / .done;
each between response.output_item.added and response.output_item.done. A whole answer is
built the same way (its events dropped), so streamed and whole answers are the same items.
Read text is trimmed as parse_output trims it: an item's leading and trailing whitespace is
held back and dropped.
"""

from __future__ import annotations

import copy
import secrets

from edgeinfer.results import GenerationChunk
from edgeinfer.server.tool_output import OutputReader


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class Output:
    """`push(chunk)` and `finish(incomplete)` return the events (dicts with `type`, without
    `sequence_number`); `items` is the output. `sealed` writes each reasoning item's
    `encrypted_content` (include: ["reasoning.encrypted_content"])."""

    def __init__(self, reader: OutputReader | None, sealed=None) -> None:
        self._stream = reader.stream() if reader is not None else None
        self._sealed = sealed
        self.items: list[dict] = []
        self._open: dict | None = None   # the message or reasoning item being written
        self._held = ""                  # its trailing whitespace, until more text comes
        self.tokens = 0
        self.reasoning_tokens = 0

    def push(self, chunk: GenerationChunk) -> list[dict]:
        if chunk.token is not None and chunk.finish_reason is None:
            self.tokens += 1
        if not chunk.text:
            return []
        if self._stream is None:
            return self._text("message", chunk.text)
        return self._apply(self._stream.push(chunk.text))

    def finish(self, incomplete: bool) -> list[dict]:
        """The last events: the reader's rest, the open item closed (incomplete when the
        answer was cut off), and an empty message when there was no output at all."""
        out = self._apply(self._stream.flush()) if self._stream is not None else []
        out += self._close("incomplete" if incomplete else "completed")
        if not self.items:
            out += self._begin("message")
            out += self._close("incomplete" if incomplete else "completed")
        return out

    # -- internals ------------------------------------------------------------------------------
    def _apply(self, events: list) -> list[dict]:
        out: list[dict] = []
        for kind, value in events:
            if kind == "tool_call":
                out += self._close("completed") + self._call(value)
            elif kind == "reasoning":
                self.reasoning_tokens = self.tokens  # the reasoning goes on to this token
                out += self._text("reasoning", value)
            else:
                out += self._text("message", value)
        return out

    def _text(self, kind: str, text: str) -> list[dict]:
        out: list[dict] = []
        trail = ""
        if self._stream is not None:  # trimmed, as parse_output trims
            text = self._held + text if self._is_open(kind) else text.lstrip()
            body = text.rstrip()
            text, trail = body, text[len(body):]
            if not text and self._is_open(kind):
                self._held = trail
        if not text:
            return out
        if not self._is_open(kind):
            out += self._close("completed") + self._begin(kind)
        self._held = trail
        item = self._open
        part = item["content"][0]
        part["text"] += text
        index = len(self.items) - 1
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append({"type": event, "item_id": item["id"], "output_index": index, "content_index": 0,
                    "delta": text, **extra})
        return out

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _begin(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open, self._held = item, ""
        index = len(self.items) - 1
        added = {"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(item)}
        item["content"].append(part)
        return [added, {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": dict(part)}]

    def _close(self, status: str) -> list[dict]:
        item, self._open, self._held = self._open, None, ""
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        part = item["content"][0]
        head = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            done = {"type": "response.output_text.done", **head, "text": part["text"], "logprobs": []}
        else:
            done = {"type": "response.reasoning_text.done", **head, "text": part["text"]}
            if self._sealed is not None:
                item["encrypted_content"] = self._sealed(part["text"])
        return [done, {"type": "response.content_part.done", **head, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]

    def _call(self, call) -> list[dict]:
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        self.items.append(item)
        index = len(self.items) - 1
        out = [{"type": "response.output_item.added", "output_index": index, "item": dict(item)}]
        item["arguments"], item["status"] = call.arguments_json, "completed"
        head = {"item_id": item["id"], "output_index": index}
        return out + [{"type": "response.function_call_arguments.delta", **head, "delta": item["arguments"]},
                      {"type": "response.function_call_arguments.done", **head, "name": call.name,
                       "arguments": item["arguments"]},
                      {"type": "response.output_item.done", "output_index": index, "item": dict(item)}]


def usage_of(last: GenerationChunk, reasoning_tokens: int) -> dict:
    """The Responses API's `usage`: prompt tokens (those the prefix cache served, those
    evaluated now and kept), output tokens (those up to the end of the reasoning)."""
    u = last.usage
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                     "cache_write_tokens": u.prompt_tokens - u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, u.completion_tokens)},
            "total_tokens": u.total_tokens}
