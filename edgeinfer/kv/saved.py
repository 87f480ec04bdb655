"""SavedKV: what a sequence hands to a saved session and takes back from one."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


F16_KEY = "k=f16,v=f16"  # CacheTypes.key of the default cache (saved K/V before cache types)


class SavedKV(NamedTuple):
    """The resident sequence's tokens, its K/V per layer as the cache stores them ((n,
    n_head_kv, hd) f16, or raw blocks (n, n_head_kv, row bytes) uint8 of a quantized type;
    rows a sliding window dropped carry CacheTypes.blank_rows' marker), their positions, for
    a hybrid model the recurrent state after those n tokens (RecurrentState.export's named
    arrays, else None), and the cache types they are stored as (CacheTypes.key)."""

    tokens: list[int]
    k: list[np.ndarray]
    v: list[np.ndarray]
    pos: np.ndarray
    state: dict[str, np.ndarray] | None = None
    kv_types: str = F16_KEY
