"""`--draft mtp`: the model's own multi-token-prediction block drafts (Qwen3.5 files that
carry one; models/qwen35_mtp.py).

The block reads, for the token at position p, the trunk's final hidden state of position
p - 1, and has K/V of its own. As llama.cpp's draft-mtp driver does:
- every forward pass of the model hands its rows' hidden states to the drafter
  (`Transformer.hidden_sink`); the drafter runs the block over the same tokens at once,
  each paired with the trunk's h of the position before (the pass's previous row, or the
  last row of the pass before it), without the output head. The block's K/V then follow
  the sequence: entry i is position i, and a pass that starts at p first cuts them to p
  (what verification rejected, and the drafts, go);
- `propose(context, k)` drafts from the block alone: the last token with the trunk's last
  h gives the first draft (argmax), which with the block's own h' gives the next, and so on,
  stopping early when the top probability falls below p_min.
Positions the model never evaluated in this process (a prefix served from the cache) are
run with a zero h, as llama.cpp does when a batch lacks the previous row: drafts there are
worse, never wrong. Verification keeps the output exactly what plain decoding gives
(edgeinfer.speculative.drafter).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from edgeinfer.kv.prefix_cache import common_prefix_len
from edgeinfer.speculative.drafter import MAX_DRAFT, confident_argmax


class MtpDrafter:
    """Drafter over the model's MTP block (one per loaded model)."""

    name = "mtp"

    def __init__(self, engine, p_min: float = 0.75) -> None:
        from edgeinfer.models.qwen35_mtp import MtpHead

        self.engine = engine
        self.head = MtpHead(engine.model)
        self.p_min = p_min
        self.n_embd = engine.config.n_embd
        self.kv = self.head.new_cache(engine.n_ctx + MAX_DRAFT + 1)  # the block's K/V, entry i = position i
        self.held: list[int] = []  # token of each entry
        self.prompt: list[int] = []  # the request's prompt: tokens of positions the model did not run
        self.last_h: dict[int, np.ndarray] = {}  # trunk h of the last pass's rows, by position
        engine.model.hidden_sink = self._observe

    def close(self) -> None:
        if self.engine.model.hidden_sink == self._observe:
            self.engine.model.hidden_sink = None

    # -- the model's passes ----------------------------------------------------------------------
    def _observe(self, tokens: np.ndarray, positions: np.ndarray, hidden: np.ndarray) -> None:
        """A forward pass of the model ran `tokens` at `positions` and gives their h."""
        n, p0 = len(tokens), int(positions[0])
        if not np.array_equal(positions, np.arange(p0, p0 + n)):  # not a sequence's next tokens
            self.last_h = {}
            return
        prev = self.last_h.get(p0 - 1)
        self.last_h = {}
        self._cut(p0)
        if self.kv.n_used < p0:  # positions served from the cache: their tokens are the prompt's
            if len(self.prompt) < p0:
                return
            self._fill(self.prompt, p0)
            prev = None
        h_prev = np.empty((n, self.n_embd), np.float32)
        h_prev[0] = prev if prev is not None else 0.0
        h_prev[1:] = hidden[:-1]
        self._run(tokens, p0, h_prev)
        self.last_h = {p0 + i: hidden[i] for i in range(n)}

    # -- the drafter protocol --------------------------------------------------------------------
    def begin(self, prompt: Sequence[int]) -> None:
        self.prompt = [int(t) for t in prompt]
        self._cut(common_prefix_len(self.held, self.prompt))

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        context = [int(t) for t in context]
        n = len(context)
        if k <= 0 or n == 0 or n + k > self.kv.n_ctx:
            return []
        # entries 0..n-2 must hold the context (the model ran them); fill what is missing
        self._cut(min(common_prefix_len(self.held, context), n - 1))
        self._fill(context, n - 1)
        h = self.last_h.get(n - 2)
        h = np.zeros(self.n_embd, np.float32) if h is None else h
        out: list[int] = []
        token, pos = context[-1], n - 1
        while len(out) < k:
            logits, h_out = self.head.forward(np.array([token]), np.array([pos]), h[None, :], self.kv)
            self.held.append(token)
            token = confident_argmax(logits[0], self.p_min)
            if token is None:
                break
            out.append(token)
            h, pos = h_out[0], pos + 1
        return out

    def accept(self, n_drafted: int, n_accepted: int) -> None:
        pass  # the next pass of the model cuts the block's K/V to what it runs

    # -- internals -------------------------------------------------------------------------------
    def _cut(self, n: int) -> None:
        n = min(n, self.kv.n_used)
        self.kv.truncate(n)
        del self.held[n:]

    def _fill(self, tokens: Sequence[int], n: int) -> None:
        """Entries up to n from `tokens`, with a zero h where the block is behind."""
        gap = list(tokens[self.kv.n_used:n])
        if gap:
            self._run(gap, self.kv.n_used, np.zeros((len(gap), self.n_embd), np.float32))

    def _run(self, tokens: Sequence[int], p0: int, h_prev: np.ndarray) -> None:
        """The block over tokens at p0 = the next entry (no output head: only its K/V matter)."""
        if p0 + len(tokens) > self.kv.n_ctx:
            return
        self.head.forward(np.asarray(tokens, np.int64), np.arange(p0, p0 + len(tokens)), h_prev, self.kv,
                          logits_for=np.zeros(0, np.int64))
        self.held.extend(int(t) for t in tokens)
