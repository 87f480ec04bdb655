"""Request bodies, validated strictly: types (no "5" for 5), ranges, bounded lists.

Unknown fields are ignored (clients send many we do not use); fields we cannot honour
with a different meaning (n > 1, logprobs, images, JSON mode) are refused in the
endpoint with a clear 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MAX_TOKENS = 1 << 20          # upper bound for every token-count field
MAX_STOPS = 16                # stop strings per request
MAX_MESSAGES = 4096

StopText = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
Stop = Union[StopText, Annotated[list[StopText], Field(max_length=MAX_STOPS)], None]
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
Seed = Annotated[int, Field(ge=-1, lt=1 << 63)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# -- OpenAI ---------------------------------------------------------------------------------

class ContentPart(Body):
    type: str
    text: str | None = None


class OpenAIMessage(Body):
    role: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(Body):
    include_usage: bool = False


class ResponseFormat(Body):
    type: str = "text"


class OpenAISampling(Body):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None  # llama-server extension
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None          # llama-server extension
    repeat_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: Seed | None = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None


class ChatCompletionRequest(OpenAISampling):
    messages: Annotated[list[OpenAIMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(OpenAISampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | \
        Annotated[list[TokenId], Field(min_length=1)]
    suffix: str | None = None
    echo: bool = False


# -- Ollama ---------------------------------------------------------------------------------

class OllamaOptions(Body):
    num_ctx: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    num_predict: Annotated[int, Field(ge=-2, le=MAX_TOKENS)] | None = None  # -1 infinite, -2 fill context
    num_keep: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Seed | None = None
    stop: Stop = None
    repeat_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1, le=MAX_TOKENS)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None


KeepAlive = Union[str, int, float, None]


class OllamaMessage(Body):
    role: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    content: str = ""
    images: list[str] | None = None


class OllamaBase(Body):
    model: str | None = None
    stream: bool = True
    format: str | dict | None = None
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None


class OllamaGenerateRequest(OllamaBase):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None


class OllamaChatRequest(OllamaBase):
    messages: Annotated[list[OllamaMessage], Field(max_length=MAX_MESSAGES)] = []


class OllamaShowRequest(Body):
    model: str | None = None
    name: str | None = None  # older clients
    verbose: bool = False


# -- llama-server ---------------------------------------------------------------------------

class LlamaSampling(Body):
    n_predict: Annotated[int, Field(ge=-1, le=MAX_TOKENS)] = -1  # -1 = until stop / context end
    n_keep: Annotated[int, Field(ge=0, le=MAX_TOKENS)] = 0  # no negatives: cf. CVE-2026-21869
    temperature: Annotated[float, Field(ge=0, le=100)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Seed | None = None
    stop: Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1, le=MAX_TOKENS)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    stream: bool = False
    cache_prompt: bool = True  # always on: the prefix cache is how the model works
    n_probs: Annotated[int, Field(ge=0, le=0)] = 0  # token probabilities are not produced
    t_max_predict_ms: Annotated[int, Field(ge=0, le=1 << 31)] | None = None
    response_fields: Annotated[list[str], Field(max_length=64)] | None = None


class LlamaCompletionRequest(LlamaSampling):
    prompt: str | Annotated[list[TokenId], Field(min_length=1)]


class InfillChunk(Body):
    filename: Annotated[str, StringConstraints(max_length=4096)] = "tmp"
    text: str = ""


class InfillRequest(LlamaSampling):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Annotated[list[InfillChunk], Field(max_length=1024)] = []
    prompt: str = ""


class TokenizeRequest(Body):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Body):
    tokens: list[TokenId]


class ApplyTemplateRequest(Body):
    messages: Annotated[list[OpenAIMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


