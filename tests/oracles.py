"""Cache-free oracles the session and paged-KV tests compare against."""
from __future__ import annotations

import numpy as np

from edgeinfer.kv.contiguous import KVCache


def cold_run(engine, tokenizer, ids: list[int], max_tokens: int) -> tuple[list[int], np.ndarray]:
    """A fresh contiguous KVCache, prefill, argmax decode: (tokens, logits after the prompt)."""
    kv = KVCache(engine.config, engine.n_ctx)
    logits = engine.prefill(ids, kv)
    first = logits.copy()
    out: list[int] = []
    while len(out) < max_tokens:
        tok = int(np.argmax(logits))
        if tokenizer.is_eog(tok):
            break
        out.append(tok)
        if len(out) >= max_tokens or kv.n_used >= engine.n_ctx:
            break
        logits = engine.decode(tok, kv)
    return out, first


def cold_greedy(engine, tokenizer, ids: list[int], max_tokens: int) -> list[int]:
    """The greedy tokens of cold_run."""
    return cold_run(engine, tokenizer, ids, max_tokens)[0]
