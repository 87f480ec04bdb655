"""Paged KV cache: one pool of fixed-size blocks shared by every sequence, with prefix caching.

Storage, per layer: K (num_blocks, block_size, n_head_kv, head_dim), V (..., head_dim_v),
plus the position of the token in every slot (num_blocks, block_size). A slot's global
index is block * block_size + offset.

A `SequenceKV` is one conversation's view: a block table, the token ids it holds, and the
number of tokens whose K/V is written. It has KVCache's interface (append / store /
layer_view / truncate / n_used / n_ctx), so the model code runs on it unchanged; attention
masks by the stored positions, so the block order never matters to it.

Blocks are shared between sequences (fork, prefix hits) through ref counts. A block is
written only while exactly one sequence holds it and it is not registered in the prefix
cache; otherwise the first write into it copies it (copy-on-write), which is what makes
fork, regenerate-from-the-middle and cached prefixes safe.

Sliding-window layers: a block all of whose positions are out of EVERY layer's window can
go back to the pool (`PagedKVCache.drop_out_of_window`). That only happens when every layer
is a sliding-window layer; models with global layers too (gemma3) keep every block.

Device storage (GPU-offloaded layers): a `device` object given to PagedKVCache keeps the K/V
of `device.layers` elsewhere (VRAM, edgeinfer.backend_cuda.DeviceBlockStorage), in blocks
with the same ids as the host pool, so ref counts, the prefix cache and copy-on-write cover
them unchanged. The cache tells it about every append (positions of new slots), store and
block copy; layer_view of such a layer asks it for a download. Those layers get no host
arrays. Without a device (the CPU-only path) nothing here changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgeinfer.block_pool import ROOT_HASH, BlockHash, BlockPool, hash_block
from edgeinfer.errors import ContextOverflowError
from edgeinfer.models.base import ModelConfig


DROPPED = -1  # block-table entry of a leading block given back by drop_out_of_window


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _ascending_run(blocks: np.ndarray) -> bool:
    """Whether blocks are b, b+1, b+2, ... (first/last already checked by the caller)."""
    return len(blocks) < 3 or bool(np.all(np.diff(blocks) == 1))


class SequenceKV:
    """One sequence in a PagedKVCache; duck-types edgeinfer.kv_cache.KVCache."""

    def __init__(self, cache: "PagedKVCache", n_ctx: int) -> None:
        self.cache = cache
        self.n_ctx = n_ctx
        self.block_table: list[int] = []  # invariant: len == ceil(n_used / block_size)
        self.tokens: list[int] = []  # token ids, position i at index i (see record_tokens)
        self.block_hashes: list[BlockHash] = []  # chained hashes of the committed full blocks
        self.n_used = 0  # tokens whose slots are appended (K/V written by the model)
        self.n_dropped = 0  # leading table entries that are DROPPED (out of every window)
        self.dropped_max_pos = -1  # highest position among the dropped blocks
        self._kept: np.ndarray | None = None  # cached array of the kept blocks, for layer_view

    # -- the KVCache interface --------------------------------------------------------------
    def append(self, positions: np.ndarray) -> np.ndarray:
        """Reserve slots for new tokens at `positions`; returns their global slot indices.

        All or nothing: on ContextOverflowError / KVPoolExhaustedError nothing changes.
        """
        positions = np.asarray(positions)
        n = len(positions)
        if self.n_used + n > self.n_ctx:
            raise ContextOverflowError(
                f"context is full: {self.n_used} cached + {n} new tokens exceed --ctx-size {self.n_ctx}")
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        c, pool, bs = self.cache, self.cache.pool, self.cache.block_size
        offset = self.n_used % bs
        copy_last = offset != 0 and not c._writable(self.block_table[-1])
        n_new = _ceil_div(self.n_used + n, bs) - len(self.block_table)
        blocks = pool.allocate(n_new + copy_last)  # raises before any change
        if copy_last:  # the partial last block is shared or cached: copy it, then write the copy
            old, new = self.block_table[-1], blocks.pop(0)
            c._copy_rows(old, new, offset)
            self.block_table[-1] = new
            pool.free([old])
        self.block_table.extend(blocks)
        idx = np.arange(self.n_used, self.n_used + n)
        slots = np.asarray(self.block_table, dtype=np.int64)[idx // bs] * bs + idx % bs
        c.pos_flat[slots] = positions
        self.n_used += n
        self._kept = None
        if c.device is not None:
            c.device.on_append(self, slots, positions)
        return slots

    def store(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        if layer in self.cache.device_layers:
            self.cache.device.store(self, layer, slots, k, v)
            return
        self.cache.k_flat[layer][slots] = k
        self.cache.v_flat[layer][slots] = v

    def layer_view(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(k (S, n_head_kv, hd), v (S, n_head_kv, hd_v), pos (S,)) in token order.

        S = n_used, less the tokens of blocks dropped as out of every sliding window.
        """
        blocks, held, c = self.kept_blocks(), self.n_held, self.cache
        if layer in c.device_layers:  # a download (CPU fallbacks, context shift, export)
            k, v = c.device.layer_view(self, layer)
            return k, v, c.pos[blocks].reshape(-1)[:held]
        if len(blocks) and blocks[-1] - blocks[0] == len(blocks) - 1 and _ascending_run(blocks):
            # One run of consecutive blocks (the usual case for a conversation that grew in
            # a fresh pool): a zero-copy view, as KVCache.layer_view returns.
            lo, hi = int(blocks[0]) * c.block_size, int(blocks[0]) * c.block_size + held
            return c.k_flat[layer][lo:hi], c.v_flat[layer][lo:hi], c.pos_flat[lo:hi]
        # Gather whole blocks (a few large copies), then cut the partial last block.
        k = c.k[layer][blocks].reshape(-1, *c.k[layer].shape[2:])[:held]
        v = c.v[layer][blocks].reshape(-1, *c.v[layer].shape[2:])[:held]
        return k, v, c.pos[blocks].reshape(-1)[:held]

    def truncate(self, n: int) -> None:
        """Forget every token from index n on; blocks no longer needed go back to the pool.

        If dropped (out-of-window) blocks would be back inside the window of the next
        token, the whole sequence is forgotten (n_used becomes 0): callers read n_used.
        """
        n = max(0, n)
        if self.n_dropped and not self._window_clear_after(n):
            n = 0
        del self.tokens[n:]  # recorded ids may run ahead of n_used
        n = min(self.n_used, n)
        bs = self.cache.block_size
        keep = _ceil_div(n, bs)
        dropped = self.block_table[keep:]
        del self.block_table[keep:]
        del self.block_hashes[n // bs:]
        self.n_used = n
        if n == 0:
            self.n_dropped, self.dropped_max_pos = 0, -1
        self._kept = None
        self.cache.pool.free([b for b in dropped if b != DROPPED])

    def _window_clear_after(self, n: int) -> bool:
        """Whether, with n tokens kept, the dropped blocks stay out of every window."""
        first_kept = self.n_dropped * self.cache.block_size  # index of the first kept token
        n = min(n, self.n_used)
        if n <= first_kept:
            return False
        next_pos = int(self.cache.pos_flat[self.slot_index()[n - 1 - first_kept]]) + 1
        return self.dropped_max_pos <= next_pos - self.cache.config.sliding_window

    @property
    def nbytes(self) -> int:
        return (len(self.block_table) - self.n_dropped) * self.cache.bytes_per_block

    # -- token bookkeeping for the prefix cache --------------------------------------------
    def record_tokens(self, token_ids: Sequence[int]) -> None:
        """Note the ids of tokens fed to the model after those already recorded.

        The model's `append` sees positions only; the session manager records the ids
        (before or after the forward) so `commit_full_blocks` can hash full blocks.
        """
        self.tokens.extend(int(t) for t in token_ids)

    @property
    def n_held(self) -> int:
        """Tokens whose K/V this sequence still holds: n_used less the dropped ones."""
        return self.n_used - self.n_dropped * self.cache.block_size

    def kept_blocks(self) -> np.ndarray:
        """The block ids holding this sequence's K/V, in token order (what a paged
        attention kernel takes instead of the gathered layer_view)."""
        if self._kept is None:
            self._kept = np.asarray(self.block_table[self.n_dropped:], dtype=np.int64)
        return self._kept

    def slot_index(self) -> np.ndarray:
        """Global slot index of each token held, in order (row i of layer_view)."""
        bs = self.cache.block_size
        return (self.kept_blocks()[:, None] * bs + np.arange(bs)).ravel()[:self.n_held]


class PagedKVCache:
    """K/V storage for `num_blocks` blocks, one BlockPool, and the sequences using them."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: np.dtype = np.float16, extra_keys: tuple = (), device=None) -> None:
        self.config = config
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        # The cached K/V depend on the model and the cache dtype as well as the tokens.
        self.extra_keys = (str(np.dtype(dtype)),) + tuple(extra_keys)
        # Optional storage of some layers' K/V outside host memory (see the module docstring).
        self.device = device
        self.device_layers = frozenset(device.layers) if device is not None else frozenset()
        self._host_layers = [i for i in range(config.n_layer) if i not in self.device_layers]
        kv_heads, hd, hd_v = config.n_head_kv, config.head_dim, config.head_dim_v

        def blocks(layer: int) -> int:  # device layers keep an empty host array
            return 0 if layer in self.device_layers else num_blocks

        # k[layer]: (num_blocks, block_size, n_head_kv, head_dim); v: (..., head_dim_v)
        self.k = [np.zeros((blocks(i), block_size, kv_heads, hd), dtype) for i in range(config.n_layer)]
        self.v = [np.zeros((blocks(i), block_size, kv_heads, hd_v), dtype) for i in range(config.n_layer)]
        self.pos = np.zeros((num_blocks, block_size), dtype=np.int64)
        # Flat views (num_blocks * block_size, ...) indexed by global slot.
        self.k_flat = [a.reshape(-1, kv_heads, hd) for a in self.k]
        self.v_flat = [a.reshape(-1, kv_heads, hd_v) for a in self.v]
        self.pos_flat = self.pos.reshape(-1)
        self.bytes_per_block = (config.n_layer * block_size * kv_heads * (hd + hd_v)
                                * np.dtype(dtype).itemsize)  # host and device layers alike
        self._live: set[SequenceKV] = set()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    # -- sequences ------------------------------------------------------------------------------
    def new_sequence(self, n_ctx: int) -> SequenceKV:
        seq = SequenceKV(self, n_ctx)
        self._live.add(seq)
        return seq

    def fork(self, seq: SequenceKV) -> SequenceKV:
        """A new sequence sharing all of `seq`'s blocks; the first write to a shared one copies it."""
        child = self.new_sequence(seq.n_ctx)
        self.pool.touch(seq.block_table[seq.n_dropped:])
        child.block_table = list(seq.block_table)
        child.n_dropped, child.dropped_max_pos = seq.n_dropped, seq.dropped_max_pos
        child.tokens = list(seq.tokens)
        child.block_hashes = list(seq.block_hashes)
        child.n_used = seq.n_used
        return child

    def release(self, seq: SequenceKV) -> None:
        """Give all of `seq`'s blocks back (cached ones stay findable until reused)."""
        seq.truncate(0)
        seq.tokens.clear()
        self._live.discard(seq)

    def reuse_prefix(self, seq: SequenceKV, token_ids: Sequence[int]) -> int:
        """Put the longest cached chain of full blocks for `token_ids` into an EMPTY `seq`.

        Returns how many tokens are now cached (a multiple of block_size); the caller
        prefills the rest. To get logits for the last prompt token, pass prompt[:-1].
        """
        if seq.n_used or seq.block_table or seq.tokens:
            raise ValueError("reuse_prefix needs an empty sequence")
        blocks, _ = self.pool.find_cached_prefix(token_ids, self.extra_keys)
        blocks = blocks[:seq.n_ctx // self.block_size]
        self.pool.touch(blocks)
        n = len(blocks) * self.block_size
        seq.block_table = list(blocks)
        seq.block_hashes = [self.pool.block_hash(b) for b in blocks]
        seq.tokens = [int(t) for t in token_ids[:n]]
        seq.n_used = n
        seq._kept = None
        return n

    def commit_full_blocks(self, seq: SequenceKV) -> int:
        """Register each newly full block (tokens recorded and K/V written) in the prefix cache.

        A block whose slots do not hold positions i*bs .. i*bs+bs-1 (after a context shift)
        stops the chain: its K/V are not what a fresh prompt would compute. Returns the
        number of blocks newly added to the chain.
        """
        bs = self.block_size
        n_full = min(len(seq.tokens), seq.n_used) // bs
        added = 0
        for i in range(len(seq.block_hashes), n_full):
            block = seq.block_table[i]
            if block == DROPPED or not np.array_equal(self.pos[block], np.arange(i * bs, (i + 1) * bs)):
                break
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            h = hash_block(parent, seq.tokens[i * bs:(i + 1) * bs], self.extra_keys)
            self.pool.cache_full_block(block, h)  # False = a twin block holds it already: fine
            seq.block_hashes.append(h)
            added += 1
        return added

    def drop_out_of_window(self, seq: SequenceKV) -> int:
        """Give back leading blocks no future token can attend to; returns how many.

        Only when every layer is a sliding-window layer: a block whose newest position p
        satisfies next_pos - p >= window is masked for every later query (positions only
        grow). The block being written is always kept. Dropped blocks keep their prefix-cache
        hash in the pool, so other sequences can still hit them until they are reused.
        """
        cfg = self.config
        window = cfg.sliding_window
        if not window or not all(cfg.is_swa(layer) for layer in range(cfg.n_layer)) or not seq.n_used:
            return 0
        next_pos = int(self.pos_flat[seq.slot_index()[-1]]) + 1
        freed = []
        i = seq.n_dropped
        while i < len(seq.block_table) - 1:
            block = seq.block_table[i]
            newest = int(self.pos[block].max())
            if newest > next_pos - window:
                break
            freed.append(block)
            seq.block_table[i] = DROPPED
            seq.dropped_max_pos = max(seq.dropped_max_pos, newest)
            i += 1
        seq.n_dropped = i
        seq._kept = None
        self.pool.free(freed)
        return len(freed)

    def stats(self) -> dict:
        return self.pool.stats()

    def check_invariants(self) -> None:
        """Pool invariants plus: each block's ref count == the live tables holding it."""
        self.pool.check_invariants()
        bs = self.block_size
        held = [0] * self.num_blocks
        for seq in self._live:
            assert len(seq.block_table) == _ceil_div(seq.n_used, bs), "block table length != ceil(n_used/bs)"
            assert len(seq.block_hashes) <= seq.n_used // bs
            assert all(b == DROPPED for b in seq.block_table[:seq.n_dropped])
            for b in seq.block_table[seq.n_dropped:]:
                assert b != DROPPED, "a dropped block after a kept one"
                held[b] += 1
        for b in range(self.num_blocks):
            assert held[b] == self.pool.ref_count(b), \
                f"block {b}: ref count {self.pool.ref_count(b)} but held by {held[b]} sequences"

    # -- internals ------------------------------------------------------------------------------
    def _writable(self, block: int) -> bool:
        return self.pool.ref_count(block) == 1 and self.pool.block_hash(block) is None

    def _copy_rows(self, src: int, dst: int, n: int) -> None:
        for i in self._host_layers:
            self.k[i][dst, :n] = self.k[i][src, :n]
            self.v[i][dst, :n] = self.v[i][src, :n]
        self.pos[dst, :n] = self.pos[src, :n]
        if self.device is not None:
            self.device.copy_rows(src, dst, n)
