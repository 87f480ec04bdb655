"""The paged KV cache: the layer groups' block pools and storage, and the sequences using them.

One `PagedKVCache` holds, per layer group (edgeinfer.kv.groups: the full-attention layers,
and the sliding-window layers of one window), a BlockPool, the position stored in every
slot, and per layer the K/V arrays of its blocks. Sequences (edgeinfer.kv.sequence) hold
block tables into them; prefix caching is edgeinfer.kv.prefix_cache, the context shift
edgeinfer.kv.context_shift, how many blocks each pool gets edgeinfer.kv.pool_sizing.

Device storage (GPU-offloaded layers): a `device` object (edgeinfer.kv.device_storage.
DeviceBlockStorage) keeps the K/V of `device.layers` in VRAM, in blocks with the same ids as
one group's pool, so ref counts, the prefix cache and copy-on-write cover them unchanged.
All device layers are in one group (a full-attention group unless every device layer is a
sliding-window layer); it is the sequences' "primary" group, whose table `block_table` /
`kept_blocks()` / `n_held` / `n_dropped` describe (what the device storage reads). Those
layers get no host arrays. Without a device nothing here changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from edgeinfer.kv import prefix_cache
from edgeinfer.kv.block_pool import BlockPool
from edgeinfer.kv.cache_types import CacheTypes, of_config
from edgeinfer.kv.groups import DROP_ALIGN, DROPPED, LayerGroup, ceil_div, drop_quantum, layer_groups
from edgeinfer.kv.pool_sizing import layer_block_bytes
from edgeinfer.kv.recurrent import host_snapshot, state_nbytes
from edgeinfer.kv.sequence import SequenceKV
from edgeinfer.kv.state_cache import StateCache

if TYPE_CHECKING:
    from edgeinfer.models.config import ModelConfig


class PagedKVCache:
    """K/V storage for the layer groups' pools, and the sequences using them.

    `num_blocks`: blocks per group; an int gives every group that many, a mapping
    {window: blocks} sizes each group (window 0 = the full-attention group).
    `drop_align`: sliding-window groups drop whole multiples of this many tokens.
    """

    def __init__(self, config: "ModelConfig", num_blocks: int | Mapping[int, int], block_size: int = 16,
                 dtype: np.dtype = np.float16, extra_keys: tuple = (), device=None,
                 drop_align: int = DROP_ALIGN, cache_types: CacheTypes | None = None) -> None:
        self.config = config
        self.block_size = block_size
        # K/V types (edgeinfer.kv.cache_types): f16 values, or quantized rows as raw ggml blocks
        self.cache_types = types = of_config(config, cache_types)
        if device is not None and getattr(device, "types", types) != types:
            raise ValueError(f"the device blocks hold {device.types}, the pool {types}")
        # The cached K/V depend on the model and the cache type as well as the tokens.
        self.extra_keys = (types.key if types.quantized else str(np.dtype(dtype)),) + tuple(extra_keys)
        # Optional storage of some layers' K/V outside host memory (see the module docstring).
        self.device = device
        self.device_layers = frozenset(device.layers) if device is not None else frozenset()
        itemsize = np.dtype(dtype).itemsize
        self.groups: list[LayerGroup] = []
        for index, (window, layers) in enumerate(layer_groups(config, self.device_layers)):
            blocks = num_blocks if isinstance(num_blocks, int) else num_blocks[window]
            on_device = device if any(i in self.device_layers for i in layers) else None
            block_bytes = sum(layer_block_bytes(config, block_size, itemsize, i, types) for i in layers)
            self.groups.append(LayerGroup(index, window, layers, blocks, block_size,
                                          drop_quantum(block_size, window, drop_align), on_device,
                                          block_bytes))
        self.primary = next((g for g in self.groups if g.device is not None), self.groups[0])
        if device is not None and getattr(device, "num_blocks", self.primary.num_blocks) != self.primary.num_blocks:
            raise ValueError(f"device storage has {device.num_blocks} blocks, its group {self.primary.num_blocks}")
        self.group_of: list[LayerGroup] = [self.groups[0]] * config.n_layer
        for g in self.groups:
            for i in g.layers:
                self.group_of[i] = g

        # a layer reading another's K/V (config.kv_source) is that layer's group's member too
        for i in range(config.n_layer):
            if not config.is_recurrent(i) and config.kv_source(i) != i:
                self.group_of[i] = self.group_of[config.kv_source(i)]

        def blocks(layer: int) -> int:  # device, recurrent and shared layers keep an empty host array
            if layer in self.device_layers or not config.owns_kv(layer):
                return 0
            return self.group_of[layer].num_blocks

        # k[layer]: (blocks of its group, block_size, K/V heads of the layer, head_dim of the layer);
        # v: (..., head_dim_v) (last dimension: values for f16, bytes of the row's blocks for a
        # quantized type)
        heads = [config.n_head_kv_of(i) for i in range(config.n_layer)]
        hd = [types.width("k", config.head_dim_of(i)) for i in range(config.n_layer)]
        hd_v = [types.width("v", config.head_dim_v_of(i)) for i in range(config.n_layer)]
        dk = dtype if types.k == "f16" else types.dtype("k")
        dv = dtype if types.v == "f16" else types.dtype("v")
        self.k = [np.zeros((blocks(i), block_size, heads[i], hd[i]), dk) for i in range(config.n_layer)]
        self.v = [np.zeros((blocks(i), block_size, heads[i], hd_v[i]), dv) for i in range(config.n_layer)]
        # Flat views (blocks * block_size, ...) indexed by slot.
        self.k_flat = [a.reshape(-1, heads[i], hd[i]) for i, a in enumerate(self.k)]
        self.v_flat = [a.reshape(-1, heads[i], hd_v[i]) for i, a in enumerate(self.v)]
        self._live: set[SequenceKV] = set()
        # hybrid models: the recurrent state after cached blocks (edgeinfer.kv.state_cache)
        self.states = StateCache(state_nbytes(config)) if config.has_recurrent else None

    # The primary group's pool and positions (the only ones when there is one group).
    @property
    def pool(self) -> BlockPool:
        return self.primary.pool

    @property
    def pos(self) -> np.ndarray:
        return self.primary.pos

    @property
    def pos_flat(self) -> np.ndarray:
        return self.primary.pos_flat

    @property
    def num_blocks(self) -> int:
        return self.primary.num_blocks

    @property
    def nbytes(self) -> int:
        return sum(g.num_blocks * g.bytes_per_block for g in self.groups)

    # -- sequences ------------------------------------------------------------------------------
    def new_sequence(self, n_ctx: int) -> SequenceKV:
        seq = SequenceKV(self, n_ctx)
        if seq.recurrent is not None:
            seq.recurrent.mark_blocks(self.block_size, self.states.every_blocks)  # states for self.states
        self._live.add(seq)
        return seq

    def fork(self, seq: SequenceKV) -> SequenceKV:
        """A new sequence sharing all of `seq`'s blocks; the first write to a shared one copies it."""
        child = self.new_sequence(seq.n_ctx)
        for ct, t in zip(child.tables, seq.tables):
            t.group.pool.touch(t.held())
            ct.blocks, ct.n_dropped = list(t.blocks), t.n_dropped
        child.tokens = list(seq.tokens)
        child.block_hashes = list(seq.block_hashes)
        child.n_used = seq.n_used
        child._pos = seq._pos.copy()
        if seq.recurrent is not None:  # n > 1, a branch: the state is copied, not shared
            child.recurrent = seq.recurrent.fork()
        child._ascending = seq._ascending
        return child

    def release(self, seq: SequenceKV) -> None:
        """Give all of `seq`'s blocks back (cached ones stay findable until reused)."""
        seq.truncate(0)
        seq.tokens.clear()
        self._live.discard(seq)

    # -- prefix cache (edgeinfer.kv.prefix_cache) ------------------------------------------------
    def reuse_prefix(self, seq: SequenceKV, token_ids: Sequence[int]) -> int:
        """Put the longest cached prefix of whole blocks of `token_ids` into an EMPTY `seq`;
        returns the tokens now cached (see edgeinfer.kv.prefix_cache)."""
        n = prefix_cache.reuse_prefix(self, seq, token_ids)
        if seq.recurrent is not None and n:
            # K/V alone are never reused: only as far as a state after those blocks is cached
            j, snap = self.states.latest(seq.block_hashes)
            if snap is not None:
                seq.recurrent.restore(j * self.block_size, snap)
            seq.truncate(j * self.block_size)
            n = seq.n_used
        return n

    def commit_full_blocks(self, seq: SequenceKV) -> int:
        """Register `seq`'s newly full blocks in the prefix cache (and, for a hybrid model,
        the state a forward pass marked at their end); returns how many."""
        before = len(seq.block_hashes)
        added = prefix_cache.commit_full_blocks(self, seq)
        if seq.recurrent is not None:
            bs = self.block_size
            for i in range(before, before + added):
                snap = seq.recurrent.take_mark((i + 1) * bs)
                if snap is not None:  # kept in host memory (an offloaded layer's is in VRAM)
                    self.states.put(seq.block_hashes[i], host_snapshot(snap))
        return added

    @property
    def hits(self) -> int:
        """Full blocks reused by reuse_prefix (every group's pool counts the same lookups)."""
        return self.groups[0].pool.hits

    @property
    def queries(self) -> int:
        """Full blocks asked for by reuse_prefix."""
        return self.groups[0].pool.queries

    # -- accounting -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Blocks used/free/cached/total summed over the groups (and per group under
        "groups"), K/V bytes, and the prefix hit rate in blocks asked for."""
        per = [g.stats() for g in self.groups]
        s = {key: sum(p[key] for p in per) for key in ("used", "free", "cached", "total")}
        s.update(hits=self.hits, queries=self.queries,
                 hit_rate=self.hits / self.queries if self.queries else 0.0,
                 kv_bytes_used=sum(p["used"] * p["block_bytes"] for p in per),
                 kv_bytes_total=sum(p["total"] * p["block_bytes"] for p in per),
                 groups=per)
        if self.states is not None:
            s["states"] = self.states.stats()
        return s

    def check_invariants(self) -> None:
        """Pool invariants plus, per group: each block's ref count == the live tables holding
        it, tables as long as the sequence, dropped entries leading, aligned, and never one
        the next token's window needs."""
        bs = self.block_size
        held = [[0] * g.num_blocks for g in self.groups]
        for g in self.groups:
            g.pool.check_invariants()
        for seq in self._live:
            assert seq.n_used <= seq.n_ctx
            assert len(seq.block_hashes) <= seq.n_used // bs
            for t in seq.tables:
                g = t.group
                assert len(t.blocks) == ceil_div(seq.n_used, bs), "block table length != ceil(n_used/bs)"
                assert all(b == DROPPED for b in t.blocks[:t.n_dropped])
                assert t.n_dropped % g.quantum == 0, "unaligned drop"
                assert t.n_dropped <= max(seq._needed_from(g, seq.n_used), 0), "a needed block was dropped"
                if not g.window:
                    assert t.n_dropped == 0
                for b in t.held():
                    assert b != DROPPED, "a dropped block after a kept one"
                    held[g.index][b] += 1
        for g in self.groups:
            for b in range(g.num_blocks):
                assert held[g.index][b] == g.pool.ref_count(b), \
                    f"{g.name}, block {b}: ref count {g.pool.ref_count(b)} but held by {held[g.index][b]} sequences"

    # -- internals ------------------------------------------------------------------------------
    def writable(self, g: LayerGroup, block: int) -> bool:
        return g.pool.ref_count(block) == 1 and g.pool.block_hash(block) is None

    def copy_rows(self, g: LayerGroup, src: int, dst: int, n: int) -> None:
        for i in g.host_layers:
            self.k[i][dst, :n] = self.k[i][src, :n]
            self.v[i][dst, :n] = self.v[i][src, :n]
        g.pos[dst, :n] = g.pos[src, :n]
        if g.device is not None:
            g.device.copy_rows(src, dst, n)