"""SavedKV: what a sequence hands to a saved session and takes back from one."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class SavedKV(NamedTuple):
    """The resident sequence's tokens, its K/V per layer (f16, (n, n_head_kv, hd); NaN rows
    where a sliding window dropped them), their positions, and for a hybrid model the
    recurrent state after those n tokens (RecurrentState.export's named arrays), else None."""

    tokens: list[int]
    k: list[np.ndarray]
    v: list[np.ndarray]
    pos: np.ndarray
    state: dict[str, np.ndarray] | None = None
