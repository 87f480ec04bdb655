"""What a request sends, read and checked: the JSON body (size-limited, validated into its
schema, every problem a one-line 400/413), token ids and OpenAI-shaped chat messages."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from edgeinfer.server.errors import APIError
from edgeinfer.server.schemas import OpenAIMessage

log = logging.getLogger("edgeinfer.server")
B = TypeVar("B", bound=BaseModel)


async def read_body(request: Request, schema: type[B]) -> B:
    """The JSON body, size-limited and validated; every problem is a one-line 400/413."""
    limit = request.app.state.server.config.max_body_bytes
    data = bytearray()
    try:
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise APIError(413, f"request body is larger than {limit} bytes (serve --max-body raises the limit)")
    except ClientDisconnect:
        log.info("%s %s: the client disconnected while sending the request body",
                 request.method, request.url.path)
        raise APIError(499, "the client disconnected while sending the request body") from None
    if not data.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return schema.model_validate_json(bytes(data))
    except ValidationError as exc:
        message, param = describe(exc)
        raise APIError(400, message, param=param) from None


def describe(exc: ValidationError) -> tuple[str, str | None]:
    """One line for a validation failure, and the field it names (the OpenAI `param`)."""
    errors = exc.errors(include_url=False)
    # an unknown field is the real problem even when a union's other members also failed
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    if err["type"] == "json_invalid":
        return f"malformed JSON: {err['msg'].removeprefix('Invalid JSON: ')}", None
    loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
    if err["type"] == "model_type":
        return "the request body must be a JSON object", None
    if err["type"] == "extra_forbidden":
        return f"unsupported field {loc!r}: this server does not know it, so it cannot honour it", loc
    return f"invalid field {loc!r}: {err['msg'].removeprefix('Value error, ')}", loc or None


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the union member tried into loc ("list[str]", "function-after[...]")
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def check_ids(model, ids: list[int], field: str | None = None) -> None:
    """Token ids a request sends must lie in the model's vocabulary."""
    n = model.tokenizer.vocab_size
    bad = next((i for i in ids if i >= n), None)
    if bad is not None:
        where = f"invalid field {field!r}: " if field else ""
        raise APIError(400, f"{where}token id {bad} is out of range (the vocabulary has {n} tokens)",
                       param=field)


def message_text(m: OpenAIMessage) -> str:
    """OpenAI content may be a string or a list of parts; only text parts are supported. Parts
    are joined by a blank line, as llama-server joins them (agents send their task and the
    workspace as separate parts: run together, the last word of one meets the first of the next)."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for part in m.content:
        if part.type != "text":
            raise APIError(400, f"invalid field 'messages': content part type {part.type!r} is not supported "
                                "(text, or image_url in a user message)",
                           param="messages")
        if part.image_url is not None:
            raise APIError(400, "invalid field 'messages': a text part holds no image_url (an image is a part of "
                                "type 'image_url')", param="messages")
        parts.append(part.text or "")
    return "\n\n".join(parts)


def message_content(m: OpenAIMessage, field: str, images=None) -> str | list[dict]:
    """A message's content: its text, or, where it holds image parts, its text and image parts
    in order as Model.chat reads them (`images`, an edgeinfer.server.images.RequestImages,
    reads each image; without it an image part is a 400). Images go in user messages only."""
    if m.content is None or isinstance(m.content, str) or not any(p.type == "image_url" for p in m.content):
        return message_text(m)
    if images is None:
        raise APIError(400, f"invalid field {field + '.content'!r}: image parts are not read by this endpoint",
                       param=field + ".content")
    if m.role != "user":
        raise APIError(400, f"invalid field {field + '.content'!r}: images go in user messages, not in a "
                            f"{m.role} message", param=field + ".content")
    out: list[dict] = []
    for j, part in enumerate(m.content):
        at = f"{field}.content.{j}"
        if part.type == "text" and part.image_url is None:
            out.append({"type": "text", "text": part.text or ""})
        elif part.type == "image_url" and part.image_url is not None and part.text is None:
            out.append(images.url(part.image_url.url, at + ".image_url.url"))
        else:
            raise APIError(400, f"invalid field {at!r}: a content part is {{'type': 'text', 'text': ...}} or "
                                "{'type': 'image_url', 'image_url': {'url': ...}}", param=at)
    return joined_parts(out)


def joined_parts(parts: list[dict]) -> list[dict]:
    """Text and image parts with each run of text parts made one, joined by a blank line as
    message_text joins them."""
    out: list[dict] = []
    for part in parts:
        if part["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + "\n\n" + part["text"]}
        else:
            out.append(part)
    return out


def chat_message(m: OpenAIMessage, images=None, field: str = "messages") -> dict:
    """The template's view of a message; `name`, an assistant's `tool_calls` and
    `reasoning_content`, a tool message's `tool_call_id` go along for templates that use them;
    image parts are read by `images` (see message_content)."""
    out: dict = {"role": m.role, "content": message_content(m, field, images)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump(exclude_none=True, exclude={"index": True, "function": {"parsed_arguments"}})
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out
