"""`KVView`: what the forward pass needs of a KV cache, whatever kind holds the K/V.

The contiguous cache (edgeinfer.kv.contiguous.KVCache), one sequence of the paged pool
(edgeinfer.kv.sequence.SequenceKV) and the contiguous cache with VRAM layers
(edgeinfer.kv.device_storage.CudaKVCache) implement it and declare it as a base class. The
model code (models/base.py), the backends' attention and the generation loop are typed
against it.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class KVView(Protocol):
    n_ctx: int  # the most tokens it can hold
    n_used: int  # tokens whose slots are appended (their K/V written by the model)

    def append(self, positions: np.ndarray) -> np.ndarray:
        """Reserve slots for new tokens at `positions`; returns the slots to `store` them in.
        ContextOverflowError when they do not fit, and then nothing changes."""
        ...

    def store(self, layer: int, slots: np.ndarray, k: Any, v: Any) -> None:
        """K/V rows (n, n_head_kv, head_dim) / (..., head_dim_v) of `layer` into `slots`."""
        ...

    def layer_view(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(k (S, n_head_kv, hd), v (S, n_head_kv, hd_v), positions (S,)) of the keys that
        layer's queries may see; attention masks by the positions, so their order is free."""
        ...

    def truncate(self, n: int) -> None:
        """Forget every token from index n on (regenerate, edit, cancel, a failed step)."""
        ...
