"""A pool of fixed-size KV block ids with a prefix cache (block ids only, no tensors).

Modelled on vLLM's block_pool.py:
- every block has a ref count; a block with ref 0 sits in the free queue, ordered LRU
  (freed blocks go to the tail, allocation takes from the head);
- a FULL block can be registered under a hash chained over (parent hash, its token ids,
  extra keys), so a later request with the same prefix finds it;
- a freed block keeps its hash and stays findable until it is handed out again for
  something else: eviction happens only on reuse, and the least recently freed goes first.

Hashes are sha256 digests over a fixed byte encoding, so they are the same in every
process and can be stored with a saved session.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from edgeinfer.errors import EdgeInferError

BlockHash = bytes

# Parent hash of a sequence's first block.
ROOT_HASH: BlockHash = b"\x00" * 32


class KVPoolExhaustedError(EdgeInferError):
    """The shared KV block pool has too few free blocks for a request."""


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Hash of one full block chained to its parent's hash.

    Tokens are encoded as little-endian int64 and extra keys (model identity, KV dtype...;
    str/int/float/bytes/tuples of those) by repr, both stable across processes.
    """
    h = hashlib.sha256(parent)
    h.update(np.asarray([int(t) for t in token_ids], dtype="<i8").tobytes())
    h.update(repr(tuple(extra_keys)).encode())
    return h.digest()


def compute_block_hashes(token_ids: Sequence[int], block_size: int,
                         extra_keys: tuple = ()) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    parent = ROOT_HASH
    for lo in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[lo:lo + block_size], extra_keys)
        hashes.append(parent)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise EdgeInferError(f"the KV block pool needs at least 1 block of at least 1 token, "
                                 f"got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        # Free blocks, head = least recently freed = next to hand out. An OrderedDict
        # gives O(1) append, pop-head and remove-from-middle (a cache hit on a free block).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # hash -> the block holding that content
        self.hits = 0  # full blocks reused by prefix lookups (record_lookup)
        self.queries = 0  # full blocks asked for by prefix lookups

    # -- allocation -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue (ref 1), evicting their old hashes."""
        if n > len(self._free):
            raise KVPoolExhaustedError(
                f"KV cache is full: need {n} more blocks of {self.block_size} tokens, "
                f"only {len(self._free)} of {self.num_blocks} are free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the free-queue tail.

        `blocks` is in sequence order; they are released last block first, so a
        sequence's tail (the part least likely to be shared) is evicted before its prefix.
        """
        for block in reversed(blocks):
            if self._ref[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than it was taken")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference to each block (a cache hit or a fork)."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    # -- prefix cache ----------------------------------------------------------------------
    def block_hash(self, block: int) -> BlockHash | None:
        return self._hash[block]

    def cache_full_block(self, block: int, block_hash: BlockHash) -> bool:
        """Register a full, in-use block under `block_hash`; False if it cannot be.

        If another block already holds this content the map keeps that one and `block`
        stays unhashed (a duplicate, freed like any uncached block).
        """
        if self._ref[block] <= 0:
            raise RuntimeError(f"block {block} is not in use and cannot be cached")
        current = self._hash[block]
        if current is not None:
            if current != block_hash:
                raise RuntimeError(f"block {block} is already cached under another hash")
            return True
        if block_hash in self._cached:
            return False
        self._hash[block] = block_hash
        self._cached[block_hash] = block
        return True

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def find_cached_prefix(self, token_ids: Sequence[int],
                           extra_keys: tuple = ()) -> tuple[list[int], int]:
        """The longest chain of cached full blocks for `token_ids`: (blocks, n_tokens).

        Does not take references; call `touch(blocks)` to keep them. Updates hit stats.
        """
        hashes = compute_block_hashes(token_ids, self.block_size, extra_keys)
        blocks = self.cached_chain(hashes)
        self.record_lookup(len(hashes), len(blocks))
        return blocks, len(blocks) * self.block_size

    def cached_chain(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks cached under the leading `hashes` (a chain from compute_block_hashes),
        up to the first one not cached. Takes no references and counts nothing."""
        blocks: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_lookup(self, queries: int, hits: int) -> None:
        """Count a prefix lookup: `queries` full blocks asked for, the first `hits` reused."""
        self.queries += queries
        self.hits += hits

    def _evict(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            del self._cached[h]
            self._hash[block] = None

    # -- accounting --------------------------------------------------------------------------
    def stats(self) -> dict:
        free = len(self._free)
        cached = sum(1 for b in self._free if self._hash[b] is not None)
        return {
            "used": self.num_blocks - free,
            "free": free,
            "cached": cached,  # free blocks still holding findable content
            "total": self.num_blocks,
            "hits": self.hits,
            "queries": self.queries,
            "hit_rate": self.hits / self.queries if self.queries else 0.0,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this)."""
        for block in range(self.num_blocks):
            ref = self._ref[block]
            assert ref >= 0, f"block {block} has ref count {ref}"
            assert (ref == 0) == (block in self._free), \
                f"block {block}: ref {ref} but {'in' if block in self._free else 'not in'} free queue"
        assert len(self._free) == sum(1 for r in self._ref if r == 0)
        for h, block in self._cached.items():
            assert self._hash[block] == h, f"hash map entry for block {block} does not match its hash"
        n_hashed = sum(1 for h in self._hash if h is not None)
        assert n_hashed == len(self._cached), "a block holds a hash the map does not know"
