"""Anthropic Messages request bodies (/v1/messages, /v1/messages/count_tokens), validated strictly.

As in edgeinfer.server.schemas: types checked (no "5" for 5), ranges bounded, unknown fields
a 400 naming them (a server tool, `container`, `mcp_servers`...), and the known fields edgeinfer
cannot honour accepted only at their do-nothing value (`Unsupported`). Content blocks are a
union tagged by `type`, so an unknown block type is a 400 naming the block. Accepted although
they change nothing here, because Anthropic clients (Claude Code, the SDKs) send them routinely:
`cache_control` (the prefix cache is always on: edgeinfer.sessions), `metadata.user_id`
(abuse tracking), `service_tier`, a thinking block's `signature` (nothing to verify).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, StringConstraints, Tag, model_validator

from edgeinfer.server.schemas import MAX_MESSAGES, MAX_STOPS, MAX_TOKENS, MAX_TOOLS, Body, StopText, Unsupported

MAX_BLOCKS = 4096              # content blocks in one message
Name = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Ident = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class AnthropicCacheControl(Body):
    """A prompt-cache breakpoint: accepted, as every prefix is cached here anyway."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


CacheMark = AnthropicCacheControl | None


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheMark = None
    citations: Unsupported("citations are not supported (documents are not)", []) = None


class ImageBlock(Body):
    type: Literal["image"]
    source: dict                 # base64 or url: checked by edgeinfer.server.images (a user turn's, with --mmproj)
    cache_control: CacheMark = None


class DocumentBlock(Body):
    type: Literal["document"]
    source: dict                 # refused where the message is read
    cache_control: CacheMark = None


class ThinkingBlock(Body):
    """An answer's thinking, echoed back (the template reads it as `reasoning_content`)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None   # this server signs nothing, so there is nothing to check
    cache_control: CacheMark = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str                    # refused where the message is read: encrypted by another server


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: Ident
    name: Name
    input: dict
    cache_control: CacheMark = None


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: Ident
    content: TextOr(OneOf(TextBlock, ImageBlock, DocumentBlock)) | None = None
    is_error: bool | None = None
    cache_control: CacheMark = None


# Unions are picked by a look at the value (a content's str or list, a block's `type`), so a
# bad value is told the one error of the member it meant, not one per member. The tags are
# written "x[...]" so that edgeinfer.server.requests.describe leaves them out of the field's name.
def OneOf(*blocks: type) -> Any:  # noqa: N802 - used like a type
    """One of these blocks, picked by its `type`."""
    kinds = {c.model_fields["type"].annotation.__args__[0]: c for c in blocks}

    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return f"block[{kind}]" if kind in kinds else None

    return Annotated[Union[tuple(Annotated[c, Tag(f"block[{k}]")] for k, c in kinds.items())],
                     Discriminator(tag, custom_error_type="block_type",
                                   custom_error_message=f"unknown content block type (known: {', '.join(kinds)})")]


def _text_or(value: Any) -> str:
    return "str" if isinstance(value, str) else "list[...]"


def TextOr(item: Any) -> Any:  # noqa: N802 - used like a type
    """A string, or a list of `item` blocks (Anthropic's two forms of content)."""
    return Annotated[Union[Annotated[str, Tag("str")],
                           Annotated[Annotated[list[item], Field(max_length=MAX_BLOCKS)], Tag("list[...]")]],
                     Discriminator(_text_or)]


class AnthropicMessage(Body):
    role: Literal["user", "assistant", "system"]   # "system" in a conversation: the newer API's form
    content: TextOr(OneOf(TextBlock, ImageBlock, DocumentBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock,
                          ToolResultBlock))


class AnthropicTool(Body):
    """A client tool; server tools (web_search, bash, text_editor...) have fields this one has
    not, so they are a 400 naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"server tool {kind!r} is not supported: this server runs client tools only "
                             "(name, description, input_schema)")
        return data

    name: Name                   # the name's form is checked by edgeinfer.prompt.tool_calls
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: CacheMark = None
    strict: bool | None = None   # a call's input is always held to input_schema when it is constrained
    input_examples: Unsupported("tool input examples are not supported", []) = None
    defer_loading: Unsupported("deferred tool loading is not supported", False) = None
    eager_input_streaming: bool | None = None   # a tool_use's input always streams whole here


class AnthropicToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None     # with type "tool" (checked in the endpoint)
    disable_parallel_tool_use: bool | None = None


class AnthropicThinking(Body):
    """enabled (budget_tokens, bounded by max_tokens here), disabled, or adaptive (the template's
    default); display "omitted" leaves the thinking blocks empty."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1024, le=MAX_TOKENS)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class AnthropicOutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class AnthropicOutputConfig(Body):
    effort: str | None = None    # the template's reasoning_effort (checked in the endpoint)
    format: AnthropicOutputFormat | None = None


class AnthropicMetadata(Body):
    user_id: Annotated[str, StringConstraints(max_length=256)] | None = None   # for abuse tracking: not read


class AnthropicMessagesBase(Body):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt's parts."""

    model: str | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: TextOr(TextBlock) | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None
    cache_control: CacheMark = None


class AnthropicMessagesRequest(AnthropicMessagesBase):
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)]   # required, as Anthropic requires it
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    stream: bool = False
    metadata: AnthropicMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None   # one tier here: either asks for it
    speed: Unsupported("fast mode is not offered", "standard") = None


class AnthropicCountTokensRequest(AnthropicMessagesBase):
    pass
