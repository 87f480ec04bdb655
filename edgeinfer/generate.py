"""The decode loop: prefill, then sample -> stream text -> check stops -> decode, until done.

`stream_generate` is a generator of `GenerationChunk`s; the last chunk carries
`finish_reason`, `usage` and `timings`. It runs on a KV cache that may already hold a
prefix of the prompt (`n_cached` tokens), so only the rest is evaluated.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from edgeinfer.engine import Engine
from edgeinfer.errors import ContextOverflowError
from edgeinfer.kv.recurrent import keep_rollback
from edgeinfer.kv.view import KVView
from edgeinfer.results import (FinishReason, GenerationChunk, GenerationResult, PromptProgress, Timings,
                               TokenLogprob, Usage)
from edgeinfer.sampling import SamplingParams, make_token_sampler, post_sampling_probs, token_logprobs
from edgeinfer.stopping import StopStringMatcher
from edgeinfer.vision.media_ids import text_only

if TYPE_CHECKING:
    from edgeinfer.speculative import Speculation
    from edgeinfer.vision.media_ids import MediaRows


def check_prompt_fits(n_prompt: int, n_ctx: int) -> None:
    if n_prompt >= n_ctx:
        raise ContextOverflowError(
            f"prompt has {n_prompt} tokens but the context holds {n_ctx}; "
            f"shorten it or raise --ctx-size", n_prompt=n_prompt, n_ctx=n_ctx)


def stream_generate(engine: Engine, kv: KVView, tokenizer, prompt: Sequence[int],
                    params: SamplingParams, *, cancel: threading.Event | None = None,
                    progress=None, make_room: Callable[[], bool] | None = None,
                    speculation: "Speculation | None" = None,
                    report_progress: bool = False, media: "MediaRows | None" = None) -> Iterator[GenerationChunk]:
    """Generate after `prompt`; `kv` must already hold exactly the prompt's first kv.n_used tokens.

    When the window is full, `make_room()` (a context shift) may free space and return True
    to go on; without it, or when it returns False, generation ends with finish_reason length.

    With `speculation` (edgeinfer.speculative), a step runs the sampled token and a drafted
    continuation in one forward pass; each next token is still sampled from its own logits
    row as without it, and a row is used only while the sampled tokens equal the drafted
    ones (greedy output is the same token for token; sampling keeps its distribution and
    its random draws). K/V of drafted tokens not taken are truncated off before anything
    else touches `kv` (a context shift, the next step, the end of the request).

    `report_progress` yields a PromptProgress chunk before the prompt's first evaluated chunk
    and after each one (llama-server's return_progress).

    `media`: the images whose ids the prompt holds (edgeinfer.vision.media_ids); samplers and
    drafts read only the prompt's text ids.
    """
    from edgeinfer.tokenizer import StreamDecoder

    params.validate()
    prompt = list(prompt)
    check_prompt_fits(len(prompt), engine.n_ctx)
    n_cached = kv.n_used
    assert n_cached < len(prompt), "at least one prompt token must be evaluated for its logits"
    sample = make_token_sampler(params)
    # A grammar's matcher is per sequence: masks before the sampler, consumes each token.
    matcher = params.constraint.matcher(tokenizer) if params.constraint is not None else None
    # as llama-server streams: control tokens hidden, but for the chat format's markup
    decoder = StreamDecoder(tokenizer, skip_special=True, as_pieces=True, shown=frozenset(params.preserved_tokens))
    stopper = StopStringMatcher(params.stop)

    t_start = time.perf_counter()

    def progress_chunk(done: int) -> GenerationChunk:
        ms = (time.perf_counter() - t_start) * 1e3
        return GenerationChunk("", None, prompt_progress=PromptProgress(len(prompt), n_cached, n_cached + done, ms))

    if report_progress:
        yield progress_chunk(0)
    if media is not None:  # where the prompt's images sit: the M-RoPE positions of all that follows
        media = media.placed(prompt)
    logits = None
    for done, total, logits in engine.prefill_steps(prompt[n_cached:], kv, media=media):
        if progress is not None:
            progress(done, total)
        if report_progress:
            yield progress_chunk(done)
    t_first: float | None = None
    history = list(prompt) if media is None else text_only(prompt)
    generated: list[int] = []
    finish = FinishReason.LENGTH
    # -1 = until the model stops; with a context shift that could be forever, so cap it at
    # n_ctx tokens as before (llama.cpp's n_predict=-1 is unbounded; ours stays finite).
    max_tokens = params.max_tokens if params.max_tokens >= 0 else engine.n_ctx
    spec = speculation
    drafts: list[tuple[int, np.ndarray]] = []  # (drafted token, logits after it), K/V written
    if spec is not None:
        spec.begin(list(history))

    try:
        while len(generated) < max_tokens:
            if cancel is not None and cancel.is_set():
                finish = FinishReason.CANCELLED
                break
            raw = logits  # the model's distribution, for logprobs (the mask makes a copy)
            if matcher is not None:
                logits = matcher.mask(logits)
            token = sample(logits, history)
            if t_first is None:
                t_first = time.perf_counter()
            if tokenizer.is_eog(token):
                finish = FinishReason.STOP
                break
            ahead = None  # the logits after `token` when the draft guessed it (K/V written)
            if drafts:
                if drafts[0][0] == token:
                    ahead = drafts.pop(0)[1]
                    spec.hit()
                else:  # the rest of the draft is wrong: cut it before the token is recorded
                    kv.truncate(kv.n_used - len(drafts))
                    drafts.clear()
            lp = _logprobs(raw, logits, history, token, params) if params.logprobs is not None else None
            generated.append(token)
            history.append(token)
            if matcher is not None:
                matcher.advance(token)
            text, stopped = stopper.push(decoder.push(token))
            yield GenerationChunk(text=text, token=token, logprobs=lp)  # text may be "" while bytes/stops are held
            if stopped or (matcher is not None and matcher.is_stopped()):
                finish = FinishReason.STOP  # a stop string, or the grammar is complete
                break
            if len(generated) >= max_tokens:
                break
            if ahead is not None:
                logits = ahead
                continue
            if spec is not None:
                spec.end_round()
            if kv.n_used >= kv.n_ctx and (make_room is None or not make_room()):
                finish = FinishReason.LENGTH  # no room for this token's K/V: the window is full
                break
            if spec is None:
                logits = engine.decode(token, kv, media)
                continue
            # room for the token, the draft and one more sample after the draft
            limit = min(kv.n_ctx - kv.n_used - 1, max_tokens - len(generated) - 1)
            proposal, draft_s = spec.draft(history, limit)
            t = time.perf_counter()
            if not proposal:
                logits = engine.decode(token, kv, media)
                spec.plain_step(time.perf_counter() - t)
                continue
            n = 1 + len(proposal)
            keep_rollback(kv, kv.n_used, kv.n_used + n)  # rejected drafts are cut back: a state keeps copies
            rows = engine.forward(np.array([token, *proposal]), np.arange(kv.n_used, kv.n_used + n), kv,
                                  logits_for=np.arange(n), decode_bits=True, media=media)
            spec.start_round(len(proposal), time.perf_counter() - t, draft_s)
            logits = rows[0]
            drafts = list(zip(proposal, rows[1:]))
    finally:
        if drafts:  # drafted tokens never sampled: their K/V go before the sequence is kept
            kv.truncate(kv.n_used - len(drafts))
            drafts.clear()
        if spec is not None:
            spec.end_round()

    tail = ""
    if not stopper.stopped:  # bytes held by the decoder may still complete a stop string
        tail, stopped = stopper.push(decoder.flush())
        if stopped:
            finish = FinishReason.STOP
        else:
            tail += stopper.flush()
    t_end = time.perf_counter()
    usage = Usage(prompt_tokens=len(prompt), completion_tokens=len(generated), cached_tokens=n_cached)
    timings = Timings.from_clock(t_start, t_first, t_end, len(prompt) - n_cached, len(generated))
    if spec is not None:
        timings.draft_n, timings.draft_n_accepted = spec.drafted, spec.accepted
    yield GenerationChunk(text=tail, token=None, finish_reason=finish, usage=usage, timings=timings,
                          stop_word=stopper.matched)


def _logprobs(raw: np.ndarray, masked: np.ndarray, history: list[int], token: int,
              params: SamplingParams) -> TokenLogprob:
    """The chosen token's log-probability: of the model (raw logits), or with
    post_sampling_probs of the sampler chain (after the grammar's mask)."""
    if params.post_sampling_probs:
        return post_sampling_probs(masked, history, token, params, params.logprobs)
    return token_logprobs(raw, token, params.logprobs)


def prompt_logprobs(engine: Engine, prompt: Sequence[int], top_n: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it (None for the first,
    which follows nothing): one pass over the prompt on a scratch cache of its own length,
    logits for every row, a prefill chunk at a time. The generation's cache is untouched."""
    ids = np.asarray(list(prompt), dtype=np.int64)
    check_prompt_fits(len(ids), engine.n_ctx)
    # the backend's own cache of the run's K/V types: the same logits as generation
    kv = engine.backend.new_cache(engine.config, max(len(ids), 1), getattr(engine, "cache_types", None))
    out: list[TokenLogprob | None] = [None]
    cuts = engine.chunk_bounds(len(ids))
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        rows = engine.forward(ids[lo:hi], np.arange(lo, hi), kv, logits_for=np.arange(hi - lo))
        for j in range(hi - lo):
            if lo + j + 1 < len(ids):  # row j predicts the token after it
                out.append(token_logprobs(rows[j], int(ids[lo + j + 1]), top_n))
    return out


def collect(chunks: Iterator[GenerationChunk]) -> GenerationResult:
    """Drain a stream into one result."""
    parts: list[str] = []
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    last = None
    for chunk in chunks:
        parts.append(chunk.text)
        if chunk.token is not None:
            tokens.append(chunk.token)
        if chunk.logprobs is not None:
            logprobs.append(chunk.logprobs)
        last = chunk
    assert last is not None and last.finish_reason is not None
    return GenerationResult(text="".join(parts), tokens=tokens, finish_reason=last.finish_reason,
                            usage=last.usage, timings=last.timings, logprobs=logprobs or None)

