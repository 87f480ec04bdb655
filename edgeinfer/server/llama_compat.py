"""llama-server's request forms, read against the model's vocabulary: `logit_bias` (OpenAI's
map and llama-server's pair list, by token id or by text) and `prompt` (text, token ids,
the two mixed, {"prompt_string": ...}, or a batch of those)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from edgeinfer.server.errors import APIError
from edgeinfer.server.images import MARKER, NO_IMAGES, has_image_input
from edgeinfer.server.requests import check_ids

_INT = re.compile(r"-?[0-9]+")
PROMPT_STRING = "prompt_string"
MULTIMODAL_DATA = "multimodal_data"


def _bias(value: Any, field: str) -> float:
    """A bias: a number, -inf, or false (a ban, as -inf)."""
    if value is False:
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"invalid field {field!r}: a bias is a number or false (a ban), got {value!r}",
                       param=field)
    if math.isnan(value) or value == math.inf:
        raise APIError(400, f"invalid field {field!r}: a bias is a finite number or -inf, got {value!r}",
                       param=field)
    return float(value)


def logit_bias(model, value: Any, field: str = "logit_bias") -> dict[int, float] | None:
    """{token id: bias} for `logit_bias` as OpenAI ({"50256": -100}) and llama-server
    ({"text": bias}, [[id, bias], ["text", bias]]) send it. A text stands for each token it
    tokenizes to (without BOS, its special-token text as text), as in llama-server; biases
    given twice for one token add up. An id outside the vocabulary is a 400."""
    if value is None:
        return None
    if isinstance(value, dict):
        pairs = list(value.items())
    else:
        pairs = [(p[0], p[1]) for p in value]
    out: dict[int, float] = {}
    for key, raw in pairs:
        bias = _bias(raw, field)
        if isinstance(key, bool) or isinstance(key, float):
            raise APIError(400, f"invalid field {field!r}: a token is an id or a text, got {key!r}", param=field)
        if isinstance(key, str) and isinstance(value, dict) and _INT.fullmatch(key):
            key = int(key)  # OpenAI's map keys are ids as text
        if isinstance(key, int):
            if key < 0:
                raise APIError(400, f"invalid field {field!r}: token id {key} is negative", param=field)
            check_ids(model, [key], field)
            ids = [key]
        else:
            ids = model.tokenize(key, add_special=False, parse_special=False) if key else []
        for tok in ids:
            out[tok] = out.get(tok, 0.0) + bias
    return out or None


@dataclass(frozen=True)
class MediaPrompt:
    """A prompt with images: its text (a <__media__> marker where each image goes) and its
    images, `count` of the request's images from `first` (edgeinfer.server.images.RequestImages)."""

    text: str
    first: int
    count: int


def _subprompt(model, p: Any, field: str, images=None) -> list[int] | str | MediaPrompt:
    """One prompt: text stays text (the generation tokenizes it, BOS included), the rest
    becomes token ids (mixed lists tokenized as llama-server's tokenize_mixed does);
    {"prompt_string", "multimodal_data": [base64...]} becomes a MediaPrompt, its images read
    by `images` (without it, multimodal data is a 400)."""
    if isinstance(p, str):
        return p
    if isinstance(p, dict) and "content" in p and set(p) == {"content"}:
        return _content_text(p["content"], field)
    if isinstance(p, dict):
        extra = set(p) - {PROMPT_STRING, MULTIMODAL_DATA}
        if MULTIMODAL_DATA in p and p[MULTIMODAL_DATA] != []:  # (an empty list: a text prompt, as in llama-server)
            return _media_prompt(model, p, field, images)
        if extra or not isinstance(p.get(PROMPT_STRING), (str, list)):
            raise APIError(400, f"invalid field {field!r}: a prompt object holds {PROMPT_STRING!r} (text or "
                                "ids)", param=field)
        return _subprompt(model, p[PROMPT_STRING], field)
    if isinstance(p, list):
        if not p:
            raise APIError(400, f"invalid field {field!r}: a prompt is empty", param=field)
        ids: list[int] = []
        for i, part in enumerate(p):
            if isinstance(part, str):  # only a text first gets the BOS
                ids += model.tokenize(part, add_special=(i == 0), parse_special=True)
            elif isinstance(part, int) and not isinstance(part, bool):
                if part < 0:
                    raise APIError(400, f"invalid field {field!r}: token id {part} is negative", param=field)
                ids.append(part)
            else:
                raise APIError(400, f"invalid field {field!r}: a prompt mixes token ids and text only",
                               param=field)
        check_ids(model, ids, field)
        return ids
    raise APIError(400, f"invalid field {field!r}: a prompt is text, token ids, both mixed, or "
                        f"{{{PROMPT_STRING!r}: text}}", param=field)


def _media_prompt(model, p: dict, field: str, images) -> MediaPrompt:
    """{"prompt_string": text, "multimodal_data": [base64, ...]}: one image per marker in the text,
    as llama-server requires."""
    data, text = p[MULTIMODAL_DATA], p.get(PROMPT_STRING)
    at = f"{field}.{MULTIMODAL_DATA}"
    if images is None or not has_image_input(model):
        why = "multimodal data is not read by this endpoint" if has_image_input(model) else NO_IMAGES
        raise APIError(400, f"invalid field {at!r}: {why}", param=at)
    extra = set(p) - {PROMPT_STRING, MULTIMODAL_DATA}
    if extra:
        at = f"{field}.{min(extra)}"
        raise APIError(400, f"unsupported field {at!r}: a multimodal prompt holds {PROMPT_STRING!r} and "
                            f"{MULTIMODAL_DATA!r}", param=at)
    if not isinstance(data, list):
        raise APIError(400, f"invalid field {at!r}: it is a list of base64 images", param=at)
    if not isinstance(text, str):
        at = f"{field}.{PROMPT_STRING}"
        raise APIError(400, f"invalid field {at!r}: with {MULTIMODAL_DATA!r} it is text, its {MARKER} markers "
                            "where the images go", param=at)
    if text.count(MARKER) != len(data):
        raise APIError(400, f"invalid field {at!r}: {len(data)} image(s) for {text.count(MARKER)} {MARKER} "
                            f"marker(s) in {PROMPT_STRING!r}: give one image per marker", param=at)
    first = len(images)
    for k, item in enumerate(data):
        images.base64(item, f"{at}.{k}")
    return MediaPrompt(text, first, len(data))


def prompts(model, value: Any, field: str = "prompt", images=None) -> tuple[list[list[int] | str | MediaPrompt], bool]:
    """The prompts of a request and whether it was a batch: a list holding no bare token id
    is a batch (one answer per element), as llama-server's tokenize_input_prompts reads it.
    `images` (edgeinfer.server.images.RequestImages) reads multimodal prompts' images."""
    if isinstance(value, list) and value and not any(isinstance(e, int) and not isinstance(e, bool)
                                                     for e in value):
        return [_subprompt(model, p, field, images) for p in value], True
    if isinstance(value, list) and not value:
        raise APIError(400, f"invalid field {field!r}: it is empty", param=field)
    return [_subprompt(model, value, field, images)], False


def prefill_mode(messages: list[dict], add_generation_prompt: bool | None,
                 continue_final_message: bool | None) -> tuple[bool, bool]:
    """(add_generation_prompt, continue the final message) as llama-server decides them: a
    final assistant message (without tool calls) stays open unless continue_final_message is
    false; asking for both a generation prompt and a continuation is a 400."""
    last = messages[-1] if messages else {}
    if continue_final_message:
        if add_generation_prompt:
            raise APIError(400, "invalid field 'continue_final_message': it cannot be combined with "
                                "add_generation_prompt: true", param="continue_final_message")
        if last.get("role") != "assistant":
            raise APIError(400, "invalid field 'continue_final_message': the last message is not the "
                                "assistant's", param="continue_final_message")
        if last.get("tool_calls"):
            raise APIError(400, "invalid field 'continue_final_message': an assistant message with tool "
                                "calls cannot be continued", param="continue_final_message")
        return False, True
    if continue_final_message is None and last.get("role") == "assistant" and not last.get("tool_calls") \
            and not add_generation_prompt:
        if len(messages) > 1 and messages[-2].get("role") == "assistant":  # which one would go on?
            raise APIError(400, "invalid field 'messages': two assistant messages end the list, so the one to "
                                "continue is ambiguous", param="messages")
        return False, True  # llama-server's assistant prefill
    return (True if add_generation_prompt is None else add_generation_prompt), False


def _content_text(content: Any, field: str) -> str:
    """{"content": [{"type": "text", "text": ...}, ...]}: the parts' text, joined (text only)."""
    if not isinstance(content, list) or not content:
        raise APIError(400, f"invalid field {field!r}: 'content' is a list of text parts", param=field)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else part
            raise APIError(400, f"invalid field {field!r}: content part {kind!r} is not supported (text only: "
                                "this model is not multimodal)", param=field)
        texts.append(part["text"])
    return "".join(texts)


def embedding_inputs(model, value: Any, field: str = "input") -> list[list[int] | str]:
    """The inputs of an embeddings request as llama-server reads them (see `prompts`), plus
    {"content": [text parts]} entries."""
    return prompts(model, value, field)[0]


_OPEN = "\ue000edgeinfer-prefill\ue000"  # a private-use mark where the final message's text ends


def continued(render, messages: list[dict]) -> str:
    """`render(messages)` cut where the last (assistant) message's text ends, so that message
    stays open and the answer goes on from its text (llama-server's assistant prefill,
    transformers' continue_final_message)."""
    from edgeinfer.errors import TemplateError

    last = dict(messages[-1])
    last["content"] = (last.get("content") or "") + _OPEN
    text = render([*messages[:-1], last])
    end = text.rfind(_OPEN)
    if end < 0:
        raise TemplateError("this chat template does not show the final assistant message, so it cannot be "
                            "continued")
    return text[:end]


def chat_prompt_ids(model, messages: list[dict], *, add_generation_prompt: bool, prefill: bool,
                    cancel=None, tools: list | None = None, **template_kw) -> list[int]:
    """The chat prompt's token ids as Model.chat makes them (only the template's markup
    becomes control tokens), without the generation prompt or with the final message left
    open; `template_kw` are the template switches (enable_thinking, reasoning_effort)."""
    from edgeinfer.prompt.literal_text import LiteralText
    from edgeinfer.prompt.tool_calls import render_with_tools

    literal = LiteralText(model.tokenizer)
    protected = literal.protect(messages)

    def render(ms: list[dict]) -> str:
        return render_with_tools(model.template, ms, tools, add_bos=model.tokenizer.add_bos, cancel=cancel,
                                 add_generation_prompt=add_generation_prompt and not prefill, **template_kw)

    text = continued(render, protected) if prefill else render(protected)
    return literal.tokenize(text, add_special=True, cancel=cancel)
