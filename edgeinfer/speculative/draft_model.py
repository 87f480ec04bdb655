"""A draft model: a small model with the target's vocabulary drafts greedily.

It keeps its own paged K/V of the context (a PagedKVCache sequence): each proposal first
cuts the sequence back to the longest prefix it shares with the context (what the target
rejected goes), prefills the rest, then decodes its argmax up to k tokens, stopping early
when its top probability falls below p_min. The vocabularies must match exactly (size,
and every token's text), checked when the drafter is made.
"""

from __future__ import annotations

from typing import Sequence

from edgeinfer.errors import EdgeInferError
from edgeinfer.kv.prefix_cache import common_prefix_len
from edgeinfer.kv.paged import PagedKVCache
from edgeinfer.speculative.drafter import confident_argmax


def check_same_vocab(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int,
                     draft_name: str) -> None:
    """One-line EdgeInferError unless the draft model can propose the target's token ids."""
    if target_vocab != draft_vocab or target_tokenizer.vocab_size != draft_tokenizer.vocab_size:
        raise EdgeInferError(f"draft model {draft_name}: vocabulary of {draft_vocab} tokens, "
                             f"the model has {target_vocab}; a draft model needs the same vocabulary")
    a, b = target_tokenizer._texts, draft_tokenizer._texts
    if a != b:
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        raise EdgeInferError(f"draft model {draft_name}: token {i} is {b[i]!r}, the model's is {a[i]!r}; "
                             f"a draft model needs the same vocabulary")


class DraftModel:
    """Drafter over a second Engine with its own paged K/V."""

    def __init__(self, engine, name: str = "draft", p_min: float = 0.75, block_size: int = 16) -> None:
        self.engine = engine
        self.name = name
        self.p_min = p_min
        self.n_ctx = engine.n_ctx
        blocks = -(-self.n_ctx // block_size) + 4
        self.cache = PagedKVCache(engine.config, blocks, block_size, extra_keys=("draft",))
        self.seq = self.cache.new_sequence(self.n_ctx)
        self.held: list[int] = []  # the tokens whose K/V seq holds

    def begin(self, prompt: Sequence[int]) -> None:
        pass  # the held prefix is reused as far as the new context shares it

    def _reset(self) -> None:
        self.cache.release(self.seq)
        self.seq = self.cache.new_sequence(self.n_ctx)
        self.held = []

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        context = list(context)
        if k <= 0 or not context:
            return []
        if len(context) + k > self.n_ctx:  # the target shifted its context: draft from a tail
            context = context[-(self.n_ctx // 2):]
            self._reset()
        keep = min(common_prefix_len(self.held, context), len(context) - 1)
        self.seq.truncate(keep)
        if self.seq.n_used != keep:  # a sliding window could not serve the cut: start over
            self._reset()
        del self.held[self.seq.n_used:]
        # the prompt as the target prefilled it, the tokens since with matvec's bits as the
        # target verified them: a drafter with the target's weights then drafts exactly
        # what the target picks
        logits = self.engine.prefill(context[self.seq.n_used:], self.seq, decode_bits=self.seq.n_used > 0)
        self.held = list(context)
        out: list[int] = []
        while True:
            tok = confident_argmax(logits, self.p_min)
            if tok is None:
                break
            out.append(tok)
            if len(out) >= k:
                break
            logits = self.engine.decode(tok, self.seq)
            self.held.append(tok)
        return out

    def accept(self, n_drafted: int, n_accepted: int) -> None:
        pass
