"""Request bodies, validated strictly: types (no "5" for 5), ranges, bounded lists, no unknown fields.

A field a client sends either works or is refused with a 400 naming it: unknown fields
(a typo, a sampler we lack) fail validation (`extra="forbid"`), and known
fields we cannot honour accept only their do-nothing value (`Unsupported`). The few
accepted fields that change nothing (metadata such as OpenAI `user`) say why where declared.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, StringConstraints, Tag,
                      model_validator)

MAX_TOKENS = 1 << 20          # upper bound for every token-count field
MAX_STOPS = 16                # stop strings per request
MAX_MESSAGES = 4096

StopText = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
Stop = Union[StopText, Annotated[list[StopText], Field(max_length=MAX_STOPS)], None]
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
Seed = Annotated[int, Field(ge=-1, lt=1 << 63)]
MAX_CHOICES = 16              # OpenAI `n`: choices run one after another on the one worker
TopLogprobs = Annotated[int, Field(ge=0, le=20)]   # alternatives per token (OpenAI's and Ollama's bound)
MAX_PROMPTS = 64              # prompts in one batched completion request
MAX_BIASES = 4096             # logit_bias entries
# logit_bias, as OpenAI sends it ({"token id": bias}) and as llama-server also takes it
# ({"text": bias}, [[id or text, bias], ...]); a bias of false bans the token as -inf does.
# Read against the vocabulary by edgeinfer.server.llama_compat.logit_bias.
BiasValue = Union[float, bool]
LogitBias = Union[Annotated[dict[Annotated[str, StringConstraints(max_length=1024)], BiasValue],
                            Field(max_length=MAX_BIASES)],
                  Annotated[list[Annotated[list[Union[int, str, float, bool]], Field(min_length=2, max_length=2)]],
                            Field(max_length=MAX_BIASES)]]
OneSlot = "this server has one slot, id 0"   # id_slot: 0, or -1 for any


def Unsupported(why: str, *noop: Any) -> Any:  # noqa: N802 - used like a type
    """A known field edgeinfer cannot honour: absent, null or one of `noop` (the values that
    ask for nothing) pass; anything else is a 400 naming the field and saying `why`."""
    allowed = (None, *noop)

    def check(value: Any) -> Any:
        if not any(_same(value, a) for a in allowed):
            shown = " or ".join(repr(a) for a in noop)
            raise ValueError(why + (f" (only {shown} is accepted)" if noop else ""))
        return value

    return Annotated[Any, AfterValidator(check)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _same(value: Any, allowed: Any) -> bool:
    number = (int, float)
    if isinstance(value, bool) or isinstance(allowed, bool) or not isinstance(value, number) \
            or not isinstance(allowed, number):
        return type(value) is type(allowed) and value == allowed
    return value == allowed  # 1 and 1.0 are the same number in JSON


TOOLS = "tool calling is not supported by this server"


# -- OpenAI ---------------------------------------------------------------------------------

class ImageURL(Body):
    url: str             # a data URI (or an http(s) URL: serve --allow-image-urls), read by edgeinfer.server.images
    detail: Unsupported("an image is always seen at its projector's own resolution", "auto") = None


class ContentPart(Body):
    type: str            # "text", or "image_url" in a user message (checked where the message is read)
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(Body):
    name: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    arguments: str | dict = "{}"   # OpenAI sends JSON text; an object is taken too
    parsed_arguments: Any = None   # what the openai client's stream/parse helpers add; not read


class ToolCallIn(Body):
    """A call an assistant message made (the client echoes the answer back)."""

    id: Annotated[str, StringConstraints(max_length=256)] | None = None
    type: Annotated[str, StringConstraints(pattern="^function$")] = "function"
    function: FunctionCall
    index: Annotated[int, Field(ge=0)] | None = None   # kept by the openai client's stream accumulator


MAX_TOOLS = 256
Tools = Annotated[list[dict], Field(max_length=MAX_TOOLS)]   # checked by edgeinfer.prompt.tool_calls


def _str_or_list(value: Any) -> str:
    return "str" if isinstance(value, str) else "list[...]"


# a string or a list of parts, picked by a look at the value: a bad part is told its own error
# (a part's field named), not the string member's (the tags are left out of the field's name)
Content = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[ContentPart], Tag("list[...]")]],
                    Discriminator(_str_or_list)]


class OpenAIMessage(Body):
    role: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    content: Content | None = None
    name: Annotated[str, StringConstraints(max_length=256)] | None = None  # handed to the chat template
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[str, StringConstraints(max_length=256)] | None = None   # a tool message's call
    reasoning_content: str | None = None   # an answer's reasoning, echoed back (thinking templates read it)
    parsed: Any = None                     # the openai client's parse helpers add it; not read
    annotations: Annotated[list, Field(max_length=0)] | None = None   # echoed by the stream helpers: empty
    function_call: Unsupported(TOOLS) = None
    refusal: Unsupported("refusal messages are not supported") = None
    audio: Unsupported("audio is not supported") = None


class StreamOptions(Body):
    include_usage: bool = False


class ResponseFormat(Body):
    type: str = "text"   # text, json_object or json_schema (edgeinfer.server.constraints)
    json_schema: dict | None = None   # {"name", "schema", "strict"}
    schema_: dict | None = Field(None, alias="schema")   # llama-server: json_object's schema, beside type


class OpenAISampling(Body):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None  # llama-server extension
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None          # llama-server extension
    repeat_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1, le=MAX_TOKENS)] | None = None  # llama-server extension
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: Seed | None = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias | None = None
    # llama-server extension; the prefix cache is always on, and turning it off changes no output
    cache_prompt: bool = True
    # llama-server's own fields on its OpenAI routes
    n_predict: Annotated[int, Field(ge=-1, le=MAX_TOKENS)] | None = None   # max_tokens, by another name
    grammar: str | None = None               # GBNF (edgeinfer.prompt.grammar)
    json_schema: dict | None = None          # the answer is JSON valid against it
    id_slot: Unsupported(OneSlot, -1, 0) = None
    timings_per_token: bool = False          # each streamed chunk carries the timings so far
    return_progress: bool = False            # a stream carries prompt_progress (prompt processing)
    verbose: bool | None = None              # `__verbose`: /completion's body, prompt included (None: serve --verbose)
    backend_sampling: bool = False           # llama-server samples on the GPU when true; same tokens either way
    # Metadata with no effect on the output: OpenAI uses them for abuse tracking and for
    # tagging stored completions; nothing is stored here.
    user: Annotated[str, StringConstraints(max_length=256)] | None = None
    metadata: Annotated[dict[str, Annotated[str, StringConstraints(max_length=512)]],
                        Field(max_length=16)] | None = None
    # OpenAI's routing hint for its prompt cache (Codex sends it): the prefix cache here is
    # keyed by the prompt's own tokens, so a shared prefix is reused whatever the key
    prompt_cache_key: Annotated[str, StringConstraints(max_length=256)] | None = None
    store: Unsupported("stored completions are not supported", False) = None
    service_tier: Unsupported("service tiers are not offered", "auto", "default") = None


class ChatTemplateKwargs(Body):
    """llama-server's `chat_template_kwargs`: the template switches edgeinfer honours."""

    enable_thinking: bool | None = None
    reasoning_effort: str | None = None   # gpt-oss's level, as the top-level field (checked in the endpoint)


class ChatCompletionRequest(OpenAISampling):
    messages: Annotated[list[OpenAIMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None       # needs logprobs: true (checked in the endpoint)
    tools: Tools | None = None
    tool_choice: str | dict | None = None    # "none", "auto", "required" or {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None   # llama-server extension
    functions: Unsupported(TOOLS, []) = None
    function_call: Unsupported(TOOLS, "none") = None
    reasoning_effort: str | None = None   # low, medium or high, for templates that take it (checked in the endpoint)
    modalities: Unsupported("only text output is supported", ["text"]) = None
    audio: Unsupported("audio output is not supported") = None
    prediction: Unsupported("predicted outputs are not supported") = None
    # llama-server / transformers: leave a final assistant message open and go on from its text
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None


class CompletionRequest(OpenAISampling):
    # one prompt (text or token ids), or several: each answered as its own choice(s)
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[TokenId], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    suffix: str | None = None
    echo: bool = False                              # the prompt's text (and logprobs) before the answer
    logprobs: TopLogprobs | None = None             # alternatives per token; 0 = the chosen token's only
    best_of: Unsupported("best_of is not supported", 1) = None


# -- Ollama ---------------------------------------------------------------------------------

class OllamaOptions(Body):
    """Ollama's options. A null option is "not set", as in Ollama (langchain-ollama sends every
    option, most of them null). Sampling options are honoured; the load-time ones (num_ctx,
    num_gpu, num_thread, num_batch) get a model loaded with them (edgeinfer.server.state);
    samplers we lack are accepted only switched off; options with no effect on an answer
    here (use_mmap false, use_mlock, numa, low_vram, main_gpu, logits_all, penalize_newline,
    mirostat_tau/eta while mirostat is off) are accepted and reported in one log line."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    num_ctx: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    num_predict: Annotated[int, Field(ge=-2, le=MAX_TOKENS)] | None = None  # -1 infinite, -2 fill context
    num_keep: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None       # kept by a context shift
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
    # samplers we do not have, accepted at the value that switches them off
    mirostat: Unsupported("mirostat sampling is not supported", 0) = None
    typical_p: Unsupported("typical sampling is not supported", 1.0) = None
    tfs_z: Unsupported("tail-free sampling is not supported", 1.0) = None
    mirostat_tau: Annotated[float, Field(ge=0, le=100)] | None = None   # read only by mirostat (off)
    mirostat_eta: Annotated[float, Field(ge=0, le=100)] | None = None
    penalize_newline: bool | None = None   # Ollama itself no longer reads it
    # load-time options: a request that sets them gets a model loaded with them
    num_gpu: Annotated[int, Field(ge=-1, le=1 << 16)] | None = None   # layers on the GPU; -1: what fits
    num_thread: Annotated[int, Field(ge=0, le=4096)] | None = None     # 0: the default
    num_batch: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None  # the prefill chunk
    use_mmap: bool | None = None           # weights are always mapped here: false is reported
    use_mlock: bool | None = None          # no effect on answers: reported
    numa: bool | None = None
    low_vram: bool | None = None
    main_gpu: Annotated[int, Field(ge=0, le=1 << 16)] | None = None
    logits_all: bool | None = None
    f16_kv: Unsupported("K/V is always f16 here", True) = None
    vocab_only: Unsupported("a model is always loaded with its weights", False) = None


KeepAlive = Union[str, int, float, None]


class OllamaFunctionCall(Body):
    name: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    arguments: dict = {}
    index: int | None = None


class OllamaToolCall(Body):
    function: OllamaFunctionCall
    id: Annotated[str, StringConstraints(max_length=256)] | None = None


class OllamaMessage(Body):
    role: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    content: str = ""
    thinking: str | None = None        # an answer's thinking, echoed back
    tool_calls: Annotated[list[OllamaToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_name: Annotated[str, StringConstraints(max_length=256)] | None = None   # a tool message's tool
    images: list[str] | None = None   # base64, read by edgeinfer.server.images (a user message's)


class OllamaBase(Body):
    model: str | None = None
    stream: bool = True
    format: str | dict | None = None   # "json" or a JSON schema (edgeinfer.server.constraints)
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None
    think: bool | str | None = None    # enable_thinking, or a level: the template's reasoning_effort (endpoint)
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None         # alternatives per token, with logprobs: true


class OllamaGenerateRequest(OllamaBase):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None        # refused in the endpoint
    raw: bool = False
    images: list[str] | None = None    # base64, read by edgeinfer.server.images
    context: Annotated[list[TokenId], Field(max_length=MAX_TOKENS)] | None = None  # ids from a previous answer


class OllamaChatRequest(OllamaBase):
    messages: Annotated[list[OllamaMessage], Field(max_length=MAX_MESSAGES)] = []
    tools: Tools | None = None         # the ollama client always sends a list, empty without tools


class OllamaShowRequest(Body):
    model: str | None = None
    name: str | None = None  # older clients
    verbose: bool | None = None  # model_info with every key of the file, the vocabulary arrays whole (as Ollama)


# -- llama-server ---------------------------------------------------------------------------

SAMPLER_NAMES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "typical_p", "top_p", "min_p",
                 "xtc", "temperature", "infill")


def _known_samplers(names: list[str]) -> list[str]:
    bad = [n for n in names if n not in SAMPLER_NAMES]
    if bad:
        raise ValueError(f"unknown sampler {bad[0]!r}; known: {', '.join(SAMPLER_NAMES)}")
    return names


class LlamaSampling(Body):
    # -1 = until stop / context end; absent: the server's -n (itself -1 by default)
    n_predict: Annotated[int, Field(ge=-1, le=MAX_TOKENS)] | None = None
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
    samplers: Annotated[list[str], Field(max_length=16), AfterValidator(_known_samplers)] | None = None
    stream: bool = False
    cache_prompt: bool = True  # always on: the prefix cache is how the model works; off changes no output
    n_probs: Annotated[int, Field(ge=0, le=100)] = 0   # completion_probabilities: this many alternatives
    post_sampling_probs: bool = False                   # the sampler chain's probabilities instead
    return_tokens: bool = False                         # the generated token ids in `tokens`
    id_slot: Unsupported(OneSlot, -1, 0) = None
    logit_bias: LogitBias | None = None
    timings_per_token: bool = False
    return_progress: bool = False
    verbose: bool | None = None     # `__verbose`: the same body, prompt included (None: serve --verbose)
    backend_sampling: bool = False  # llama-server samples on the GPU when true; same tokens either way
    t_max_predict_ms: Annotated[int, Field(ge=0, le=1 << 31)] | None = None
    # llama.vim sends it; llama-server does not implement it either (a prompt is always
    # evaluated in full), so it changes nothing
    t_max_prompt_ms: Annotated[int, Field(ge=-1, le=1 << 31)] | None = None
    n_indent: Annotated[int, Field(ge=0, le=1 << 16)] = 0
    response_fields: Annotated[list[str], Field(max_length=64)] | None = None
    grammar: str | None = None               # GBNF (edgeinfer.prompt.grammar)
    json_schema: dict | None = None          # the answer is JSON valid against it
    # speculative decoding, when the server runs with --draft (llama-server's dotted keys)
    speculative_n_max: int | None = Field(None, ge=0, le=63, alias="speculative.n_max")
    speculative_n_min: int | None = Field(None, ge=0, le=63, alias="speculative.n_min")
    speculative_p_min: float | None = Field(None, ge=0, le=1, alias="speculative.p_min")


# llama-server's prompt forms: text, token ids, ids and text mixed, {"prompt_string": text};
# a list of those is a batch (edgeinfer.server.llama_compat.prompts reads them)
SubPrompt = Union[str, dict, Annotated[list[Union[int, str]], Field(max_length=1 << 20)]]
LlamaPrompt = Union[str, dict, Annotated[list[Union[int, str, dict, Annotated[list[Union[int, str]],
                                                                               Field(max_length=1 << 20)]]],
                                         Field(max_length=1 << 20)]]


class LlamaCompletionRequest(LlamaSampling):
    prompt: LlamaPrompt
    response_format: ResponseFormat | None = None   # as OpenAI's; one of it, grammar, json_schema


class InfillChunk(Body):
    filename: Annotated[str, StringConstraints(max_length=4096)] = "tmp"
    text: str                        # required, as llama-server requires it
    time: int | float | None = None  # llama.vim's chunk age; llama-server does not use it either


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
    tools: Tools | None = None                     # rendered by templates that take them
    add_generation_prompt: bool | None = None      # default: true, unless a final assistant message stays open
    continue_final_message: bool | None = None     # default: a final assistant message stays open
    chat_template_kwargs: ChatTemplateKwargs | None = None


class SlotFileRequest(Body):
    """POST /slots/0?action=save|restore: the file, by name, in the --slot-save-path folder
    (checked as a plain file name by edgeinfer.server.slot_files)."""

    filename: Annotated[str, StringConstraints(min_length=1, max_length=1024)]


class SlotEraseRequest(Body):
    """POST /slots/0?action=erase takes no fields (an empty body or {})."""
