"""One sequence's K/V in a PagedKVCache: its block tables, copy-on-write, sliding-window drops.

A `SequenceKV` is one conversation's view: one block table per layer group
(edgeinfer.kv.groups), the token ids and positions it holds, and the number of tokens whose
K/V is written. It implements KVView (append / store / layer_view / truncate / n_used /
n_ctx), so the model code runs on it unchanged; attention masks by the stored positions, so
the block order never matters to it.

Storage, per layer: K (blocks of its group, block_size, its K/V heads, head_dim), V (...,
head_dim_v); per group, the position stored in every slot (blocks, block_size). A slot's
index in its group is block * block_size + offset.

Blocks are shared between sequences (fork, prefix hits) through ref counts. A block is
written only while exactly one sequence holds it and it is not registered in the prefix
cache; otherwise the first write into it copies it (copy-on-write), which is what makes
fork, regenerate-from-the-middle and cached prefixes safe.

Sliding-window groups give back what no query still to come can see. Before each append (a
decode step, a prefill chunk) the leading blocks whose positions are all <= q0 - window
(q0: the first new position; positions only grow) go back to the pool, keeping their
prefix-cache hash in the LRU free list; their table entries become DROPPED. A group so
holds about window + chunk tokens per sequence, while the full-attention group holds all.
Truncating a sequence (regenerate, edit, cancel) to a point whose window reaches back into
dropped blocks takes them back from the prefix cache by their hashes; if some are gone the
sequence is shortened to the longest length every group can serve (callers read n_used)
and the rest is recomputed, so cached runs stay equal to cache-free ones.

Device layers: the cache tells its device storage (edgeinfer.kv.device_storage) about every
append of the primary group (positions of new slots) and every store of a device layer;
layer_view of a device layer asks it for a download.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from edgeinfer.errors import ContextOverflowError
from edgeinfer.kv.block_pool import BlockHash, KVPoolExhaustedError
from edgeinfer.kv.groups import (DROPPED, MASKED_POS, GroupTable, LayerGroup, align_down, ascending_run,
                                 ceil_div, first_above)
from edgeinfer.kv.recurrent import new_state
from edgeinfer.kv.view import KVView

if TYPE_CHECKING:
    from edgeinfer.models.config import ModelConfig


class BlockOwner(Protocol):
    """What a sequence needs of the paged cache that owns its blocks (a PagedKVCache is one;
    a protocol here so that this module does not import the cache that imports it)."""

    config: ModelConfig
    block_size: int
    extra_keys: tuple
    cache_types: Any  # edgeinfer.kv.cache_types.CacheTypes
    groups: list[LayerGroup]
    primary: LayerGroup
    group_of: list[LayerGroup]

    def writable(self, g: LayerGroup, block: int) -> bool:
        """Whether `block` is held by one sequence only and not in the prefix cache."""

    def copy_rows(self, g: LayerGroup, src: int, dst: int, n: int) -> None:
        """Copy the first `n` rows of block `src` into block `dst` in every layer of `g`."""


class _Appended(NamedTuple):
    """What the latest append handed out (store() maps the returned slots per group)."""

    slots: np.ndarray  # returned to the caller: the primary group's slots (-1 = not stored)
    group_slots: list[np.ndarray]  # per group, slot of each new row (-1 = not stored)
    first: list[int]  # per group, how many leading new rows are not stored
    device_slots: np.ndarray | None  # the slots given to device.on_append


class SequenceKV(KVView):
    """One sequence in a PagedKVCache (a KVView)."""

    def __init__(self, cache: BlockOwner, n_ctx: int) -> None:
        self.cache = cache
        self.n_ctx = n_ctx
        self.tables = [GroupTable(g) for g in cache.groups]
        self.tokens: list[int] = []  # token ids, position i at index i (see record_tokens)
        self.block_hashes: list[BlockHash] = []  # chained hashes of the committed full blocks
        self.n_used = 0  # tokens whose slots are appended (K/V written by the model)
        self._pos = np.zeros(64, dtype=np.int64)  # position of token i; valid below n_used
        self._ascending = True  # positions strictly increase (always, from the engine)
        self._last: _Appended | None = None
        # the recurrent layers' state (hybrid models, edgeinfer.kv.recurrent), else None
        self.recurrent = new_state(cache.config)

    @property
    def cache_types(self):
        """The pool's K/V types (edgeinfer.kv.cache_types.CacheTypes): what layer_view's rows are."""
        return self.cache.cache_types

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
        slots = self._extend(positions, int(positions.min()))
        if self.recurrent is not None:
            self.recurrent.begin(self.n_used - n, n)
        return slots

    def direct_device_slots(self, layer: int, slots: np.ndarray) -> np.ndarray | None:
        """The device slots store(layer, slots, ...) hands the VRAM blocks unchanged (the latest
        append's, every row kept), or None where store() has more to do."""
        c, last = self.cache, self._last
        if last is None or slots is not last.slots or layer not in c.device_layers or last.first[c.group_of[layer].index]:
            return None
        return last.device_slots

    def store(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray, encoded: bool = False) -> None:
        """K/V rows of `layer` into `slots`: float rows the cache encodes to its types, or with
        `encoded` rows already as it stores them (saved K/V)."""
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
            if encoded:
                c.device.store_encoded(layer, gslots, k, v)
            else:
                c.device.store(self, layer, device_slots, k, v)
            return
        if encoded:
            c.k_flat[layer][gslots], c.v_flat[layer][gslots] = k, v
            return
        c.k_flat[layer][gslots] = c.cache_types.encode("k", k)
        c.v_flat[layer][gslots] = c.cache_types.encode("v", v)

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
        if len(blocks) and blocks[-1] - blocks[0] == len(blocks) - 1 and ascending_run(blocks):
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
        longest length every group can serve (down to 0): callers read n_used. A recurrent
        state is put back to the latest point it kept at or before that length
        (edgeinfer.kv.recurrent), and the K/V are cut there too.
        """
        n = max(0, n)
        target = min(n, self.n_used)
        m = self._servable(target)
        if self.recurrent is not None:
            m = self._servable(self.recurrent.truncate(m))
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


    # -- whole-sequence operations (saved K/V; the context shift is edgeinfer.kv.context_shift) --
    def load(self, positions: np.ndarray, k: Sequence[np.ndarray], v: Sequence[np.ndarray]) -> None:
        """Fill an EMPTY sequence with saved K/V (per layer (n, n_head_kv, hd)) at `positions`.

        Rows are as the cache stores them (export's). Sliding-window groups take only the
        blocks the next token's window needs. Rows with the blank marker in a sliding-window
        layer (what `export` writes for rows no longer held) get
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
        types = self.cache.cache_types
        stored, missing = [], []
        for g in self.cache.groups:
            miss = np.zeros(n, dtype=bool)
            for layer in g.layers:
                for which, a in (("k", k[layer]), ("v", v[layer])):
                    miss |= types.blank_mask(which, np.asarray(a))
            if miss.any() and not g.window:
                raise ValueError("saved K/V lack rows of a full-attention layer")
            s = positions.copy()
            s[miss] = MASKED_POS
            stored.append(s)
            missing.append(miss if miss.any() else None)
        slots = self._extend(positions, int(positions[-1]) + 1, stored)
        for layer in range(self.cache.config.n_layer):
            if not self.cache.config.owns_kv(layer):  # shared K/V: stored once, at its owner
                continue
            miss = missing[self.cache.group_of[layer].index]
            kl, vl = np.asarray(k[layer]), np.asarray(v[layer])
            if miss is not None:
                kl = np.where(miss[:, None, None], 0, kl).astype(kl.dtype)
                vl = np.where(miss[:, None, None], 0, vl).astype(vl.dtype)
            self.store(layer, slots, kl, vl, encoded=True)

    def export(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(k, v) per layer with n_used rows each, copies, as the cache stores them (f16, or a
        quantized type's raw blocks); rows a sliding-window group no longer holds (dropped
        blocks, masked slots) carry CacheTypes.blank_rows' marker (`load` knows it). A layer
        reading another's K/V (config.kv_source) gives (n_used, its K/V heads, 0) arrays."""
        n = self.n_used
        cfg, types = self.cache.config, self.cache.cache_types
        ks, vs = [], []
        for layer in range(cfg.n_layer):
            if not cfg.owns_kv(layer):  # a shared K/V is saved once, at its owner: no columns here
                (hk, _), (hv, _) = cfg.saved_kv_shapes(layer)
                ks.append(np.zeros((n, hk, 0), types.dtype("k")))
                vs.append(np.zeros((n, hv, 0), types.dtype("v")))
                continue
            k, v, p = self.layer_view(layer)
            k, v = np.array(k), np.array(v)
            gone = n - len(k)
            masked = np.asarray(p) == MASKED_POS
            if gone or masked.any():
                k = np.concatenate([types.blank_rows("k", (gone,) + k.shape[1:]), k])
                v = np.concatenate([types.blank_rows("v", (gone,) + v.shape[1:]), v])
                k[gone:][masked] = types.blank_rows("k", (int(masked.sum()),) + k.shape[1:])
                v[gone:][masked] = types.blank_rows("v", (int(masked.sum()),) + v.shape[1:])
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
        return first_above(self._pos[:stop], limit, self._ascending if ascending is None else ascending)

    def _needed_from(self, g: LayerGroup, m: int) -> int:
        """First block (aligned) group g must hold when the sequence has m tokens: the next
        query (the position after token m-1) sees keys back to window - 1 positions."""
        if not g.window or m == 0:
            return 0
        limit = int(self._pos[m - 1]) + 1 - g.window
        return align_down(self._first_in_window(m, limit) // self.cache.block_size, g.quantum)

    def _plan(self, t: GroupTable, start: int, stop: int, q0: int, ascending: bool | None = None
              ) -> tuple[int, int, bool]:
        """(drop_to, new blocks, copy the partial last block) for rows [start, stop)."""
        g, bs = t.group, self.cache.block_size
        drop_to = t.n_dropped
        if g.window:
            f = self._first_in_window(stop, q0 - g.window, ascending)
            drop_to = max(drop_to, align_down(f // bs, g.quantum))
        n_new = ceil_div(stop, bs) - max(len(t.blocks), drop_to)
        last = start // bs
        copy_last = start % bs != 0 and last >= drop_to and not self.cache.writable(g, t.blocks[last])
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
            self.cache.copy_rows(g, src, dst, start % bs)
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
        keep = ceil_div(m, self.cache.block_size)
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
                hi = min(t.n_dropped, ceil_div(m, bs))
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

