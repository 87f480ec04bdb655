"""Token sampling: logits processors (penalties) and a sampler chain.

The chain follows llama.cpp's default `common_sampler` order, minus the samplers
edgeinfer does not offer (dry, top-n-sigma, typical, xtc):

    penalties -> top_k -> top_p -> min_p -> temperature -> dist

Filters run *before* temperature, so which tokens survive does not depend on the
temperature; temperature only reshapes the distribution over the survivors.
temperature <= 0 is greedy: argmax over the penalised logits (every filter keeps
the argmax, so skipping them gives the same token).

Style follows mlx-lm: factories return small callables.
  processor(logits, previous_token_ids) -> new logits   (input never modified)
  sampler(logits) -> token id
Filters work on a candidate list (ids + float64 logits, like llama.cpp's
`llama_token_data_array`) so a 262k vocabulary is cut to k entries with one
`np.argpartition`; with top-k off, top-p buckets the logits instead of sorting
them all. Probabilities are computed in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from edgeinfer.errors import EdgeInferError
from edgeinfer.results import TokenLogprob

LogitsProcessor = Callable[[np.ndarray, Sequence[int]], np.ndarray]
Sampler = Callable[[np.ndarray], int]


MAX_LOGPROBS = 100   # alternatives per token; OpenAI allows 20, llama-server's n_probs more


class InvalidParameterError(EdgeInferError, ValueError):
    """A sampling parameter outside its allowed range (one line: name, value, range)."""


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------

@dataclass
class SamplingParams:
    """Generation parameters; defaults are llama.cpp's (`common_params_sampling`)."""

    temperature: float = 0.8
    top_k: int = 40            # 0 = off
    top_p: float = 0.95        # 1.0 = off
    min_p: float = 0.05        # 0.0 = off
    seed: int | None = None    # None or -1 = random
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64    # 0 = no penalties, -1 = all previous tokens
    max_tokens: int = -1       # -1 = unlimited (until stop / context end)
    stop: list[str] = field(default_factory=list)
    # A compiled edgeinfer.prompt.grammar.Constraint (JSON schema, GBNF, regex...): its mask is
    # applied before the chain, per sequence (the decode loop makes the matcher).
    constraint: Any = field(default=None, repr=False)
    # Log-probabilities carried on each chunk: None = off, N = the chosen token's and the N
    # most likely alternatives (see token_logprobs). post_sampling_probs: llama-server's
    # variant, probabilities after the sampler chain instead (see post_sampling_probs).
    logprobs: int | None = None
    post_sampling_probs: bool = False
    # token id -> added to its logit before everything else (-inf bans it), as llama.cpp's
    # logit_bias sampler; the OpenAI / llama-server request forms are read by the server
    logit_bias: dict[int, float] | None = None
    # control tokens the answer's text shows (otherwise they decode to nothing): the markup a
    # chat format's reader needs, harmony's channels or Gemma 4's (llama.cpp's preserved_tokens)
    preserved_tokens: frozenset[int] = field(default_factory=frozenset)

    def validate(self) -> "SamplingParams":
        """Raise InvalidParameterError on the first out-of-range field; return self."""
        _check_float("temperature", self.temperature, lambda v: v >= 0, ">= 0")
        _check_int("top_k", self.top_k, lambda v: v >= 0, ">= 0 (0 = off)")
        _check_float("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check_float("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        if self.seed is not None:
            _check_int("seed", self.seed, lambda v: -1 <= v < 2**64, "-1 (random) or in [0, 2^64)")
        _check_float("repeat_penalty", self.repeat_penalty, lambda v: v > 0, "> 0")
        # OpenAI's documented range; also keeps a request from pushing logits to inf.
        _check_float("presence_penalty", self.presence_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]")
        _check_float("frequency_penalty", self.frequency_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]")
        _check_int("repeat_last_n", self.repeat_last_n, lambda v: v >= -1, ">= -1 (-1 = all, 0 = off)")
        _check_int("max_tokens", self.max_tokens, lambda v: v >= -1, ">= 0 or -1 (unlimited)")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidParameterError("stop must be a list of strings")
        if any(s == "" for s in self.stop):
            raise InvalidParameterError("stop strings must not be empty")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParameterError("logit_bias must map token ids to biases")
            for tok, bias in self.logit_bias.items():
                _check_int("logit_bias token", tok, lambda v: v >= 0, ">= 0")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias) \
                        or bias == math.inf:
                    raise InvalidParameterError(f"logit_bias of token {tok} must be a number or -inf, got {bias!r}")
        if not isinstance(self.preserved_tokens, (frozenset, set)) or \
                not all(isinstance(t, int) and t >= 0 for t in self.preserved_tokens):
            raise InvalidParameterError("preserved_tokens must be a set of token ids")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]")
        if self.constraint is not None and not hasattr(self.constraint, "matcher"):
            raise InvalidParameterError("constraint must be an edgeinfer.prompt.grammar.Constraint "
                                        "(edgeinfer.prompt.grammar.json_schema(...), gbnf(...), regex(...))")
        return self

    def make_sampler(self) -> Sampler:
        return make_sampler(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)

    def make_logits_processors(self) -> list[LogitsProcessor]:
        procs = make_logits_processors(self.repeat_penalty, self.presence_penalty,
                                       self.frequency_penalty, self.repeat_last_n)
        if self.logit_bias:
            procs.insert(0, logit_bias_processor(self.logit_bias))
        return procs


def logit_bias_processor(bias: dict[int, float]) -> LogitsProcessor:
    """Add each token's bias to its logit (-inf bans the token); ids past the logits are skipped."""
    ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    values = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))

    def process(logits: np.ndarray, previous_token_ids: Sequence[int]) -> np.ndarray:
        out = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
        ok = ids < out.shape[0]
        np.add.at(out, ids[ok], values[ok].astype(np.float32))
        return out

    return process


def _check_float(name: str, value, ok: Callable[[float], bool], allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise InvalidParameterError(f"{name} must be a number {allowed}, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or not ok(v):
        raise InvalidParameterError(f"{name} must be {allowed}, got {value!r}")


def _check_int(name: str, value, ok: Callable[[int], bool], allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidParameterError(f"{name} must be an integer {allowed}, got {value!r}")
    if not ok(int(value)):
        raise InvalidParameterError(f"{name} must be {allowed}, got {value!r}")


# ---------------------------------------------------------------------------
# Logits processors
# ---------------------------------------------------------------------------

def apply_penalties(
    logits: np.ndarray,            # (n_vocab,)
    previous_token_ids: Sequence[int],
    repeat_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    last_n: int = 64,
) -> np.ndarray:
    """llama.cpp's penalties sampler over the last `last_n` tokens; returns a new array.

    For each token seen c > 0 times: a logit <= 0 is multiplied by repeat_penalty,
    a positive one divided by it; then c * frequency + presence is subtracted.
    """
    out = np.array(logits, copy=True)
    if last_n == 0 or len(previous_token_ids) == 0:
        return out
    # Slice before converting: the history is the whole context, the window is short.
    window = np.asarray(previous_token_ids[-last_n:] if last_n > 0 else previous_token_ids,
                        dtype=np.int64)
    window = window[(window >= 0) & (window < out.shape[0])]  # ids the vocab cannot hold are ignored
    ids, counts = np.unique(window, return_counts=True)
    if ids.size == 0:
        return out
    vals = out[ids].astype(np.float64)
    vals = np.where(vals <= 0, vals * repeat_penalty, vals / repeat_penalty)
    vals -= counts * frequency_penalty + presence_penalty
    out[ids] = vals
    return out


def make_repetition_penalty(
    repeat_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    last_n: int = 64,
) -> LogitsProcessor:
    def penalties(logits: np.ndarray, previous_token_ids: Sequence[int]) -> np.ndarray:
        return apply_penalties(logits, previous_token_ids, repeat_penalty,
                               presence_penalty, frequency_penalty, last_n)
    return penalties


def make_logits_processors(
    repeat_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    last_n: int = 64,
) -> list[LogitsProcessor]:
    """Processors to run in order before the sampler; empty when penalties are neutral.

    `previous_token_ids` is what llama.cpp's sampler has accepted: prompt + generated.
    """
    neutral = repeat_penalty == 1.0 and presence_penalty == 0.0 and frequency_penalty == 0.0
    if neutral or last_n == 0:
        return []
    return [make_repetition_penalty(repeat_penalty, presence_penalty, frequency_penalty, last_n)]


# ---------------------------------------------------------------------------
# Candidate filters (llama.cpp's llama_token_data_array, as two arrays)
# ---------------------------------------------------------------------------

class Candidates(NamedTuple):
    ids: np.ndarray        # (n,) int64 token ids
    logits: np.ndarray     # (n,) float64
    sorted: bool           # True when logits are in descending order


def all_candidates(logits: np.ndarray) -> Candidates:
    return Candidates(np.arange(logits.shape[0], dtype=np.int64), logits.astype(np.float64), False)


def softmax(logits: np.ndarray) -> np.ndarray:
    """float64 softmax; -inf entries get probability 0."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - np.max(x))
    return e / e.sum()


def top_k_candidates(logits: np.ndarray, k: int) -> Candidates:
    """The k largest logits of the full vocabulary, sorted descending (k <= 0: all, unsorted)."""
    n = logits.shape[0]
    if k <= 0 or k >= n:
        return all_candidates(logits)
    # argpartition on the float32 input: O(n), then sort only the k winners.
    part = np.argpartition(logits, n - k)[n - k:]
    vals = logits[part].astype(np.float64)
    order = np.argsort(-vals, kind="stable")
    return Candidates(part[order].astype(np.int64), vals[order], True)


_TOP_P_BUCKETS = 1024
_TOP_P_SPAN = 40.0   # nats below the max; exp(-40) ~ 4e-18 of the max token's weight


def top_p_filter(c: Candidates, p: float) -> Candidates:
    """Keep the smallest descending prefix whose probability mass reaches p (llama.cpp: cum >= p)."""
    if p >= 1.0 or c.ids.size <= 1:
        return c
    if c.sorted:
        cut = _top_p_cut(softmax(c.logits), p)
        return Candidates(c.ids[:cut], c.logits[:cut], True)
    # Unsorted (top_k off, full vocabulary): bucket the logits by distance from the
    # max (llama.cpp does the same), find the bucket where the cumulative mass crosses
    # p, and sort only that bucket. O(n) instead of sorting 262k entries.
    x = c.logits
    x_max = np.max(x)
    w = np.exp(x - x_max)                         # unnormalised probabilities, float64
    target = p * w.sum()
    span = x_max - np.min(x)
    if not (0 < span <= _TOP_P_SPAN):             # -inf entries or a long tail: weights
        span = _TOP_P_SPAN if span > 0 else 1.0   # past 40 nats all land in the last bucket
    bucket = np.minimum((x_max - x) * (_TOP_P_BUCKETS / span), _TOP_P_BUCKETS - 1).astype(np.int64)
    cum = np.cumsum(np.bincount(bucket, weights=w, minlength=_TOP_P_BUCKETS))
    j = min(int(np.searchsorted(cum, target, side="left")), _TOP_P_BUCKETS - 1)
    in_j = np.flatnonzero(bucket == j)            # ascending ids, so ties keep the lowest id
    in_j = in_j[np.argsort(-x[in_j], kind="stable")]
    before = cum[j - 1] if j > 0 else 0.0
    cut = min(int(np.searchsorted(before + np.cumsum(w[in_j]), target, side="left")) + 1, in_j.size)
    keep = bucket < j
    keep[in_j[:cut]] = True
    return Candidates(c.ids[keep], c.logits[keep], False)


def _top_p_cut(sorted_probs: np.ndarray, p: float) -> int:
    cum = np.cumsum(sorted_probs)
    cut = int(np.searchsorted(cum, p, side="left")) + 1  # first index with cum >= p, inclusive
    return min(cut, sorted_probs.size)


def min_p_filter(c: Candidates, p: float) -> Candidates:
    """Keep tokens with prob >= p * max prob, i.e. logit >= max_logit + log(p)."""
    if p <= 0.0 or c.ids.size <= 1:
        return c
    threshold = np.max(c.logits) + math.log(p)
    keep = c.logits >= threshold   # keeps order, so a sorted list stays sorted
    return Candidates(c.ids[keep], c.logits[keep], c.sorted)


# ---------------------------------------------------------------------------
# Final pick
# ---------------------------------------------------------------------------

def sample_argmax(logits: np.ndarray) -> int:
    """Greedy: the first index of the largest logit (llama.cpp's greedy sampler)."""
    return int(np.argmax(logits))


def sample_dist(c: Candidates, temperature: float, rng: np.random.Generator) -> int:
    """Draw one token from softmax(logits / temperature) over the candidates."""
    w = c.logits - np.max(c.logits)               # fresh float64 array, safe to reuse in place
    w *= 1.0 / temperature
    np.exp(w, out=w)
    cum = np.cumsum(w, out=w)                     # unnormalised: draw r in [0, total)
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    return int(c.ids[min(i, c.ids.size - 1)])


def make_rng(seed: int | None) -> np.random.Generator:
    """A seeded generator; None or -1 draws fresh OS entropy (llama.cpp's LLAMA_DEFAULT_SEED)."""
    return np.random.default_rng(None if seed is None or seed == -1 else int(seed))


def filter_candidates(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> Candidates:
    """top_k -> top_p -> min_p, as llama.cpp's default chain orders them."""
    c = top_k_candidates(logits, top_k)
    c = top_p_filter(c, top_p)
    return min_p_filter(c, min_p)


def make_sampler(
    temperature: float = 0.8,
    top_k: int = 40,
    top_p: float = 0.95,
    min_p: float = 0.05,
    seed: int | None = None,
) -> Sampler:
    """sampler(logits (n_vocab,) float32) -> token id; the RNG lives in the closure."""
    if temperature <= 0:
        return sample_argmax
    rng = make_rng(seed)

    def sampler(logits: np.ndarray) -> int:
        logits = np.asarray(logits).reshape(-1)
        return sample_dist(filter_candidates(logits, top_k, top_p, min_p), temperature, rng)

    return sampler


def make_token_sampler(params: SamplingParams) -> Callable[[np.ndarray, Sequence[int]], int]:
    """Processors + sampler in one call: f(logits, previous_token_ids) -> token id."""
    params.validate()
    processors = params.make_logits_processors()
    sampler = params.make_sampler()

    def sample(logits: np.ndarray, previous_token_ids: Sequence[int]) -> int:
        for proc in processors:
            logits = proc(logits, previous_token_ids)
        return sampler(logits)

    return sample


# ---------------------------------------------------------------------------
# Log-probabilities and per-choice seeds
# ---------------------------------------------------------------------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax; -inf entries stay -inf."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = np.max(x)
    return x - (m + math.log(np.exp(x - m).sum()))


def token_logprobs(logits: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    """The model's log-probability of `token` and its `top_n` most likely tokens.

    Taken on the raw logits, before penalties, grammar masks, top-k/p/min-p and temperature,
    as OpenAI defines them and as llama-server's `n_probs` reports them (a plain softmax of
    the logits, whatever the sampler settings): the values describe the model, not the
    sampler, so they sum to at most 1 over any subset and do not change with temperature.
    """
    lp = log_softmax(logits)
    top: list[tuple[int, float]] = []
    if top_n > 0:
        n = lp.shape[0]
        k = min(top_n, n)
        part = np.argpartition(-lp, k - 1)[:k] if k < n else np.arange(n)
        order = part[np.lexsort((part, -lp[part]))]   # descending, ties by the lower id
        top = [(int(i), float(lp[i])) for i in order]
    return TokenLogprob(int(token), float(lp[int(token)]), top)


def post_sampling_probs(logits: np.ndarray, previous_token_ids: Sequence[int], token: int,
                        params: SamplingParams, top_n: int) -> TokenLogprob:
    """llama-server's `post_sampling_probs`: probabilities over the candidates the chain left
    (penalties, top-k, top-p, min-p, then temperature), as the last sampler drew from them;
    greedy leaves only the chosen token, at probability 1. Values are natural logs here;
    tokens the chain cut have probability 0 and are not listed."""
    for proc in params.make_logits_processors():
        logits = proc(logits, previous_token_ids)
    logits = np.asarray(logits).reshape(-1)
    if params.temperature <= 0:
        return TokenLogprob(int(token), 0.0, [(int(token), 0.0)] if top_n > 0 else [])
    c = filter_candidates(logits, params.top_k, params.top_p, params.min_p)
    lp = log_softmax(c.logits / params.temperature)
    where = np.flatnonzero(c.ids == token)
    chosen = float(lp[where[0]]) if where.size else -math.inf
    order = np.lexsort((c.ids, -lp))[:top_n]
    return TokenLogprob(int(token), chosen, [(int(c.ids[i]), float(lp[i])) for i in order])


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed` (OpenAI's n > 1): choice 0
    keeps it, so it answers as the same request with n = 1 does; the others derive theirs
    from (seed, index) through numpy's SeedSequence, the same on every machine and run.
    An unseeded request stays unseeded: every choice draws fresh entropy."""
    if seed is None or seed == -1 or index == 0:
        return seed
    state = np.random.SeedSequence(int(seed), spawn_key=(int(index),)).generate_state(2, np.uint32)
    return int(state[0]) | (int(state[1]) & 0x7FFFFFFF) << 32   # below 2^63, as Seed fields are
