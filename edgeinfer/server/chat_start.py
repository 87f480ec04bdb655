"""The worker's start function for a chat request: Model.chat, or a prompt made here."""
from __future__ import annotations

from edgeinfer.server import llama_compat
from edgeinfer.server.errors import APIError
from edgeinfer.server.images import has_images


def chat_start(model, messages: list[dict], extra: dict, add_generation_prompt: bool, prefill: bool):
    """params -> a worker start function for the chat: Model.chat, or, without the generation
    prompt or continuing the final assistant message (llama-server's prefill), the prompt
    made here (edgeinfer.server.llama_compat.chat_prompt_ids) and generated from."""
    if add_generation_prompt and not prefill:
        return lambda p: lambda cancel: model.chat(messages, stream=True, cancel=cancel, **p, **extra)
    if has_images(messages):  # the prompt below is made of text: Model.chat is what reads images
        raise APIError(400, "invalid field 'messages': a conversation with images is answered in a new assistant "
                            "turn; continuing a final assistant message (or leaving out the generation prompt) "
                            "is not supported with images", param="messages")
    if extra.get("tools"):
        raise APIError(400, "invalid field 'continue_final_message': a final assistant message cannot be "
                            "continued in a request with tools", param="continue_final_message")
    template_kw = {k: extra[k] for k in ("enable_thinking", "reasoning_effort") if k in extra}
    constraint = {"constraint": extra["constraint"]} if extra.get("constraint") is not None else {}
    from edgeinfer.prompt.tool_calls import markup_token_ids
    from edgeinfer.server.constraints import channel_format

    # a channel format's markup reaches the reader, as in Model.chat
    fmt = channel_format(model)
    shown = {"preserved_tokens": markup_token_ids(model.tokenizer, fmt)} if fmt else {}

    def start_for(p: dict):
        def start(cancel):
            ids = llama_compat.chat_prompt_ids(model, messages, add_generation_prompt=add_generation_prompt,
                                               prefill=prefill, cancel=cancel, **template_kw)
            return model.generate(ids, stream=True, cancel=cancel, **p, **constraint, **shown)
        return start

    return start_for
