"""OpenAI Responses API request bodies (`POST /v1/responses`), validated as strictly as the other dialects'.

The body's `input` items are read one by one (edgeinfer.server.responses_input: a 400 names
the item and its field); here they are documented. Fields OpenAI defines that change nothing
for a local server are accepted and say why; fields edgeinfer cannot honour accept only their
do-nothing value (`Unsupported`), anything else is a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StringConstraints, field_validator

from edgeinfer.server.schemas import MAX_MESSAGES, MAX_TOKENS, MAX_TOOLS, Body, Unsupported

Id = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Text = Annotated[str, StringConstraints(max_length=1 << 24)]

# -- input items (read by edgeinfer.server.responses_input) ---------------------------------------


class InputText(Body):
    type: Literal["input_text"]
    text: Text


class InputImage(Body):
    """An image in a user message: a data URI (an http(s) URL with serve --allow-image-urls),
    read by edgeinfer.server.images when the message becomes the template's."""

    type: Literal["input_image"]
    image_url: str | None = None   # required (checked where read: file_id's refusal comes first)
    detail: Unsupported("an image is always seen at its projector's own resolution", "auto") = None
    file_id: Unsupported("uploaded files are not kept by this server: send the image's data URI") = None


class OutputText(Body):
    """An answer's text, echoed back in an assistant message."""

    type: Literal["output_text"]
    text: Text
    annotations: Annotated[list, Field(max_length=1024)] = []   # citations: never shown to the model
    logprobs: Annotated[list, Field(max_length=MAX_TOKENS)] | None = None   # the answer's: not read


class RefusalPart(Body):
    """An assistant's refusal, echoed back: rendered as its text."""

    type: Literal["refusal"]
    refusal: Text


class Message(Body):
    """A message: `type` may be left out (the SDK's EasyInputMessage)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[dict], Field(max_length=1024)]   # parts, read one by one
    id: Id | None = None                  # an output message echoed back
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None   # a label OpenAI's own models read; not rendered


class FunctionCallItem(Body):
    """A call the model made, echoed back."""

    type: Literal["function_call"]
    call_id: Id
    name: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    arguments: Text
    id: Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    namespace: Unsupported("namespaced tools are not supported") = None


class FunctionCallOutputItem(Body):
    """A call's result: text, or text parts."""

    type: Literal["function_call_output"]
    call_id: Id
    output: Text | Annotated[list[dict], Field(max_length=1024)]
    id: Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class SummaryText(Body):
    type: Literal["summary_text"]
    text: Text


class ReasoningText(Body):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(Body):
    """Reasoning the model did, echoed back: its `content` (or this server's `encrypted_content`)
    becomes the assistant turn's reasoning, as the template renders it."""

    type: Literal["reasoning"]
    id: Id | None = None
    summary: Annotated[list[SummaryText], Field(max_length=1024)] = []
    content: Annotated[list[ReasoningText], Field(max_length=1024)] | None = None
    encrypted_content: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ItemReference(Body):
    """An item of a stored response, by its id."""

    type: Literal["item_reference"]
    id: Id


ITEMS: dict[str, type[Body]] = {"message": Message, "function_call": FunctionCallItem,
                                "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem,
                                "item_reference": ItemReference}
PARTS: dict[str, type[Body]] = {"input_text": InputText, "input_image": InputImage, "output_text": OutputText,
                                "refusal": RefusalPart}

# -- the request ----------------------------------------------------------------------------------


class FunctionTool(Body):
    type: str   # "function" only (checked: the hosted tools are OpenAI's services)
    name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None   # calls always validate against `parameters` here (constrained)

    @field_validator("type")
    @classmethod
    def _function_only(cls, v: str) -> str:
        if v != "function":
            raise ValueError(f"tool type {v!r} is not supported: this server runs function tools only")
        return v


def _tool_choice(v: Any) -> Any:
    named = isinstance(v, dict) and v.get("type") == "function" and set(v) == {"type", "name"} \
        and isinstance(v["name"], str)
    if not (named or v in ("none", "auto", "required")):
        raise ValueError('expected "none", "auto", "required" or {"type": "function", "name": ...} '
                         f"(hosted tools and allowed_tools are not supported), got {v!r}")
    return v


class TextFormat(Body):
    """`text.format`: {type: text} | {type: json_object} | {type: json_schema, name, schema, strict}."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Annotated[str, StringConstraints(max_length=64)] | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None   # the answer always validates here (constrained)


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Unsupported("verbosity levels are not supported", "medium") = None


class Reasoning(Body):
    # none: no thinking (a template with a switch, Qwen 3); low/medium/high: the template's
    # reasoning_effort (gpt-oss); checked in the endpoint against the model's template
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # the reasoning item carries the reasoning itself; no summarizer runs here, so "auto"
    # (the most detailed summarizer available) leaves `summary` empty
    summary: Unsupported("reasoning summaries are not generated by this server", "auto") = None


class StreamOptions(Body):
    include_obfuscation: bool | None = None   # padding against network side channels: not sent, same text


INCLUDABLE = ("reasoning.encrypted_content",)


def _includable(values: list[str]) -> list[str]:
    bad = [v for v in values if v not in INCLUDABLE]
    if bad:
        raise ValueError(f"{bad[0]!r} is not supported (this server includes: {', '.join(INCLUDABLE)})")
    return values


class ResponsesRequest(Body):
    model: str | None = None
    # a string (one user message) or a list of items: message, function_call,
    # function_call_output, reasoning, item_reference (edgeinfer.server.responses_input)
    input: Text | Annotated[list[dict], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: Text | None = None
    previous_response_id: Id | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Annotated[str | dict, AfterValidator(_tool_choice)] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True   # kept in memory for previous_response_id and GET (edgeinfer.server.responses_store)
    # "auto": the oldest turns are left out until the prompt fits (instructions and system kept)
    truncation: Literal["auto", "disabled"] | None = None
    include: Annotated[list[str], Field(max_length=16), AfterValidator(_includable)] | None = None
    # built-in (hosted) tools only: there are none here, so no limit changes anything
    max_tool_calls: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    # Metadata with no effect on the output: stored with the response and echoed.
    metadata: Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                             Annotated[str, StringConstraints(max_length=512)]], Field(max_length=16)] | None = None
    user: Annotated[str, StringConstraints(max_length=256)] | None = None
    safety_identifier: Annotated[str, StringConstraints(max_length=256)] | None = None
    # the prefix cache serves every request; a key for routing among servers changes nothing here
    prompt_cache_key: Annotated[str, StringConstraints(max_length=256)] | None = None
    prompt_cache_retention: Unsupported("the prefix cache lives in this server's memory only", "in_memory") = None
    service_tier: Unsupported("service tiers are not offered", "auto", "default") = None
    background: Unsupported("background responses are not supported", False) = None
    conversation: Unsupported("conversations are not supported; use previous_response_id") = None
    prompt: Unsupported("stored prompt templates are not supported") = None
    context_management: Unsupported("context management (compaction) is not supported") = None
    top_logprobs: Unsupported("log-probabilities are not offered on /v1/responses", 0) = None
