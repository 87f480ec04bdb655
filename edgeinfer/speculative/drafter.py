"""The drafter interface and the per-request state of speculative decoding.

A drafter proposes the tokens it expects to follow a context; the decode loop
(edgeinfer.generate) runs the last sampled token and the proposal through the model in one
forward pass, then samples each position in turn as plain decoding would and keeps the
proposal's logits only while the sampled token equals the drafted one. Rejected tokens'
K/V are cut off with the sequence's truncate.

Our drafters draft deterministically (prompt lookup, a draft model's argmax): their
proposal distribution q is a point mass. Standard speculative sampling then accepts a
drafted token d with probability min(1, p(d)/q(d)) = p(d) and otherwise resamples from the
residual max(0, p - q), which is p without d, renormalised. Sampling x ~ p and accepting d
iff x == d is that same rule: P(x = d) = p(d); for y != d, P(y) = (1 - p(d)) p(y)/(1 - p(d))
= p(y). So the loop samples every token from the target's own sampler chain (penalties,
grammar mask, top-k/p, temperature), one random draw per token as without speculation: a
seeded run gives the same tokens with and without a drafter. `accept_speculative` is the
general rule, for a drafter that reports a proposal distribution (`probs`).

The drafter protocol (`Drafter`), all the decode loop needs of a drafter, through
`Speculation`:
- `begin(prompt)` when a request starts;
- `propose(context, k)`: up to k tokens expected after `context`, the request's whole
  token history so far; [] = decode plainly this step;
- `accept(n_drafted, n_accepted)`: after the verification of the last proposal, how many
  of its tokens were kept (called before the next `propose`);
- optional `observe(context)`: the loop's own history list, handed over once per request
  (it grows in place, so a drafter that learns from whole requests reads it later);
- optional `close()`: the session ends (a drafter with files writes them).
The drafters: `PromptLookup` (the context's n-grams), `NgramLookup` (`--draft lookup`: the
context, the session's earlier requests and the `--lookup-cache-static/-dynamic` files,
edgeinfer.speculative.ngram_lookup) and `DraftModel` (a small model of the same vocabulary).

Multi-token-prediction heads (a model's MTP tensors, as Qwen3.5 and DeepSeek-V3 carry)
plug in as one more drafter, an `MtpDrafter`, without a change to the loop: it holds the
target's Engine; `accept(n_drafted, n_accepted)` tells it which row of the last forward
pass (the verification batch, or the plain step's single row) is the last kept token, so
`propose(context, k)` runs the MTP head(s) on that row's final hidden state and the
embedding of `context[-1]`, chaining a head's output into the next for k > 1. The one
thing it needs beyond this module is the hidden states of the last forward pass from the
Engine (a `last_hidden` rows array beside the logits). Its proposals are point masses
too (argmax) or come with `probs` for `accept_speculative`.

`DraftLength` picks k from what verification costs on this machine: the measured time of a
forward pass of n rows against a plain decode step, per n (see its docstring), kept per
drafter across requests (`BatchCosts`), so when short batches get cheaper the drafts
get longer by themselves.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from edgeinfer.sampling import InvalidParameterError

MAX_DRAFT = 63  # verify batches of up to 64 rows take the decode path's arithmetic


def confident_argmax(logits: np.ndarray, p_min: float) -> int | None:
    """The argmax token of `logits`, or None when its probability is below p_min (a model
    drafter's stop rule)."""
    x = np.asarray(logits, dtype=np.float64)
    tok = int(np.argmax(x))
    if p_min > 0 and 1.0 / np.exp(x - x[tok]).sum() < p_min:
        return None
    return tok


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens; one instance serves one request at a time."""

    name: str

    def begin(self, prompt: Sequence[int]) -> None:
        """A new request whose context starts with `prompt`."""

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens expected after `context` (the whole history so far, which only
        grows during a request); [] when there is nothing worth proposing."""

    def accept(self, n_drafted: int, n_accepted: int) -> None:
        """Feedback: of the last proposal's first n_drafted tokens, n_accepted were kept."""


@dataclass(frozen=True)
class SpeculativeParams:
    """llama.cpp's --draft-max / --draft-min / --draft-p-min (server: speculative.n_max, ...)."""

    n_max: int = 16     # at most this many drafted tokens per verification
    n_min: int = 0      # a shorter proposal is not verified (plain decode instead)
    p_min: float = 0.75  # a draft model stops drafting below this probability of its argmax
    adaptive: bool = True  # False: always ask for n_max tokens (llama.cpp's behaviour)

    def validate(self) -> "SpeculativeParams":
        if not 0 <= self.n_max <= MAX_DRAFT:
            raise InvalidParameterError(f"draft-max must be in [0, {MAX_DRAFT}], got {self.n_max}")
        if not 0 <= self.n_min <= self.n_max:
            raise InvalidParameterError(f"draft-min must be in [0, draft-max={self.n_max}], got {self.n_min}")
        if not 0.0 <= self.p_min <= 1.0:
            raise InvalidParameterError(f"draft-p-min must be in [0, 1], got {self.p_min}")
        return self


class BatchCosts:
    """What a forward pass of n rows costs here, measured as requests run: `t1` seconds per
    plain decode step (an exponential moving average) and, per batch size n, the ratio of a
    verification of n rows to a decode step (`ratio[n]`, a moving average of each
    measurement at that size); `d` seconds per drafted token. Kept per drafter across
    requests (the costs belong to the machine and the model, not to one request).

    A size never measured costs what the nearest measured size below it costs per extra row
    (its average), carried on, but no more than the next measured size above it: optimistic
    where unmeasured, so a size between two measured ones gets tried (linear interpolation
    over a cliff in batch cost, cheap up to 8 rows and dear after, made the sizes below the
    cliff look dear, and they were never measured); with no measurement at all, an extra
    row costs B_PRIOR decode steps. A size's first verification is not counted (it runs
    cold). The cost is made
    non-decreasing in n. A measurement above that prior drifts back towards it while
    nothing is verified, so one noisy measurement does not stop drafting for good.
    """

    B_PRIOR = 0.5   # an extra verified row's cost before any evidence, in decode steps
    KEEP = 0.7      # weight of the old ratio per measurement at the same size

    def __init__(self) -> None:
        self.t1: float | None = None
        self.ratio: dict[int, float] = {}   # n rows -> seconds / t1, measured sizes only
        self.seen: set[int] = set()          # sizes verified at least once (the first not counted)
        self.d = 0.0

    def prior(self, n: int) -> float:
        return 1.0 + self.B_PRIOR * (n - 1)

    def plain_step(self, seconds: float, drift: float) -> None:
        self.t1 = seconds if self.t1 is None else 0.8 * self.t1 + 0.2 * seconds
        for n, r in self.ratio.items():
            p = self.prior(n)
            if r > p:
                self.ratio[n] = r + (p - r) * drift

    def verified(self, n_rows: int, seconds: float, draft_seconds: float) -> None:
        if self.t1 is None or n_rows < 2:
            return
        obs = max(seconds / self.t1, 1.0)
        if n_rows not in self.seen:
            # a size's first verification runs cold (the logits of several rows, caches,
            # first calls: Gemma 3 270M's first 2 rows 38 ms, then 26) and is not counted:
            # one cold measurement stopped drafting for dozens of tokens, or kept a size
            # that is never tried again looking dear
            self.seen.add(n_rows)
        else:
            old = self.ratio.get(n_rows)
            self.ratio[n_rows] = obs if old is None else self.KEEP * old + (1 - self.KEEP) * obs
        self.d = 0.7 * self.d + 0.3 * (draft_seconds / (n_rows - 1))

    def ratios(self, n_max: int) -> list[float]:
        """[cost of 1 row, 2 rows, ... n_max rows] in decode steps, non-decreasing."""
        seen = sorted(self.ratio)
        out = [1.0]
        for n in range(2, n_max + 1):
            if n in self.ratio:
                r = self.ratio[n]
            else:
                lo = max((m for m in seen if m < n), default=1)
                hi = min((m for m in seen if m > n), default=None)
                r_lo = self.ratio.get(lo, 1.0)
                if lo > 1:   # the cost per extra row up to lo, carried on
                    r = r_lo + (r_lo - 1.0) / (lo - 1) * (n - lo)
                else:
                    r = self.prior(n)
                if hi is not None:   # and no dearer than the next measured size
                    r = min(r, self.ratio[hi])
            out.append(max(r, out[-1]))
        return out


class DraftLength:
    """How many tokens to draft next: the k that maximises expected tokens per second.

    Each drafted token is taken to be accepted with probability alpha (independently, given
    the ones before it were), so a draft of k yields E(k) = (1 - alpha^(k+1)) / (1 - alpha)
    tokens for one verification of k + 1 rows costing t1 * ratio(k + 1) + d * k (t1 a plain
    decode step, ratio from `BatchCosts`: what k + 1 rows measured here cost, d a drafted
    token's cost). k = 0 (plain decode) wins whenever drafting does not pay.

    alpha is the acceptance estimate over recent drafted tokens, not over verifications:
    accepted tokens against rejections (a verification that keeps all its k tokens has no
    rejection), each verification's counts fading by DECAY, on PRIOR_WEIGHT pseudo-tokens
    of PRIOR. One verification averaged as n/(n + 1) made a lone 0-of-3 weigh as much as
    several 3-of-3s and stopped drafting for a dozen tokens in quoted text. While nothing is
    drafted the counts fade (by `drift` a step), so alpha goes back towards PRIOR and the
    measured ratios towards their priors, and drafting is tried again now and then (more
    and more rarely while those tries keep failing: the drift halves after each).
    """

    PRIOR = 0.6          # alpha before any evidence, and what it drifts back to
    PRIOR_WEIGHT = 2.0   # pseudo-tokens of PRIOR in the estimate
    DECAY = 0.8          # weight of the earlier counts per verification
    DRIFT = 0.03         # per plain step, of the counts (and of the ratios towards their prior)
    LONGER_MARGIN = 1.03  # a longer draft must beat a shorter one's rate by this much
    B_PRIOR = BatchCosts.B_PRIOR

    def __init__(self, params: SpeculativeParams, costs: BatchCosts | None = None) -> None:
        self.params = params
        self.costs = costs if costs is not None else BatchCosts()
        self.accepted = 0.0   # faded count of accepted drafted tokens
        self.rejected = 0.0   # faded count of rejections
        self.drift = self.DRIFT

    @property
    def alpha(self) -> float:
        w = self.PRIOR_WEIGHT
        return (self.accepted + w * self.PRIOR) / (self.accepted + self.rejected + w)

    @property
    def t1(self) -> float | None:
        return self.costs.t1

    def next_k(self, limit: int) -> int:
        """Draft length to ask for (0 = decode plainly), at most `limit`."""
        kmax = min(self.params.n_max, limit)
        if kmax <= 0 or kmax < self.params.n_min:
            return 0
        if not self.params.adaptive:
            return kmax
        # drafts lengthen at most twofold past the largest batch measured yet, so the cost
        # curve is measured size by size (a long first draft over a cliff in batch cost
        # left every size below it unmeasured)
        kmax = min(kmax, 2 * max(self.costs.ratio, default=1))
        t1 = self.costs.t1
        if t1 is None:
            return 0  # time one plain step first: the cost model needs it
        ratios = self.costs.ratios(kmax + 1)
        d = self.costs.d
        a = min(self.alpha, 0.999)
        best, best_rate = 0, 1.0 / t1
        for k in range(max(1, self.params.n_min), kmax + 1):
            rate = (1 - a ** (k + 1)) / (1 - a) / (t1 * ratios[k] + d * k)
            if rate > best_rate * (self.LONGER_MARGIN if best else 1.0001):
                best, best_rate = k, rate
        return best

    def shadowed(self, hit: bool) -> None:
        """A token proposed while decoding plainly (not verified: Speculation's shadow
        proposals) came true or not: a one-token verification's evidence, at no cost."""
        self.accepted = self.DECAY * self.accepted + hit
        self.rejected = self.DECAY * self.rejected + (not hit)
        if hit:
            self.drift = self.DRIFT

    def plain_step(self, seconds: float) -> None:
        self.costs.plain_step(seconds, self.drift)
        # no evidence while decoding plainly: the counts fade, alpha goes back towards its
        # prior (a run of rejections must not stop drafting for good)
        self.accepted *= 1 - self.drift
        self.rejected *= 1 - self.drift

    def verified(self, k: int, n_accepted: int, seconds: float, draft_seconds: float) -> None:
        if k > 0:
            self.costs.verified(k + 1, seconds, draft_seconds)
        self.drift = self.DRIFT if n_accepted else max(self.drift / 2, self.DRIFT / 64)
        self.accepted = self.DECAY * self.accepted + n_accepted
        self.rejected = self.DECAY * self.rejected + (0 if n_accepted >= k else 1)


class Speculation:
    """One request's speculative state: the drafter, the draft length, the counts."""

    def __init__(self, drafter: Drafter, params: SpeculativeParams, costs: BatchCosts | None = None) -> None:
        self.drafter = drafter
        self.params = params.validate()
        self.length = DraftLength(self.params, costs)
        self._observe = getattr(drafter, "observe", None)
        self._seen = None  # the context list last handed to observe
        self.drafted = 0   # tokens proposed and verified (llama-server's draft_n)
        self.accepted = 0  # of those, kept (draft_n_accepted)
        self._round: tuple[int, float, float] | None = None  # (k, verify s, draft s)
        self._hits = 0
        self._shadow: tuple[int, int] | None = None   # (context length, token) proposed, not verified

    def begin(self, prompt: Sequence[int]) -> None:
        self.drafter.begin(prompt)

    def draft(self, context: Sequence[int], limit: int) -> tuple[list[int], float]:
        """(proposal, seconds spent drafting) for the next step; [] = decode plainly."""
        if self._observe is not None and context is not self._seen:
            self._seen = context
            self._observe(context)
        self._settle_shadow(context)
        k = self.length.next_k(limit)
        if k <= 0:
            self._propose_shadow(context, limit)
            return [], 0.0
        t = time.perf_counter()
        got = list(self.drafter.propose(context, k))[:k]
        if len(got) < max(self.params.n_min, 1):
            return [], 0.0
        return got, time.perf_counter() - t

    def plain_step(self, seconds: float) -> None:
        self.length.plain_step(seconds)

    def _propose_shadow(self, context: Sequence[int], limit: int) -> None:
        """While decoding plainly, a drafter whose proposals cost no forward pass (CHEAP)
        still proposes one token, unverified: the next token says whether it was right.
        Without it, two early rejections stopped drafting for some 60 tokens of a text
        whose later repeats the lookup drafts well (alpha only drifted back)."""
        if limit > 0 and getattr(self.drafter, "CHEAP", False):
            got = self.drafter.propose(context, 1)
            if got:
                self._shadow = (len(context), int(got[0]))

    def _settle_shadow(self, context: Sequence[int]) -> None:
        if self._shadow is None:
            return
        n, token = self._shadow
        self._shadow = None
        if len(context) == n + 1:   # exactly the one plainly decoded token since
            hit = int(context[n]) == token
            self.length.shadowed(hit)
            self.drafter.accept(1, int(hit))

    def start_round(self, k: int, verify_s: float, draft_s: float) -> None:
        self._round, self._hits = (k, verify_s, draft_s), 0

    def hit(self) -> None:
        self._hits += 1

    def end_round(self) -> None:
        """The last verification is settled: `hit()` was called for each kept token."""
        if self._round is None:
            return
        k, verify_s, draft_s = self._round
        self._round = None
        self.drafted += k
        self.accepted += self._hits
        self.length.verified(k, self._hits, verify_s, draft_s)
        self.drafter.accept(k, self._hits)


def accept_speculative(p: np.ndarray, q: np.ndarray | None, drafted: int,
                       rng: np.random.Generator) -> tuple[bool, int]:
    """Standard speculative sampling for one position: (accepted, token).

    `p` the target's probabilities, `q` the drafter's (None = a point mass on `drafted`).
    Accept with probability min(1, p/q); otherwise draw from max(0, p - q), normalised.
    """
    p = np.asarray(p, dtype=np.float64)
    if q is None:
        q = np.zeros_like(p)
        q[drafted] = 1.0
    q = np.asarray(q, dtype=np.float64)
    pd, qd = float(p[drafted]), float(q[drafted])
    if qd > 0 and rng.random() < min(1.0, pd / qd):
        return True, drafted
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if not math.isfinite(total) or total <= 0:
        residual, total = p, p.sum()
    return False, int(rng.choice(len(p), p=residual / total))
