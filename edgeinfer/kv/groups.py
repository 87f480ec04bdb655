"""Layer groups: which layers share a block pool (full attention, or one sliding window),
and one sequence's block table in one group.

Layer groups (llama.cpp's llama_kv_cache_iswa, vLLM's per-group KV managers): the
full-attention layers form one group and the sliding-window layers of one window another.
Each group has its own BlockPool and storage, each sequence one block table per group, and
a layer's K/V live only in its group's blocks. Every group sees the same tokens at the same
block boundaries, and prefix-cache hashes chain over the tokens, so block i of any group
holds tokens i*bs .. i*bs+bs-1 and has the same hash everywhere.

Sliding-window groups drop whole multiples of `DROP_ALIGN` tokens (32): the exact attention
kernels sum key j into accumulator j % 32 (and softmax terms in groups of 8), so with
aligned drops every kept key keeps its accumulator and a paged sliding-window layer
computes bit for bit what the contiguous KVCache computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from edgeinfer.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from edgeinfer.models.config import ModelConfig

DROPPED = -1  # block-table entry of a leading block given back as out of every window
MASKED_POS = -(1 << 30)  # stored position of a slot with no K/V (outside every window)
DROP_ALIGN = 32  # sliding-window groups drop whole multiples of this many tokens


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align_down(n: int, quantum: int) -> int:
    return n - n % quantum


def ascending_run(blocks: np.ndarray) -> bool:
    """Whether blocks are b, b+1, b+2, ... (first/last already checked by the caller)."""
    return len(blocks) < 3 or bool(np.all(np.diff(blocks) == 1))


def first_above(pos: np.ndarray, limit: int, ascending: bool) -> int:
    """Index of the first position > limit (len(pos) if none)."""
    if ascending:
        return int(np.searchsorted(pos, limit, side="right"))
    hits = np.flatnonzero(pos > limit)
    return int(hits[0]) if len(hits) else len(pos)


def layer_groups(config: ModelConfig, device_layers: Sequence[int] = ()) -> list[tuple[int, tuple[int, ...]]]:
    """(window, layers) of each layer group, full attention (window 0) first.

    Layers group by their sliding window (0 = full attention). Device layers all join one
    group: the sliding-window one when every device layer is a sliding-window layer, else
    the full-attention group (their blocks are then kept whole, as a global layer's).
    """
    device = frozenset(device_layers)
    w = config.sliding_window if config.sliding_window else 0
    device_window = w if device and w and all(config.is_swa(i) for i in device) else 0
    by_window: dict[int, list[int]] = {}
    for i in config.kv_layers:  # recurrent layers keep a state instead (edgeinfer.kv.recurrent)
        window = device_window if i in device else (w if w and config.is_swa(i) else 0)
        by_window.setdefault(window, []).append(i)
    return [(window, tuple(by_window[window])) for window in sorted(by_window)]


def drop_quantum(block_size: int, window: int, drop_align: int = DROP_ALIGN) -> int:
    """Blocks a sliding-window group drops at a time (1 for a full-attention group)."""
    return math.lcm(block_size, max(1, drop_align)) // block_size if window else 1


class LayerGroup:
    """Layers whose K/V share one block pool; every sequence has one block table per group."""

    def __init__(self, index: int, window: int, layers: tuple[int, ...], num_blocks: int, block_size: int,
                 quantum: int, device, bytes_per_block: int) -> None:
        self.index = index
        self.window = window  # 0 = full attention: blocks are never dropped
        self.layers = layers
        self.pool = BlockPool(num_blocks, block_size)
        # pos: (num_blocks, block_size), the position stored in each slot of this group
        self.pos = np.zeros((num_blocks, block_size), dtype=np.int64)
        self.pos_flat = self.pos.reshape(-1)
        self.quantum = quantum
        self.device = device  # the DeviceBlockStorage holding some of these layers, or None
        self.host_layers = [i for i in layers if device is None or i not in device.layers]
        self.bytes_per_block = bytes_per_block  # K + V of all its layers (their head sizes may differ)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def name(self) -> str:
        return f"sliding-window {self.window} layers" if self.window else "full-attention layers"

    def stats(self) -> dict:
        s = self.pool.stats()
        return {"window": self.window, "layers": len(self.layers), "used": s["used"], "free": s["free"],
                "cached": s["cached"], "total": s["total"], "block_bytes": self.bytes_per_block}


class GroupTable:
    """One sequence's blocks in one group: `blocks[:n_dropped]` are DROPPED, the rest held."""

    __slots__ = ("group", "blocks", "n_dropped", "_kept")

    def __init__(self, group: LayerGroup) -> None:
        self.group = group
        self.blocks: list[int] = []  # invariant: len == ceil(n_used / block_size)
        self.n_dropped = 0  # a multiple of group.quantum
        self._kept: np.ndarray | None = None

    def kept(self) -> np.ndarray:
        if self._kept is None:
            self._kept = np.asarray(self.blocks[self.n_dropped:], dtype=np.int64)
        return self._kept

    def held(self) -> list[int]:
        return self.blocks[self.n_dropped:]

