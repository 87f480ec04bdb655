"""Paged KV cache: fixed-size blocks with prefix caching, one block pool per layer group.

Layer groups (llama.cpp's llama_kv_cache_iswa, vLLM's per-group KV managers): the
full-attention layers form one group and the sliding-window layers of one window another
(`layer_groups`). Each group has its own BlockPool and storage, each sequence one block
table per group, and a layer's K/V live only in its group's blocks. Every group sees the
same tokens at the same block boundaries, and prefix-cache hashes chain over the tokens,
so block i of any group holds tokens i*bs .. i*bs+bs-1 and has the same hash everywhere.

Storage, per layer: K (blocks of its group, block_size, n_head_kv, head_dim), V (...,
head_dim_v); per group, the position stored in every slot (blocks, block_size). A slot's
index in its group is block * block_size + offset.

A `SequenceKV` is one conversation's view: its block tables, the token ids and positions
it holds, and the number of tokens whose K/V is written. It has KVCache's interface (append
/ store / layer_view / truncate / n_used / n_ctx), so the model code runs on it unchanged;
attention masks by the stored positions, so the block order never matters to it.

Blocks are shared between sequences (fork, prefix hits) through ref counts. A block is
written only while exactly one sequence holds it and it is not registered in the prefix
cache; otherwise the first write into it copies it (copy-on-write), which is what makes
fork, regenerate-from-the-middle and cached prefixes safe.

Sliding-window groups give back what no query still to come can see. Before each append (a
decode step, a prefill chunk) the leading blocks whose positions are all <= q0 - window
(q0: the first new position; positions only grow) go back to the pool, keeping their
prefix-cache hash in the LRU free list; their table entries become DROPPED. A group so
holds about window + chunk tokens per sequence, while the full-attention group holds all.
Drops come in whole multiples of `drop_align` tokens (32): the exact attention kernels sum
key j into accumulator j % 32 (and softmax terms in groups of 8), so with aligned drops
every kept key keeps its accumulator and a paged sliding-window layer computes bit for bit
what the contiguous KVCache computes.

Prefix hits (`reuse_prefix`): the longest whole-block prefix whose blocks every full group
has cached and for which each sliding-window group has cached the blocks covering the last
`window` positions before the hit point (earlier ones may be gone). Truncating a sequence
(regenerate, edit, cancel) to a point whose window reaches back into dropped blocks takes
them back from the prefix cache by their hashes; if some are gone the sequence is
shortened to the longest length every group can serve (callers read n_used) and the rest
is recomputed, so cached runs stay equal to cache-free ones.

Device storage (GPU-offloaded layers): a `device` object given to PagedKVCache keeps the
K/V of `device.layers` elsewhere (VRAM, edgeinfer.backend_cuda.DeviceBlockStorage), in
blocks with the same ids as one group's pool, so ref counts, the prefix cache and
copy-on-write cover them unchanged. All device layers are in one group (a full-attention
group unless every device layer is a sliding-window layer); it is the sequence's "primary"
group, whose table `block_table` / `kept_blocks()` / `n_held` / `n_dropped` describe (what
DeviceBlockStorage reads). The cache tells the device about every append (positions of new
slots), store and block copy of that group; layer_view of a device layer asks it for a
download. Those layers get no host arrays. Without a device nothing here changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from edgeinfer.block_pool import ROOT_HASH, BlockHash, BlockPool, KVPoolExhaustedError, hash_block
from edgeinfer.errors import ContextOverflowError
from edgeinfer.models.base import ModelConfig

DROPPED = -1  # block-table entry of a leading block given back as out of every window
MASKED_POS = -(1 << 30)  # stored position of a slot with no K/V (outside every window)
DROP_ALIGN = 32  # sliding-window groups drop whole multiples of this many tokens


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _align_down(n: int, quantum: int) -> int:
    return n - n % quantum


def _ascending_run(blocks: np.ndarray) -> bool:
    """Whether blocks are b, b+1, b+2, ... (first/last already checked by the caller)."""
    return len(blocks) < 3 or bool(np.all(np.diff(blocks) == 1))


def _first_above(pos: np.ndarray, limit: int, ascending: bool) -> int:
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
    for i in range(config.n_layer):
        window = device_window if i in device else (w if w and config.is_swa(i) else 0)
        by_window.setdefault(window, []).append(i)
    return [(window, tuple(by_window[window])) for window in sorted(by_window)]


def drop_quantum(block_size: int, window: int, drop_align: int = DROP_ALIGN) -> int:
    """Blocks a sliding-window group drops at a time (1 for a full-attention group)."""
    return math.lcm(block_size, max(1, drop_align)) // block_size if window else 1


class LayerGroup:
    """Layers whose K/V share one block pool; every sequence has one block table per group."""

    def __init__(self, index: int, window: int, layers: tuple[int, ...], num_blocks: int, block_size: int,
                 quantum: int, device, bytes_per_layer_block: int) -> None:
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
        self.bytes_per_block = len(layers) * bytes_per_layer_block

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


class _Appended(NamedTuple):
    """What the latest append handed out (store() maps the returned slots per group)."""

    slots: np.ndarray  # returned to the caller: the primary group's slots (-1 = not stored)
    group_slots: list[np.ndarray]  # per group, slot of each new row (-1 = not stored)
    first: list[int]  # per group, how many leading new rows are not stored
    device_slots: np.ndarray | None  # the slots given to device.on_append


class SequenceKV:
    """One sequence in a PagedKVCache; duck-types edgeinfer.kv_cache.KVCache."""

    def __init__(self, cache: "PagedKVCache", n_ctx: int) -> None:
        self.cache = cache
        self.n_ctx = n_ctx
        self.tables = [GroupTable(g) for g in cache.groups]
        self.tokens: list[int] = []  # token ids, position i at index i (see record_tokens)
        self.block_hashes: list[BlockHash] = []  # chained hashes of the committed full blocks
        self.n_used = 0  # tokens whose slots are appended (K/V written by the model)
        self._pos = np.zeros(64, dtype=np.int64)  # position of token i; valid below n_used
        self._ascending = True  # positions strictly increase (always, from the engine)
        self._last: _Appended | None = None

    # -- the primary group (the device's; what block_table and friends describe) ---------------
    @property
    def primary(self) -> GroupTable:
        return self.tables[self.cache.primary.index]

    @property
    def block_table(self) -> list[int]:
        return self.primary.blocks

    @property
    def n_dropped(self) -> int:
        return self.primary.n_dropped

    @property
    def n_held(self) -> int:
        """Tokens whose K/V the primary group still holds: n_used less its dropped ones."""
        return self.n_used - self.primary.n_dropped * self.cache.block_size

    def kept_blocks(self) -> np.ndarray:
        """The primary group's block ids holding this sequence's K/V, in token order (what a
        paged attention kernel takes instead of the gathered layer_view)."""
        return self.primary.kept()

    def slot_index(self) -> np.ndarray:
        """Slot index (in the primary group) of each token it holds, in order."""
        bs = self.cache.block_size
        return (self.kept_blocks()[:, None] * bs + np.arange(bs)).ravel()[:self.n_held]

    @property
    def positions(self) -> np.ndarray:
        """Position of each token, index 0 .. n_used-1."""
        return self._pos[:self.n_used]

    # -- the KVCache interface --------------------------------------------------------------
    def append(self, positions: np.ndarray) -> np.ndarray:
        """Reserve slots for new tokens at `positions`; returns their slots (pass them to store).

        Sliding-window groups first give back the blocks out of the window of the first new
        position. All or nothing: on ContextOverflowError / KVPoolExhaustedError nothing changes.
        """
        positions = np.asarray(positions, dtype=np.int64)
        n = len(positions)
        if self.n_used + n > self.n_ctx:
            raise ContextOverflowError(
                f"context is full: {self.n_used} cached + {n} new tokens exceed --ctx-size {self.n_ctx}")
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        return self._extend(positions, int(positions.min()))

    def store(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        c = self.cache
        g = c.group_of[layer]
        last = self._last
        if last is not None and slots is last.slots:
            gslots, first, device_slots = last.group_slots[g.index], last.first[g.index], last.device_slots
        else:  # slots of an earlier append: map them through the tables
            gslots = self._slots_in(g, slots)
            keep = gslots >= 0
            if not keep.all():
                gslots, k, v = gslots[keep], np.asarray(k)[keep], np.asarray(v)[keep]
            first, device_slots = 0, gslots
        if first:  # rows in dropped blocks (import, context shift): not stored
            gslots, k, v = gslots[first:], k[first:], v[first:]
        if layer in c.device_layers:
            c.device.store(self, layer, device_slots, k, v)
            return
        c.k_flat[layer][gslots] = k
        c.v_flat[layer][gslots] = v

    def layer_view(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(k (S, n_head_kv, hd), v (S, n_head_kv, hd_v), pos (S,)) in token order.

        S = n_used, less the tokens of blocks this layer's group dropped (out of its window).
        """
        c = self.cache
        g = c.group_of[layer]
        t = self.tables[g.index]
        blocks, held = t.kept(), self.n_used - t.n_dropped * c.block_size
        if layer in c.device_layers:  # a download (CPU fallbacks, context shift, export)
            k, v = c.device.layer_view(self, layer)
            return k, v, g.pos[blocks].reshape(-1)[:held]
        if len(blocks) and blocks[-1] - blocks[0] == len(blocks) - 1 and _ascending_run(blocks):
            # One run of consecutive blocks (the usual case for a conversation that grew in
            # a fresh pool): a zero-copy view, as KVCache.layer_view returns.
            lo = int(blocks[0]) * c.block_size
            return c.k_flat[layer][lo:lo + held], c.v_flat[layer][lo:lo + held], g.pos_flat[lo:lo + held]
        # Gather whole blocks (a few large copies), then cut the partial last block.
        k = c.k[layer][blocks].reshape(-1, *c.k[layer].shape[2:])[:held]
        v = c.v[layer][blocks].reshape(-1, *c.v[layer].shape[2:])[:held]
        return k, v, g.pos[blocks].reshape(-1)[:held]

    def truncate(self, n: int) -> None:
        """Forget every token from index n on; blocks no longer needed go back to the pool.

        If a sliding-window group dropped blocks the next token's window needs again, they
        are taken back from the prefix cache; when some are gone the sequence is cut to the
        longest length every group can serve (down to 0): callers read n_used.
        """
        n = max(0, n)
        target = min(n, self.n_used)
        m = self._servable(target)
        del self.tokens[(n if m == target else m):]  # recorded ids may run ahead of n_used
        for t in self.tables:
            self._cut(t, m)
        del self.block_hashes[m // self.cache.block_size:]
        self.n_used = m
        self._last = None
        if m == 0:
            self._ascending = True

    @property
    def nbytes(self) -> int:
        return sum(len(t.held()) * t.group.bytes_per_block for t in self.tables)

    # -- token bookkeeping for the prefix cache --------------------------------------------
    def record_tokens(self, token_ids: Sequence[int]) -> None:
        """Note the ids of tokens fed to the model after those already recorded.

        The model's `append` sees positions only; the session manager records the ids
        (before or after the forward) so `commit_full_blocks` can hash full blocks.
        """
        self.tokens.extend(int(t) for t in token_ids)

    # -- whole-sequence operations (context shift, saved K/V) ----------------------------------
    def shift(self, n_keep: int, rerope: Callable[[int, np.ndarray, np.ndarray], np.ndarray]) -> int:
        """Context shift in place: keep the first n_keep tokens, discard the next
        (n_used - n_keep) // 2 and move the rest back by as many positions; returns how many
        were discarded (0 = cannot). `rerope(layer, k, delta)` re-rotates roped keys (float32).

        Every group keeps what the next queries can see: a group holding the first n_keep
        tokens keeps them in place and re-appends the moved tail; a sliding-window group
        that dropped blocks is rebuilt from the rows it holds, rows it lacks (out of its
        window, or the kept prefix it already gave back, as llama.cpp's SWA cache lacks
        them too) get no K/V and a masked position. `tokens` loses the same range.
        """
        c, bs = self.cache, self.cache.block_size
        n = self.n_used
        n_keep = max(0, min(n_keep, n - 1))
        n_discard = (n - n_keep) // 2
        if n_discard <= 0:
            return 0
        lo, hi, n2 = n_keep, n_keep + n_discard, n - n_discard
        old_pos = self._pos[:n]
        new_pos = np.concatenate([old_pos[:lo], old_pos[hi:] - n_discard])
        src = np.concatenate([np.arange(lo), np.arange(hi, n)])  # old index of each new row
        next_pos = int(new_pos[-1]) + 1
        # Room check first (nothing changes when a pool cannot take the rebuilt rows).
        plans = []
        for t in self.tables:
            g = t.group
            keep = lo if t.n_dropped == 0 else 0  # rows left in place
            kept_blocks = _ceil_div(keep, bs)
            drop_to = 0
            if g.window:
                f = _first_above(new_pos, next_pos - g.window, self._ascending)
                drop_to = _align_down(f // bs, g.quantum)
            # blocks past `keep` go back, and kept ones the window left behind
            freed = t.blocks[kept_blocks:] + t.blocks[t.n_dropped:min(drop_to, kept_blocks)]
            room = g.pool.num_free + sum(1 for b in freed if b != DROPPED and g.pool.ref_count(b) == 1)
            if _ceil_div(n2, bs) - max(kept_blocks, drop_to) + 1 > room:
                return 0
            plans.append((keep, max(keep, drop_to * bs), drop_to))
        # Gather (copies) the rows each group will store, before any block goes back.
        data = []
        for t, (keep, first_row, _) in zip(self.tables, plans):
            h0 = t.n_dropped * bs
            rows = src[first_row:]
            held = rows >= h0
            moved = held & (np.arange(first_row, n2) >= lo)
            stored = new_pos[keep:].copy()
            stored[np.concatenate([np.zeros(first_row - keep, bool), ~held])] = MASKED_POS
            kv = {}
            for layer in t.group.layers:
                k, v, _ = self.layer_view(layer)
                kn = np.zeros((n2 - first_row,) + k.shape[1:], np.float32)
                vn = np.zeros((n2 - first_row,) + v.shape[1:], np.float32)
                kn[held] = k[rows[held] - h0]
                vn[held] = v[rows[held] - h0]
                if moved.any():
                    kn[moved] = rerope(layer, kn[moved], np.full(int(moved.sum()), -n_discard, np.int64))
                kv[layer] = (kn, vn)
            data.append((stored, kv))
        tokens = list(self.tokens)
        for t, (keep, _, _) in zip(self.tables, plans):
            self._cut(t, keep)
        del self.block_hashes[lo // bs:]
        self._pos[:n2] = new_pos
        group_slots = []
        for t, (keep, _, drop_to), (stored, _) in zip(self.tables, plans, data):
            plan = self._plan(t, keep, n2, next_pos)
            assert plan[0] == drop_to
            self._check_room([t], [plan])
            group_slots.append(self._apply(t, plan, keep, n2, stored))
        self.n_used = n2
        self._last = None
        for t, (keep, first_row, _), gslots, (stored, kv) in zip(self.tables, plans, group_slots, data):
            g = t.group
            slots = gslots[first_row - keep:]  # the stored rows' slots (the rest are in dropped blocks)
            if g.device is not None:
                g.device.on_append(self, slots, stored[first_row - keep:])
            for layer, (kn, vn) in kv.items():
                if layer in c.device_layers:
                    g.device.store(self, layer, slots, kn, vn)
                else:
                    c.k_flat[layer][slots] = kn
                    c.v_flat[layer][slots] = vn
        self.tokens = tokens[:lo] + tokens[hi:]
        return n_discard

    def load(self, positions: np.ndarray, k: Sequence[np.ndarray], v: Sequence[np.ndarray]) -> None:
        """Fill an EMPTY sequence with saved K/V (per layer (n, n_head_kv, hd)) at `positions`.

        Sliding-window groups take only the blocks the next token's window needs. Rows that
        are NaN in a sliding-window layer (what `export` writes for rows no longer held) get
        no K/V and a masked position, and their blocks are never registered in the prefix
        cache. ValueError if a full-attention layer lacks rows.
        """
        if self.n_used or self.tokens:
            raise ValueError("load needs an empty sequence")
        positions = np.asarray(positions, dtype=np.int64)
        n = len(positions)
        if n == 0:
            return
        if n > self.n_ctx:
            raise ContextOverflowError(f"{n} saved tokens exceed --ctx-size {self.n_ctx}")
        stored, missing = [], []
        for g in self.cache.groups:
            miss = np.zeros(n, dtype=bool)
            for layer in g.layers:
                for a in (k[layer], v[layer]):
                    miss |= np.isnan(np.asarray(a).reshape(n, -1)).any(axis=1)
            if miss.any() and not g.window:
                raise ValueError("saved K/V lack rows of a full-attention layer")
            s = positions.copy()
            s[miss] = MASKED_POS
            stored.append(s)
            missing.append(miss if miss.any() else None)
        slots = self._extend(positions, int(positions[-1]) + 1, stored)
        for layer in range(self.cache.config.n_layer):
            miss = missing[self.cache.group_of[layer].index]
            kl, vl = np.asarray(k[layer]), np.asarray(v[layer])
            if miss is not None:
                kl = np.where(miss[:, None, None], 0, kl)
                vl = np.where(miss[:, None, None], 0, vl)
            self.store(layer, slots, kl, vl)

    def export(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(k, v) per layer with n_used rows each, copies; rows a sliding-window group no
        longer holds (dropped blocks, masked slots) are NaN (`load` knows them)."""
        n = self.n_used
        ks, vs = [], []
        for layer in range(self.cache.config.n_layer):
            k, v, p = self.layer_view(layer)
            k, v = np.array(k), np.array(v)
            gone = n - len(k)
            masked = np.asarray(p) == MASKED_POS
            if gone or masked.any():
                k = np.concatenate([np.full((gone,) + k.shape[1:], np.nan, k.dtype), k])
                v = np.concatenate([np.full((gone,) + v.shape[1:], np.nan, v.dtype), v])
                k[gone:][masked] = np.nan
                v[gone:][masked] = np.nan
            ks.append(k)
            vs.append(v)
        return ks, vs

    # -- internals -----------------------------------------------------------------------------
    def _extend(self, positions: np.ndarray, q0: int, stored: list[np.ndarray] | None = None) -> np.ndarray:
        """Append rows at `positions`; q0 = the first position a query will still have.
        `stored`: per group, the positions to store (MASKED_POS for rows without K/V)."""
        c = self.cache
        start, stop = self.n_used, self.n_used + len(positions)
        self._put_positions(start, positions)  # scratch until n_used moves
        ascending = self._ascending and bool(np.all(np.diff(positions) > 0)) and (
            start == 0 or positions[0] > self._pos[start - 1])
        plans = [self._plan(t, start, stop, q0, ascending) for t in self.tables]
        self._check_room(self.tables, plans)
        group_slots = [self._apply(t, plan, start, stop, positions if stored is None else stored[t.group.index])
                       for t, plan in zip(self.tables, plans)]
        self.n_used = stop
        self._ascending = ascending
        first = [0 if gs[0] >= 0 else int(np.count_nonzero(gs < 0)) for gs in group_slots]
        p = c.primary.index
        device_slots = None
        if c.device is not None:
            device_slots = group_slots[p] if not first[p] else group_slots[p][first[p]:]
            own = positions if stored is None else stored[p]
            c.device.on_append(self, device_slots, own[first[p]:])
        self._last = _Appended(group_slots[p], group_slots, first, device_slots)
        return group_slots[p]

    def _put_positions(self, start: int, positions: np.ndarray) -> None:
        stop = start + len(positions)
        if stop > len(self._pos):
            grown = np.zeros(max(stop, 2 * len(self._pos)), dtype=np.int64)
            grown[:start] = self._pos[:start]
            self._pos = grown
        self._pos[start:stop] = positions

    def _first_in_window(self, stop: int, limit: int, ascending: bool | None = None) -> int:
        """First token index below `stop` whose position is > limit (stop if none)."""
        return _first_above(self._pos[:stop], limit, self._ascending if ascending is None else ascending)

    def _needed_from(self, g: LayerGroup, m: int) -> int:
        """First block (aligned) group g must hold when the sequence has m tokens: the next
        query (the position after token m-1) sees keys back to window - 1 positions."""
        if not g.window or m == 0:
            return 0
        limit = int(self._pos[m - 1]) + 1 - g.window
        return _align_down(self._first_in_window(m, limit) // self.cache.block_size, g.quantum)

    def _plan(self, t: GroupTable, start: int, stop: int, q0: int, ascending: bool | None = None
              ) -> tuple[int, int, bool]:
        """(drop_to, new blocks, copy the partial last block) for rows [start, stop)."""
        g, bs = t.group, self.cache.block_size
        drop_to = t.n_dropped
        if g.window:
            f = self._first_in_window(stop, q0 - g.window, ascending)
            drop_to = max(drop_to, _align_down(f // bs, g.quantum))
        n_new = _ceil_div(stop, bs) - max(len(t.blocks), drop_to)
        last = start // bs
        copy_last = start % bs != 0 and last >= drop_to and not self.cache._writable(g, t.blocks[last])
        return drop_to, n_new, copy_last

    def _check_room(self, tables: Sequence[GroupTable], plans: Sequence[tuple[int, int, bool]]) -> None:
        c = self.cache
        for t, (drop_to, n_new, copy_last) in zip(tables, plans):
            pool, need = t.group.pool, n_new + copy_last
            if need <= pool.num_free:
                continue
            free = pool.num_free + sum(1 for b in t.blocks[t.n_dropped:drop_to] if pool.ref_count(b) == 1)
            if need > free:
                where = f" for the {t.group.name}" if len(c.groups) > 1 else ""
                raise KVPoolExhaustedError(
                    f"KV cache is full: need {need} more blocks of {c.block_size} tokens{where}, "
                    f"only {free} of {pool.num_blocks} are free")

    def _apply(self, t: GroupTable, plan: tuple[int, int, bool], start: int, stop: int,
               stored: np.ndarray) -> np.ndarray:
        """Drop, allocate and copy-on-write as planned; write the stored positions of rows
        [start, stop); returns their slots in this group (-1: in a dropped block)."""
        g, pool, bs = t.group, t.group.pool, self.cache.block_size
        drop_to, n_new, copy_last = plan
        old = len(t.blocks)
        if drop_to > t.n_dropped:
            freed = t.blocks[t.n_dropped:drop_to]
            t.blocks[t.n_dropped:min(drop_to, old)] = [DROPPED] * (min(drop_to, old) - t.n_dropped)
            t.blocks.extend([DROPPED] * (drop_to - old))
            t.n_dropped = drop_to
            pool.free(freed[::-1])  # oldest first: the newest stay cached longest (regenerate)
            t._kept = None
        blocks = pool.allocate(n_new + copy_last)  # checked by _check_room
        if copy_last:  # the partial last block is shared or cached: copy it, then write the copy
            last = start // bs
            src, dst = t.blocks[last], blocks.pop(0)
            self.cache._copy_rows(g, src, dst, start % bs)
            t.blocks[last] = dst
            pool.free([src])
            t._kept = None
        if blocks:
            t.blocks.extend(blocks)
            t._kept = None
        idx = np.arange(start, stop)
        table = np.asarray(t.blocks, dtype=np.int64)[idx // bs]
        slots = table * bs + idx % bs
        if table[0] < 0:  # rows in dropped blocks (leading): no slot
            held = table >= 0
            slots[~held] = -1
            g.pos_flat[slots[held]] = stored[held]
        else:
            g.pos_flat[slots] = stored
        return slots

    def _cut(self, t: GroupTable, m: int) -> None:
        """Give back group table entries past the block of token m - 1."""
        keep = _ceil_div(m, self.cache.block_size)
        if len(t.blocks) <= keep:
            return
        freed = [b for b in t.blocks[keep:] if b != DROPPED]
        del t.blocks[keep:]
        t.n_dropped = min(t.n_dropped, keep)
        t._kept = None
        t.group.pool.free(freed)

    def _servable(self, m: int) -> int:
        """The longest length <= m every group can serve: dropped blocks the next token's
        window needs are taken back from the prefix cache (by this sequence's hashes)."""
        bs = self.cache.block_size
        while m > 0:
            found: list[tuple[GroupTable, int, list[int]]] = []
            missing = None
            for t in self.tables:
                if not t.n_dropped:
                    continue
                lo = self._needed_from(t.group, m)
                hi = min(t.n_dropped, _ceil_div(m, bs))
                blocks = []
                for i in range(lo, hi):
                    b = t.group.pool.lookup(self.block_hashes[i]) if i < len(self.block_hashes) else None
                    if b is None:
                        missing = i
                        break
                    blocks.append(b)
                if missing is not None:
                    break
                if blocks:
                    found.append((t, lo, blocks))
            if missing is None:
                for t, lo, blocks in found:
                    t.group.pool.touch(blocks)
                    t.blocks[lo:lo + len(blocks)] = blocks
                    t.n_dropped = lo
                    t._kept = None
                return m
            m = min(missing * bs, (m - 1) // bs * bs)  # end before the missing block, and retry
        return 0

    def _slots_in(self, g: LayerGroup, slots: np.ndarray) -> np.ndarray:
        """Slots of group g for primary-group `slots` (of the tokens this sequence holds there)."""
        bs = self.cache.block_size
        slots = np.asarray(slots, dtype=np.int64)
        p = self.primary
        index = {b: i for i, b in enumerate(p.blocks) if b != DROPPED}
        idx = np.array([index[int(s) // bs] * bs + int(s) % bs if s >= 0 else -1 for s in slots], np.int64)
        if g is self.cache.primary:
            return np.where(idx >= 0, slots, -1)
        table = np.asarray(self.tables[g.index].blocks, dtype=np.int64)
        out = np.full(len(idx), -1, np.int64)
        ok = idx >= 0
        b = table[idx[ok] // bs]
        out[ok] = np.where(b >= 0, b * bs + idx[ok] % bs, -1)
        return out


class PagedKVCache:
    """K/V storage for the layer groups' pools, and the sequences using them.

    `num_blocks`: blocks per group; an int gives every group that many, a mapping
    {window: blocks} sizes each group (window 0 = the full-attention group).
    `drop_align`: sliding-window groups drop whole multiples of this many tokens.
    """

    def __init__(self, config: ModelConfig, num_blocks: int | Mapping[int, int], block_size: int = 16,
                 dtype: np.dtype = np.float16, extra_keys: tuple = (), device=None,
                 drop_align: int = DROP_ALIGN) -> None:
        self.config = config
        self.block_size = block_size
        # The cached K/V depend on the model and the cache dtype as well as the tokens.
        self.extra_keys = (str(np.dtype(dtype)),) + tuple(extra_keys)
        # Optional storage of some layers' K/V outside host memory (see the module docstring).
        self.device = device
        self.device_layers = frozenset(device.layers) if device is not None else frozenset()
        kv_heads, hd, hd_v = config.n_head_kv, config.head_dim, config.head_dim_v
        per_layer_block = block_size * kv_heads * (hd + hd_v) * np.dtype(dtype).itemsize
        self.groups: list[LayerGroup] = []
        for index, (window, layers) in enumerate(layer_groups(config, self.device_layers)):
            blocks = num_blocks if isinstance(num_blocks, int) else num_blocks[window]
            on_device = device if any(i in self.device_layers for i in layers) else None
            self.groups.append(LayerGroup(index, window, layers, blocks, block_size,
                                          drop_quantum(block_size, window, drop_align), on_device,
                                          per_layer_block))
        self.primary = next((g for g in self.groups if g.device is not None), self.groups[0])
        if device is not None and getattr(device, "num_blocks", self.primary.num_blocks) != self.primary.num_blocks:
            raise ValueError(f"device storage has {device.num_blocks} blocks, its group {self.primary.num_blocks}")
        self.group_of: list[LayerGroup] = [self.groups[0]] * config.n_layer
        for g in self.groups:
            for i in g.layers:
                self.group_of[i] = g

        def blocks(layer: int) -> int:  # device layers keep an empty host array
            return 0 if layer in self.device_layers else self.group_of[layer].num_blocks

        # k[layer]: (blocks of its group, block_size, n_head_kv, head_dim); v: (..., head_dim_v)
        self.k = [np.zeros((blocks(i), block_size, kv_heads, hd), dtype) for i in range(config.n_layer)]
        self.v = [np.zeros((blocks(i), block_size, kv_heads, hd_v), dtype) for i in range(config.n_layer)]
        # Flat views (blocks * block_size, ...) indexed by slot.
        self.k_flat = [a.reshape(-1, kv_heads, hd) for a in self.k]
        self.v_flat = [a.reshape(-1, kv_heads, hd_v) for a in self.v]
        self.hits = 0  # full blocks reused by reuse_prefix
        self.queries = 0  # full blocks asked for by reuse_prefix
        self._live: set[SequenceKV] = set()

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
        child._ascending = seq._ascending
        return child

    def release(self, seq: SequenceKV) -> None:
        """Give all of `seq`'s blocks back (cached ones stay findable until reused)."""
        seq.truncate(0)
        seq.tokens.clear()
        self._live.discard(seq)

    def reuse_prefix(self, seq: SequenceKV, token_ids: Sequence[int]) -> int:
        """Put the longest cached prefix of whole blocks of `token_ids` into an EMPTY `seq`.

        Every full-attention group must have all its blocks cached, each sliding-window group
        those covering the last `window` positions before the hit point. Returns how many
        tokens are now cached (a multiple of block_size); the caller prefills the rest. To
        get logits for the last prompt token, pass prompt[:-1].
        """
        if seq.n_used or seq.tokens or any(t.blocks for t in seq.tables):
            raise ValueError("reuse_prefix needs an empty sequence")
        bs = self.block_size
        n_full = len(token_ids) // bs
        full = [g for g in self.groups if not g.window]
        hashes: list[BlockHash] = []
        found: list[list[int | None]] = [[] for _ in self.groups]
        parent = ROOT_HASH
        for i in range(min(n_full, seq.n_ctx // bs)):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs], self.extra_keys)
            got = [g.pool.lookup(parent) for g in self.groups]
            if any(got[g.index] is None for g in full):
                break
            hashes.append(parent)
            for g in self.groups:
                found[g.index].append(got[g.index])
        j = len(hashes)
        while j and not all(self._window_cached(g, found[g.index], j) for g in self.groups if g.window):
            j -= 1
        self.queries += n_full
        self.hits += j
        n = j * bs
        for t in seq.tables:
            g = t.group
            lo = _align_down(max(0, n - g.window + 1) // bs, g.quantum) if g.window else 0
            blocks = found[g.index][lo:j]
            g.pool.touch(blocks)
            t.blocks, t.n_dropped, t._kept = [DROPPED] * lo + blocks, lo, None
        seq.block_hashes = hashes[:j]
        seq.tokens = [int(t) for t in token_ids[:n]]
        seq._put_positions(0, np.arange(n, dtype=np.int64))
        seq.n_used = n
        return n

    def _window_cached(self, g: LayerGroup, found: list[int | None], j: int) -> bool:
        n = j * self.block_size
        lo = _align_down(max(0, n - g.window + 1) // self.block_size, g.quantum)
        return all(b is not None for b in found[lo:j])

    def commit_full_blocks(self, seq: SequenceKV) -> int:
        """Register each newly full block (tokens recorded and K/V written) in the prefix cache.

        A block whose tokens do not sit at positions i*bs .. i*bs+bs-1 (after a context shift)
        stops the chain: its K/V are not what a fresh prompt would compute. Each group
        registers its own block of the chain where it holds one with every row stored
        (dropped blocks and masked rows are skipped). Returns the blocks added to the chain.
        """
        bs = self.block_size
        n_full = min(len(seq.tokens), seq.n_used) // bs
        added = 0
        for i in range(len(seq.block_hashes), n_full):
            want = np.arange(i * bs, (i + 1) * bs)
            if not np.array_equal(seq._pos[i * bs:(i + 1) * bs], want):
                break
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            h = hash_block(parent, seq.tokens[i * bs:(i + 1) * bs], self.extra_keys)
            for t in seq.tables:
                block = t.blocks[i]
                if block != DROPPED and np.array_equal(t.group.pos[block], want):
                    t.group.pool.cache_full_block(block, h)  # False = a twin block holds it: fine
            seq.block_hashes.append(h)
            added += 1
        return added

    def drop_out_of_window(self, seq: SequenceKV) -> int:
        """Give back the sliding-window blocks the next token can no longer see; returns how
        many (append does this by itself before every write). Dropped blocks keep their
        prefix-cache hash, so they stay findable until reused."""
        if not seq.n_used:
            return 0
        dropped = 0
        for t in seq.tables:
            if not t.group.window:
                continue
            drop_to = min(seq._needed_from(t.group, seq.n_used), len(t.blocks))
            if drop_to > t.n_dropped:
                freed = t.blocks[t.n_dropped:drop_to]
                t.blocks[t.n_dropped:drop_to] = [DROPPED] * len(freed)
                t.n_dropped, t._kept = drop_to, None
                t.group.pool.free(freed[::-1])  # oldest first
                dropped += len(freed)
        return dropped

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
                assert len(t.blocks) == _ceil_div(seq.n_used, bs), "block table length != ceil(n_used/bs)"
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
    def _writable(self, g: LayerGroup, block: int) -> bool:
        return g.pool.ref_count(block) == 1 and g.pool.block_hash(block) is None

    def _copy_rows(self, g: LayerGroup, src: int, dst: int, n: int) -> None:
        for i in g.host_layers:
            self.k[i][dst, :n] = self.k[i][src, :n]
            self.v[i][dst, :n] = self.v[i][src, :n]
        g.pos[dst, :n] = g.pos[src, :n]
        if g.device is not None:
            g.device.copy_rows(src, dst, n)
