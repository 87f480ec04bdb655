"""The contiguous KV cache of one sequence: per layer, K and V for every cached token, plus its position.

Slots are handed out in order; each slot remembers the position of the token it holds,
so attention masks by position, not slot (which is what lets a context shift or a
paged block table reorder things later without touching the attention code).

K/V are stored as float16 by default, like llama.cpp's default cache type, so logits
match it closely and the cache takes half the memory; `cache_types` (edgeinfer.kv.cache_types)
picks quantized rows instead (raw ggml blocks, quantized as they are stored).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edgeinfer.errors import ContextOverflowError
from edgeinfer.kv.cache_types import CacheTypes, of_config
from edgeinfer.kv.recurrent import new_state
from edgeinfer.kv.view import KVView

if TYPE_CHECKING:
    from edgeinfer.models.config import ModelConfig


class KVCache(KVView):
    def __init__(self, config: ModelConfig, n_ctx: int, dtype: np.dtype = np.float16,
                 cache_types: CacheTypes | None = None) -> None:
        self.n_ctx = n_ctx
        self.cache_types = t = of_config(config, cache_types)
        # k[layer]: (n_ctx, K/V heads of the layer, its head_dim); v[layer]: (..., head_dim_v);
        # a recurrent layer keeps none (its state is `recurrent`, edgeinfer.kv.recurrent), nor
        # does a layer that reads an earlier layer's K/V (config.kv_source)
        rows = [n_ctx if config.owns_kv(i) else 0 for i in range(config.n_layer)]
        dk = dtype if t.k == "f16" else t.dtype("k")
        dv = dtype if t.v == "f16" else t.dtype("v")
        heads = [config.n_head_kv_of(i) for i in range(config.n_layer)]
        self.k = [np.zeros((r, heads[i], t.width("k", config.head_dim_of(i))), dk) for i, r in enumerate(rows)]
        self.v = [np.zeros((r, heads[i], t.width("v", config.head_dim_v_of(i))), dv) for i, r in enumerate(rows)]
        self.recurrent = new_state(config)
        self.pos = np.zeros(n_ctx, dtype=np.int64)  # position of the token in each slot
        self.n_used = 0

    def append(self, positions: np.ndarray) -> np.ndarray:
        """Reserve slots for new tokens at `positions`; returns the slot indices."""
        n = len(positions)
        if self.n_used + n > self.n_ctx:
            raise ContextOverflowError(
                f"context is full: {self.n_used} cached + {n} new tokens exceed --ctx-size {self.n_ctx}")
        slots = np.arange(self.n_used, self.n_used + n)
        self.pos[slots] = positions
        if self.recurrent is not None:
            self.recurrent.begin(self.n_used, n)
        self.n_used += n
        return slots

    def store(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        self.k[layer][slots] = self.cache_types.encode("k", k)
        self.v[layer][slots] = self.cache_types.encode("v", v)

    def layer_view(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = self.n_used
        return self.k[layer][:n], self.v[layer][:n], self.pos[:n]

    def truncate(self, n: int) -> None:
        """Forget every token from slot n on (regenerate, edit, cancel). With a recurrent
        state, only as far as a point it can be put back to (callers read n_used)."""
        n = min(self.n_used, max(0, n))
        if self.recurrent is not None:
            n = self.recurrent.truncate(n)
        self.n_used = n

    @property
    def nbytes(self) -> int:
        state = self.recurrent.nbytes if self.recurrent is not None else 0
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v) + state
