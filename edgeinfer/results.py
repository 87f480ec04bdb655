"""Public result types for generation: streamed chunks, the final result, usage, timings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class FinishReason:
    """Why generation ended; the strings the OpenAI / Ollama APIs use."""

    STOP = "stop"            # EOS/EOT token or a stop string
    LENGTH = "length"        # max_tokens reached or the context window is full
    CANCELLED = "cancelled"  # the caller (or a disconnected client) stopped it

    ALL = (STOP, LENGTH, CANCELLED)


@dataclass
class Usage:
    """Token counts; cached_tokens is the part of prompt_tokens reused from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    """Latency figures in llama-server / llama-bench vocabulary (seconds, tokens/s)."""

    ttft_s: float      # request start -> first token sampled
    prompt_tps: float  # prompt tokens evaluated / prompt_s
    gen_tps: float     # tokens after the first / gen_s
    prompt_s: float    # prefill time (= ttft_s: prefill ends with the first sample)
    gen_s: float       # first token -> last token
    tpot_s: float      # time per output token after the first (mean inter-token latency)
    draft_n: int = 0           # speculative decoding: tokens drafted and verified
    draft_n_accepted: int = 0  # of those, the ones kept

    @property
    def acceptance_rate(self) -> float:
        return self.draft_n_accepted / self.draft_n if self.draft_n else 0.0

    @classmethod
    def from_clock(
        cls,
        t_start: float,
        t_first_token: float | None,
        t_end: float,
        n_prompt_tokens_evaluated: int,
        n_generated: int,
    ) -> "Timings":
        """Build from perf_counter stamps; t_first_token is None when nothing was generated.

        n_prompt_tokens_evaluated counts only the tokens actually prefilled (a prefix-cache
        hit is not evaluated); decode rates use n_generated - 1 because the first token's
        time belongs to the prefill.
        """
        if t_first_token is None:
            t_first_token = t_end
        prompt_s = max(t_first_token - t_start, 0.0)
        gen_s = max(t_end - t_first_token, 0.0)
        n_after_first = max(n_generated - 1, 0)
        prompt_tps = n_prompt_tokens_evaluated / prompt_s if prompt_s > 0 else 0.0
        gen_tps = n_after_first / gen_s if gen_s > 0 else 0.0
        tpot_s = gen_s / n_after_first if n_after_first > 0 else 0.0
        return cls(ttft_s=prompt_s, prompt_tps=prompt_tps, gen_tps=gen_tps,
                   prompt_s=prompt_s, gen_s=gen_s, tpot_s=tpot_s)


class TokenLogprob(NamedTuple):
    """One generated token's log-probability and the most likely alternatives
    (edgeinfer.sampling.token_logprobs says which distribution)."""

    token: int
    logprob: float                  # natural log
    top: list[tuple[int, float]]    # (token id, logprob), most likely first, ties by lower id


@dataclass(frozen=True)
class PromptProgress:
    """How far the prompt's evaluation has come (llama-server's prompt_progress): its tokens,
    those found in the cache, those evaluated so far (the cached ones included), milliseconds."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def to_dict(self) -> dict:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}


@dataclass
class GenerationChunk:
    """One streamed piece; the last chunk carries finish_reason, usage and timings.

    `logprobs` rides on a token's chunk when the request asked for them; `index` is the
    choice a chunk belongs to when one request asks for several (OpenAI's n). A chunk with
    `prompt_progress` (asked for with prompt_progress=True) carries no text and no token."""

    text: str
    token: int | None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    logprobs: TokenLogprob | None = None
    index: int = 0
    prompt_progress: PromptProgress | None = None
    stop_word: str | None = None   # on the final chunk: the stop string that ended the answer, if one did


@dataclass
class GenerationResult:
    """A finished, non-streamed generation."""

    text: str
    tokens: list[int]
    finish_reason: str
    usage: Usage
    timings: Timings
    logprobs: list[TokenLogprob] | None = None   # one per token, when asked for
