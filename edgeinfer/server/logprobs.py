"""Token log-probabilities in each dialect's shape: OpenAI chat and completions, llama-server's
`completion_probabilities`, Ollama's `logprobs`.

Values are natural logs of the model's distribution before any sampler runs
(edgeinfer.sampling.token_logprobs), except llama-server's `post_sampling_probs`, which
reports the sampler chain's own probabilities as `prob` (linear, as llama-server does).
"""

from __future__ import annotations

import math
from typing import Iterable

from edgeinfer.results import TokenLogprob


class Pieces:
    """A token's text and bytes, read once per id (the bytes exact; the text with
    U+FFFD where a token holds part of a UTF-8 character)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        got = self._memo.get(token)
        if got is None:
            raw = self.tokenizer.token_to_piece(token)
            got = self._memo[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return got


def _entry(pieces: Pieces, token: int, logprob: float) -> dict:
    text, raw = pieces(token)
    return {"token": text, "logprob": logprob, "bytes": raw}


def openai_chat(pieces: Pieces, lps: Iterable[TokenLogprob]) -> list[dict]:
    """`choices[].logprobs.content`: token, logprob, bytes, top_logprobs per token."""
    return [{**_entry(pieces, lp.token, lp.logprob),
             "top_logprobs": [_entry(pieces, t, v) for t, v in lp.top]} for lp in lps]


def openai_completion(pieces: Pieces, items: Iterable[tuple[int, TokenLogprob | None]],
                      offset: int) -> dict:
    """Legacy completions' `logprobs` for (token, logprob) pairs: tokens, token_logprobs,
    top_logprobs (text -> logprob, the chosen token always among them), text_offset
    (characters into prompt + answer). None is a token without a logprob (the first one
    of an echoed prompt)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in items:
        text, _ = pieces(token)
        out["tokens"].append(text)
        out["text_offset"].append(max(offset, 0))
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {pieces(t)[0]: v for t, v in reversed(lp.top)}  # a text two ids share: the likelier wins
        top.setdefault(text, lp.logprob)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append(dict(sorted(top.items(), key=lambda kv: -kv[1])))
    return out


def llama_server(pieces: Pieces, lps: Iterable[TokenLogprob], post_sampling: bool) -> list[dict]:
    """llama-server's `completion_probabilities`: id, token, bytes and logprob with
    top_logprobs; with post_sampling_probs, prob with top_probs (linear probabilities)."""
    def one(token: int, value: float) -> dict:
        text, raw = pieces(token)
        if post_sampling:
            return {"id": token, "token": text, "bytes": raw, "prob": math.exp(value)}
        return {"id": token, "token": text, "bytes": raw, "logprob": value}

    key = "top_probs" if post_sampling else "top_logprobs"
    return [{**one(lp.token, lp.logprob), key: [one(t, v) for t, v in lp.top]} for lp in lps]


def ollama(pieces: Pieces, lps: Iterable[TokenLogprob]) -> list[dict]:
    """Ollama's `logprobs`: token, logprob, bytes, top_logprobs per token."""
    return openai_chat(pieces, lps)
