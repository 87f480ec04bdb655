"""Prompt lookup: draft by finding the context's last n tokens earlier in the context.

The drafter keeps, per n-gram size, the most recent position each n-gram was followed by a
token, updated incrementally as the history grows (one dict update per size and token).
For the suffix of the longest size that matched before (n_max down to n_min), the proposal
is what followed that match; a continuation that runs into the end of the context goes on
through the proposal itself, so a repeating loop drafts its next period. No match costs
nothing: the decode loop decodes plainly.
"""

from __future__ import annotations

from typing import Sequence


class PromptLookup:
    name = "lookup"
    CHEAP = True   # a proposal costs no forward pass (Speculation proposes while decoding plainly too)

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {ngram_min}..{ngram_max}")
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self._tokens: list[int] = []
        self._index: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def begin(self, prompt: Sequence[int]) -> None:
        self._tokens = []
        self._index = {n: {} for n in range(self.ngram_min, self.ngram_max + 1)}
        self._indexed = 0

    def _sync(self, context: Sequence[int]) -> None:
        n_old = len(self._tokens)
        if len(context) < n_old or (n_old and context[n_old - 1] != self._tokens[-1]):
            self.begin(context)  # not a continuation of what was indexed
            n_old = 0
        self._tokens.extend(int(t) for t in context[n_old:])
        toks = self._tokens
        # n-gram toks[e-n:e] is followed by toks[e]: index every e < len(toks)
        for e in range(max(self._indexed, 1), len(toks)):
            for n, index in self._index.items():
                if e >= n:
                    index[tuple(toks[e - n:e])] = e
        self._indexed = max(self._indexed, len(toks))

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if k <= 0 or not context:
            return []
        self._sync(context)
        toks = self._tokens
        for n in range(min(self.ngram_max, len(toks)), self.ngram_min - 1, -1):
            e = self._index[n].get(tuple(toks[-n:]))
            if e is None:
                continue
            ext = toks[e:e + k]
            while len(ext) < k:  # the match runs into the end: continue through the draft
                ext.append(ext[len(ext) - (len(toks) - e)])
            return ext
        return []

    def accept(self, n_drafted: int, n_accepted: int) -> None:
        pass
