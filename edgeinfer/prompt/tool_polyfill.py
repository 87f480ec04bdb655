"""Tools for a chat template that does not render them (Gemma 3, most base templates), as
llama-server's minja polyfill does: the tools are described in the system message, an
assistant's calls are written as the JSON the "generic" format reads back
(edgeinfer.prompt.tool_calls.parse_tool_calls), and each tool result is a user turn of JSON.
Consecutive turns of one role are merged, so templates that insist on alternating user and
assistant turns render the history.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

INTRO = "You can call any of the following tools to satisfy the user's requests:"
SYNTAX = ('To call a tool, answer with only a JSON object: {"name": "<tool name>", "arguments": {<its arguments>}} '
          "(several calls: one object a line). A tool's result comes back as "
          '{"tool_response": {"name": ..., "content": ...}}.')


def needs_polyfill(messages: Sequence[Mapping[str, Any]], tools: Sequence | None) -> bool:
    """Whether there are tools, calls or tool results to write for a template without tools."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    listed = [t["function"] for t in tools]
    return f"{INTRO}\n{json.dumps(listed, indent=2, ensure_ascii=False)}\n\n{SYNTAX}"


def _content(m: Mapping[str, Any]) -> str:
    c = m.get("content")
    return c if isinstance(c, str) else "" if c is None else json.dumps(c, ensure_ascii=False)


def _call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    return json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})}, ensure_ascii=False)


def polyfilled(messages: Sequence[Mapping[str, Any]], tools: Sequence | None) -> list[dict]:
    """The history with tools, calls and results written as text (`tools` normalized)."""
    out: list[dict] = []

    def add(m: Mapping[str, Any], text: str) -> None:
        last = out[-1] if out else None
        if last is not None and last["role"] == m["role"] and isinstance(last["content"], str):
            last["content"] = f"{last['content']}\n\n{text}" if last["content"] else text
        else:
            out.append({**{k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name",
                                                                     "tool_name")}, "content": text})

    rest = list(messages)
    if tools:
        first = rest[0] if rest and rest[0].get("role") == "system" and isinstance(rest[0].get("content"), str) \
            else None
        if first is not None:
            rest.pop(0)
        head = [first["content"]] if first is not None and first["content"] else []
        add({"role": "system"}, "\n\n".join(head + [_tools_text(tools)]))
    for m in rest:
        role = m.get("role")
        if role == "tool":
            name = m.get("name") or m.get("tool_name")
            add({"role": "user"}, json.dumps({"tool_response": {"name": name, "content": _content(m)}},
                                             ensure_ascii=False))
        elif role == "assistant" and m.get("tool_calls"):
            text = _content(m)
            add(m, "\n".join(([text] if text else []) + [_call_text(c) for c in m["tool_calls"]]))
        elif isinstance(m.get("content"), str):
            add(m, m["content"])
        else:
            out.append(dict(m))   # image parts: kept as they are
    return out
