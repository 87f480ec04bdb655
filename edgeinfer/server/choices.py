"""Several answers to one request (OpenAI's `n`): one worker job runs the choices one after
another, so every choice after the first finds the prompt's K/V in the prefix cache and
prefills only its last token (evaluated again for its logits).

Choice i samples with its own seed (edgeinfer.sampling.choice_seed: choice 0 keeps the
request's, the others derive theirs), so a seeded request gives the same n answers on every
run. Chunks carry their choice's `index`; after the last choice one more chunk, index -1,
carries the total: the prompt counted once, the completion tokens of every choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from edgeinfer.results import FinishReason, GenerationChunk, Timings, TokenLogprob, Usage

StartFor = Callable[[dict], Callable]   # sampling params -> a worker start function
TOTAL = -1                              # the index of the closing total chunk


def several(start_for: StartFor, n: int, params: dict):
    """A worker start function for n choices of `start_for(params)` (n = 1: that one)."""
    if n == 1:
        return start_for(params)
    from edgeinfer.sampling import choice_seed

    return in_turn([start_for({**params, "seed": choice_seed(params.get("seed"), i)}) for i in range(n)])


def in_turn(starts: list[Callable]) -> Callable:
    """One worker start function running `starts` one after another: each chunk tagged with
    its start's index, then the closing total (index -1)."""
    def run(cancel) -> Iterator[GenerationChunk]:
        finals: list[GenerationChunk] = []
        for i, start in enumerate(starts):
            for chunk in start(cancel):
                if chunk.finish_reason is not None:
                    finals.append(chunk)
                yield replace(chunk, index=i)
            if cancel.is_set():
                break
        yield total(finals)

    return run


def total(finals: list[GenerationChunk]) -> GenerationChunk:
    """One closing chunk for several choices' final chunks: usage with the prompt once and
    every choice's completion tokens, the first choice's prompt timings (the prefill that
    counted) and the decode time of all; cancelled if any choice was."""
    u = [c.usage for c in finals if c.usage is not None]
    t = [c.timings for c in finals if c.timings is not None]
    usage = Usage(prompt_tokens=u[0].prompt_tokens if u else 0,
                  completion_tokens=sum(x.completion_tokens for x in u),
                  cached_tokens=u[0].cached_tokens if u else 0)
    timings = None
    if t:
        gen_s = sum(x.gen_s for x in t)
        n_after_first = sum(max(x.completion_tokens - 1, 0) for x in u)
        timings = Timings(ttft_s=t[0].ttft_s, prompt_tps=t[0].prompt_tps, prompt_s=t[0].prompt_s,
                          gen_s=gen_s, gen_tps=n_after_first / gen_s if gen_s > 0 else 0.0,
                          tpot_s=gen_s / n_after_first if n_after_first else 0.0,
                          draft_n=sum(x.draft_n for x in t), draft_n_accepted=sum(x.draft_n_accepted for x in t))
    reasons = [c.finish_reason for c in finals]
    finish = FinishReason.CANCELLED if FinishReason.CANCELLED in reasons or not reasons else reasons[-1]
    return GenerationChunk(text="", token=None, finish_reason=finish, usage=usage, timings=timings,
                           index=TOTAL)


@dataclass
class Choice:
    """One choice of a whole (non-streamed) answer."""

    index: int
    text: str = ""
    finish_reason: str = FinishReason.CANCELLED   # until its final chunk says otherwise
    logprobs: list[TokenLogprob] = field(default_factory=list)


def gather(chunks: list[GenerationChunk], n: int) -> list[Choice]:
    """The n choices of a collected answer, in index order."""
    out = [Choice(i) for i in range(n)]
    parts: list[list[str]] = [[] for _ in range(n)]
    for c in chunks:
        if not 0 <= c.index < n:
            continue
        parts[c.index].append(c.text)
        if c.logprobs is not None:
            out[c.index].logprobs.append(c.logprobs)
        if c.finish_reason is not None:
            out[c.index].finish_reason = c.finish_reason
    for choice, p in zip(out, parts):
        choice.text = "".join(p)
    return out
