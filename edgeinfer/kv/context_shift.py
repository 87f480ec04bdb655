"""Context shift: when a sequence fills its window, drop the oldest half after `n_keep` tokens.

As llama.cpp's context shift (`llama_kv_self_seq_rm` + `llama_kv_self_seq_add` + K-shift):
keep the first `n_keep` tokens, discard the next `n_discard = (n_used - n_keep) // 2`, and
move the rest back by `n_discard` positions. Cached keys carry RoPE of their old positions;
RoPE is a rotation by angle pos * freq, so rotating a key by `-n_discard` gives exactly the
key of its new position (`rope_shift`). Values carry no position and move unchanged.

The kept tokens' K/V were computed while the discarded ones were still visible, so after a
shift the cache is not what a fresh prompt would compute (llama.cpp accepts the same): the
session manager never registers post-shift blocks in the prefix cache.

Sliding-window layer groups keep only their window (edgeinfer.kv.groups): after the shift
they hold the moved rows the next queries can see; kept-prefix rows such a group had
already given back stay missing (masked), as in llama.cpp's SWA cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from edgeinfer.backends.base import Backend
from edgeinfer.kv.groups import DROPPED, MASKED_POS, align_down, ceil_div, first_above

if TYPE_CHECKING:
    from edgeinfer.kv.sequence import SequenceKV
    from edgeinfer.models.base import Transformer


def rope_shift(backend: Backend, model: "Transformer", layer: int, k: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Re-rotate roped keys k (n, n_head_kv, head_dim) by `delta` positions (per row).

    Uses `model.rope_args(layer)`, the arguments its attention ropes with. Runs the numpy
    reference `Backend.rope` (the shift is rare and must be exact), whatever backend the
    model runs on. YaRN's magnitude factor is left out: the keys carry it from their first
    rotation, and a second would scale them again (llama.cpp's shift does apply it twice).
    """
    args = model.rope_args(layer)
    if args.yarn is not None:
        args = args._replace(yarn=args.yarn._replace(mscale=1.0))
    return Backend.rope(backend, np.asarray(k, dtype=np.float32), delta, *args)


def shift_context(engine, seq: "SequenceKV", n_keep: int) -> int:
    """Shift a full `seq` in place; returns the tokens discarded (0 = cannot).

    `seq.tokens` (the recorded ids, possibly one ahead of n_used) loses the same range;
    the keys are re-roped with the engine's model.
    """
    backend, model = engine.backend, engine.model
    if getattr(seq, "recurrent", None) is not None:  # a recurrent state cannot drop tokens
        return 0

    def rerope(layer: int, k: np.ndarray, delta: np.ndarray) -> np.ndarray:
        return rope_shift(backend, model, layer, k, delta)

    return shift_sequence(seq, n_keep, rerope)


def shift_sequence(seq: "SequenceKV", n_keep: int,
                   rerope: Callable[[int, np.ndarray, np.ndarray], np.ndarray]) -> int:
    """Context shift in place: keep the first n_keep tokens, discard the next
    (n_used - n_keep) // 2 and move the rest back by as many positions; returns how many
    were discarded (0 = cannot). `rerope(layer, k, delta)` re-rotates roped keys (float32).

    Every group keeps what the next queries can see: a group holding the first n_keep
    tokens keeps them in place and re-appends the moved tail; a sliding-window group
    that dropped blocks is rebuilt from the rows it holds, rows it lacks (out of its
    window, or the kept prefix it already gave back, as llama.cpp's SWA cache lacks
    them too) get no K/V and a masked position. `tokens` loses the same range.

    Quantized K (edgeinfer.kv.cache_types): the moved keys are dequantized and rotated back,
    re-roped, rotated and quantized again, as llama.cpp's K-shift does; other rows move as
    raw blocks.
    """
    c, bs = seq.cache, seq.cache.block_size
    n = seq.n_used
    n_keep = max(0, min(n_keep, n - 1))
    n_discard = (n - n_keep) // 2
    if n_discard <= 0:
        return 0
    lo, hi, n2 = n_keep, n_keep + n_discard, n - n_discard
    old_pos = seq._pos[:n]
    new_pos = np.concatenate([old_pos[:lo], old_pos[hi:] - n_discard])
    src = np.concatenate([np.arange(lo), np.arange(hi, n)])  # old index of each new row
    next_pos = int(new_pos[-1]) + 1
    # Room check first (nothing changes when a pool cannot take the rebuilt rows).
    plans = []
    for t in seq.tables:
        g = t.group
        keep = lo if t.n_dropped == 0 else 0  # rows left in place
        kept_blocks = ceil_div(keep, bs)
        drop_to = 0
        if g.window:
            f = first_above(new_pos, next_pos - g.window, seq._ascending)
            drop_to = align_down(f // bs, g.quantum)
        # blocks past `keep` go back, and kept ones the window left behind
        freed = t.blocks[kept_blocks:] + t.blocks[t.n_dropped:min(drop_to, kept_blocks)]
        room = g.pool.num_free + sum(1 for b in freed if b != DROPPED and g.pool.ref_count(b) == 1)
        if ceil_div(n2, bs) - max(kept_blocks, drop_to) + 1 > room:
            return 0
        plans.append((keep, max(keep, drop_to * bs), drop_to))
    # Gather (copies) the rows each group will store, before any block goes back.
    data = []
    for t, (keep, first_row, _) in zip(seq.tables, plans):
        h0 = t.n_dropped * bs
        rows = src[first_row:]
        held = rows >= h0
        moved = held & (np.arange(first_row, n2) >= lo)
        stored = new_pos[keep:].copy()
        stored[np.concatenate([np.zeros(first_row - keep, bool), ~held])] = MASKED_POS
        kv = {}
        types = c.cache_types
        for layer in t.group.layers:
            k, v, _ = seq.layer_view(layer)
            kn = np.zeros((n2 - first_row,) + k.shape[1:], np.float32 if types.k == "f16" else k.dtype)
            vn = np.zeros((n2 - first_row,) + v.shape[1:], np.float32 if types.v == "f16" else v.dtype)
            kn[held] = k[rows[held] - h0]
            vn[held] = v[rows[held] - h0]
            if moved.any():
                delta = np.full(int(moved.sum()), -n_discard, np.int64)
                if types.k == "f16":
                    kn[moved] = rerope(layer, kn[moved], delta)
                else:
                    kn[moved] = types.encode("k", rerope(layer, types.decode("k", kn[moved]), delta))
            kv[layer] = (kn, vn)
        data.append((stored, kv))
    tokens = list(seq.tokens)
    for t, (keep, _, _) in zip(seq.tables, plans):
        seq._cut(t, keep)
    del seq.block_hashes[lo // bs:]
    seq._pos[:n2] = new_pos
    group_slots = []
    for t, (keep, _, drop_to), (stored, _) in zip(seq.tables, plans, data):
        plan = seq._plan(t, keep, n2, next_pos)
        assert plan[0] == drop_to
        seq._check_room([t], [plan])
        group_slots.append(seq._apply(t, plan, keep, n2, stored))
    seq.n_used = n2
    seq._last = None
    for t, (keep, first_row, _), gslots, (stored, kv) in zip(seq.tables, plans, group_slots, data):
        g = t.group
        slots = gslots[first_row - keep:]  # the stored rows' slots (the rest are in dropped blocks)
        if g.device is not None:
            g.device.on_append(seq, slots, stored[first_row - keep:])
        for layer, (kn, vn) in kv.items():
            if layer in c.device_layers:
                g.device.store(seq, layer, slots, kn, vn)
            else:
                c.k_flat[layer][slots] = kn
                c.v_flat[layer][slots] = vn
    seq.tokens = tokens[:lo] + tokens[hi:]
    return n_discard
