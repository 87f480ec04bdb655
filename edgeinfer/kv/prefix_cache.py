"""Prefix caching on the block pools' hash chain: find a prompt's cached blocks, register full ones.

Full blocks are hashed by the pool's chain (`compute_block_hashes`: each block's hash covers
its tokens, everything before them and the cache's extra keys), so a later request with the
same prefix finds them in every group's pool under the same hashes.

A hit (`reuse_prefix`) is the longest whole-block prefix whose blocks every full-attention
group has cached (each pool's `cached_chain`) and for which each sliding-window group has
cached the blocks covering the last `window` positions before the hit point (earlier ones
may be gone). Every pool counts the lookup (`record_lookup`), so its hits and queries are
the cache's prefix hit rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from edgeinfer.kv.block_pool import ROOT_HASH, compute_block_hashes, hash_block
from edgeinfer.kv.groups import DROPPED, LayerGroup, align_down

if TYPE_CHECKING:
    from edgeinfer.kv.sequence import BlockOwner, SequenceKV


def reuse_prefix(cache: "BlockOwner", seq: "SequenceKV", token_ids: Sequence[int]) -> int:
    """Put the longest cached prefix of whole blocks of `token_ids` into an EMPTY `seq`.

    Returns how many tokens are now cached (a multiple of block_size); the caller prefills
    the rest. To get logits for the last prompt token, pass prompt[:-1].
    """
    if seq.n_used or seq.tokens or any(t.blocks for t in seq.tables):
        raise ValueError("reuse_prefix needs an empty sequence")
    bs = cache.block_size
    n_full = len(token_ids) // bs
    hashes = compute_block_hashes(token_ids[:min(n_full, seq.n_ctx // bs) * bs], bs, cache.extra_keys)
    found: list[list[int | None]] = [[] for _ in cache.groups]
    j = len(hashes)
    for g in cache.groups:  # full attention: the chain every such group holds
        if not g.window:
            found[g.index] = g.pool.cached_chain(hashes[:j])
            j = len(found[g.index])
    for g in cache.groups:  # sliding window: what it still has (leading blocks may be gone)
        if g.window:
            found[g.index] = [g.pool.lookup(h) for h in hashes[:j]]
    while j and not all(_window_cached(g, found[g.index], j, bs) for g in cache.groups if g.window):
        j -= 1
    for g in cache.groups:
        g.pool.record_lookup(n_full, j)
    n = j * bs
    for t in seq.tables:
        g = t.group
        lo = _window_start(g, n, bs)
        blocks = found[g.index][lo:j]
        g.pool.touch(blocks)
        t.blocks, t.n_dropped, t._kept = [DROPPED] * lo + blocks, lo, None
    seq.block_hashes = hashes[:j]
    seq.tokens = [int(t) for t in token_ids[:n]]
    seq._put_positions(0, np.arange(n, dtype=np.int64))
    seq.n_used = n
    return n


def _window_start(g: LayerGroup, n: int, bs: int) -> int:
    """First block a group must hold for a sequence of n tokens at positions 0..n-1."""
    return align_down(max(0, n - g.window + 1) // bs, g.quantum) if g.window else 0


def _window_cached(g: LayerGroup, found: list[int | None], j: int, bs: int) -> bool:
    return all(b is not None for b in found[_window_start(g, j * bs, bs):j])


def commit_full_blocks(cache: "BlockOwner", seq: "SequenceKV") -> int:
    """Register each newly full block (tokens recorded and K/V written) in the prefix cache.

    A block whose tokens do not sit at positions i*bs .. i*bs+bs-1 (after a context shift)
    stops the chain: its K/V are not what a fresh prompt would compute. Each group
    registers its own block of the chain where it holds one with every row stored
    (dropped blocks and masked rows are skipped). Returns the blocks added to the chain.
    """
    bs = cache.block_size
    n_full = min(len(seq.tokens), seq.n_used) // bs
    added = 0
    for i in range(len(seq.block_hashes), n_full):
        want = np.arange(i * bs, (i + 1) * bs)
        if not np.array_equal(seq._pos[i * bs:(i + 1) * bs], want):
            break
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        h = hash_block(parent, seq.tokens[i * bs:(i + 1) * bs], cache.extra_keys)
        for t in seq.tables:
            block = t.blocks[i]
            if block != DROPPED and np.array_equal(t.group.pos[block], want):
                t.group.pool.cache_full_block(block, h)  # False = a twin block holds it: fine
        seq.block_hashes.append(h)
        added += 1
    return added


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share: what a sequence holding `a` can keep of `b`."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(np.argmax(x)) if x.any() else n
