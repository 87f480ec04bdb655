"""The Responses API's `input`, read: items checked one by one (a 400 names `input[i]` and its
field), then turned into the chat template's messages as /v1/chat/completions has them.

- a string is one user message; a message item's text parts (`input_text`, an echoed
  answer's `output_text` or `refusal`) are joined by a blank line, as chat messages' parts are;
  a user message's `input_image` parts (edgeinfer.server.images) make its content text and
  image parts, as a chat message's image_url parts do;
  `developer` is `system` for templates that do not know that role;
- an assistant message and the `function_call` items after it are one assistant turn
  (`tool_calls`); a `function_call_output` is a tool message (`tool_call_id`, and the
  function's `name`) and must answer a call made before it;
- a `reasoning` item's text (its `content`, or the `encrypted_content` this server wrote)
  is the next assistant turn's `reasoning_content`, which thinking templates render;
- an `item_reference` is an item of a stored response, by id.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Callable

from pydantic import ValidationError

from edgeinfer.server.errors import APIError
from edgeinfer.server.requests import joined_parts
from edgeinfer.server.responses_schemas import ITEMS, PARTS

_SEALED = "edgeinfer.reasoning.v1:"   # this server's `encrypted_content`: the reasoning, base64 (not secret)
_NOT_TEXT = ("input_file", "input_audio")


def seal(reasoning: str) -> str:
    """`encrypted_content` for a reasoning item (include: ["reasoning.encrypted_content"]): opaque
    to clients, read back by `items` so a stateless client (store: false) keeps the reasoning."""
    return _SEALED + base64.b64encode(reasoning.encode()).decode()


def _unseal(blob: str, where: str) -> str:
    if blob.startswith(_SEALED):
        try:
            return base64.b64decode(blob[len(_SEALED):], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            pass
    raise APIError(400, f"invalid field '{where}.encrypted_content': it was not written by this server, "
                        "so it cannot be read", param=f"{where}.encrypted_content")


def _bad(where: str, message: str) -> APIError:
    return APIError(400, f"invalid field {where!r}: {message}", param=where)


def _checked(model, data: Any, where: str) -> dict:
    """`data` validated by `model`, as a plain dict; a 400 naming `where` and the field."""
    if not isinstance(data, dict):
        raise _bad(where, "expected an object")
    try:
        return model.model_validate(data).model_dump(exclude_none=True, by_alias=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        loc = ".".join([where, *(str(p) for p in err["loc"] if not _union_tag(p))])
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unsupported field {loc!r}: this server does not know it, so it cannot honour it",
                           param=loc) from None
        raise _bad(loc, err["msg"].removeprefix("Value error, ")) from None


def _union_tag(part: Any) -> bool:
    # pydantic names the union member it tried in loc ("constrained-str", "list[dict[any,any]]")
    return isinstance(part, str) and ("[" in part or "-" in part or part in ("str", "int", "list", "dict"))


def _parts(parts: list, where: str) -> list[dict]:
    out = []
    for k, part in enumerate(parts):
        at = f"{where}[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _NOT_TEXT:
            raise _bad(at, f"content type {kind!r} is not supported (this server reads text and images)")
        if kind not in PARTS:
            raise _bad(at, f"content type {kind!r} is not supported (input_text, input_image, output_text, refusal)")
        out.append(_checked(PARTS[kind], part, at))
    return out


def items(raw: str | list | None, find: Callable[[str], dict | None]) -> list[dict]:
    """The request's input as checked items (plain dicts); `find` gives a stored item by id."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    out = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in ITEMS:
            raise _bad(where, f"item type {kind!r} is not supported (message, function_call, function_call_output, "
                              "reasoning, item_reference)")
        d = _checked(ITEMS[kind], item, where)
        if kind == "item_reference":
            found = find(d["id"])
            if found is None:
                raise _bad(where + ".id", f"no stored item has id {d['id']!r}")
            d = found
        elif kind == "message" and isinstance(d["content"], list):
            d["content"] = _parts(d["content"], where + ".content")
        elif kind == "function_call_output" and isinstance(d["output"], list):
            d["output"] = _parts(d["output"], where + ".output")
        elif kind == "reasoning" and "encrypted_content" in d and "content" not in d:
            d["content"] = [{"type": "reasoning_text", "text": _unseal(d["encrypted_content"], where)}]
        out.append(d)
    return out


def _text(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    return "\n\n".join(p.get("text", p.get("refusal", "")) for p in content)


def _content(it: dict, where: str, images) -> str | list[dict]:
    """A message's content: its text, or with `input_image` parts its text and image parts, each
    image read by `images` (edgeinfer.server.images.RequestImages; a user message's only)."""
    content = it["content"]
    if isinstance(content, str) or not any(p["type"] == "input_image" for p in content):
        return _text(content)
    if it["role"] != "user":
        raise _bad(where, f"images go in user messages, not in a {it['role']} message")
    if images is None:
        raise _bad(where, "images are not read here")
    parts = [images.url(p.get("image_url"), f"{where}[{k}].image_url") if p["type"] == "input_image"
             else {"type": "text", "text": p.get("text", p.get("refusal", ""))} for k, p in enumerate(content)]
    return joined_parts(parts)


def messages(conversation: list[dict], keep_developer: bool, first_input: int = 0, images=None) -> list[dict]:
    """The chat template's messages for a conversation of checked items (those from
    `first_input` on are the request's `input`, the earlier ones a stored response's)."""
    out: list[dict] = []
    reasoning: str | None = None
    names: dict[str, str] = {}   # call_id -> function name
    for i, it in enumerate(conversation):
        kind = it["type"]
        if kind == "reasoning":
            text = "\n\n".join(c["text"] for c in it.get("content", []))
            reasoning = text if reasoning is None else reasoning + "\n\n" + text
        elif kind == "message":
            role = it["role"]
            where = f"input[{i - first_input}].content" if i >= first_input else "previous_response_id"
            msg = {"role": "system" if role == "developer" and not keep_developer else role,
                   "content": _content(it, where, images)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"] = reasoning
            reasoning = None
            out.append(msg)
        elif kind == "function_call":
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or reasoning is not None:
                last = {"role": "assistant", "content": ""}
                if reasoning is not None:
                    last["reasoning_content"] = reasoning
                reasoning = None
                out.append(last)
            fn = {"name": it["name"], "arguments": it["arguments"]}
            last.setdefault("tool_calls", []).append({"id": it["call_id"], "type": "function", "function": fn})
            names[it["call_id"]] = it["name"]
        else:  # function_call_output
            if it["call_id"] not in names:
                where = f"input[{i - first_input}].call_id" if i >= first_input else "previous_response_id"
                raise _bad(where, f"no function_call with call_id {it['call_id']!r} comes before it")
            out.append({"role": "tool", "tool_call_id": it["call_id"], "name": names[it["call_id"]],
                        "content": _text(it["output"])})
    return out
