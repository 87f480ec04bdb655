"""BlockPool: ref counts, LRU free queue, prefix-cache map and eviction-on-reuse."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from edgeinfer.kv.block_pool import (ROOT_HASH, BlockPool, KVPoolExhaustedError, compute_block_hashes,
                                  hash_block)
from edgeinfer.errors import EdgeInferError


def test_allocate_free_touch_accounting():
    pool = BlockPool(4, block_size=2)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.stats()["used"] == 3
    pool.touch(a[:2])  # a second holder of the first two
    pool.free(a)
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    pool.free(a[:2])
    s = pool.stats()
    assert (s["used"], s["free"], s["total"], s["cached"]) == (0, 4, 4, 0)
    with pytest.raises(RuntimeError):
        pool.free([0])  # a double free is a bug, not silently absorbed
    pool.check_invariants()


def test_empty_pool_is_a_user_error():
    with pytest.raises(EdgeInferError):
        BlockPool(0, block_size=16)


def test_free_releases_the_tail_first_so_it_is_reused_first():
    pool = BlockPool(4, block_size=2)
    seq = pool.allocate(4)
    pool.free(seq)
    assert pool.allocate(4) == list(reversed(seq))


def test_exhausted_pool_raises_a_one_line_error_and_changes_nothing():
    pool = BlockPool(3, block_size=16)
    pool.allocate(2)
    with pytest.raises(KVPoolExhaustedError) as err:
        pool.allocate(2)
    assert isinstance(err.value, EdgeInferError) and "\n" not in str(err.value)
    assert pool.stats()["free"] == 1
    pool.check_invariants()


def test_block_hashes_cover_full_blocks_and_chain_on_the_parent():
    assert compute_block_hashes([1, 2, 3], 4) == []
    h = compute_block_hashes([1, 2, 3, 4, 1, 2, 3, 4, 9], 4)
    assert len(h) == 2
    assert h[0] != h[1]  # same tokens, different parent
    assert h[0] == hash_block(ROOT_HASH, [1, 2, 3, 4]) and h[1] == hash_block(h[0], [1, 2, 3, 4])
    assert compute_block_hashes([1, 2, 3, 4], 4, ("model-a", "f16")) != compute_block_hashes(
        [1, 2, 3, 4], 4, ("model-b", "f16"))
    assert compute_block_hashes([1, 2, 3, 5], 4) != h[:1]


def test_block_hashes_are_stable_across_processes():
    code = ("from edgeinfer.kv.block_pool import compute_block_hashes as c;"
            "print(c(list(range(40)), 8, ('gemma3', 'float16'))[-1].hex())")
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout.strip())
    assert len(outs) == 1
    assert outs == {compute_block_hashes(list(range(40)), 8, ("gemma3", "float16"))[-1].hex()}


def _cache_sequence(pool: BlockPool, tokens: list[int], extra=()) -> list[int]:
    blocks = pool.allocate(len(tokens) // pool.block_size)
    for b, h in zip(blocks, compute_block_hashes(tokens, pool.block_size, extra)):
        assert pool.cache_full_block(b, h)
    return blocks


def test_prefix_lookup_finds_the_longest_chain_and_counts_hits():
    pool = BlockPool(8, block_size=2)
    blocks = _cache_sequence(pool, [1, 2, 3, 4, 5, 6])
    assert pool.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]) == (blocks, 6)
    assert pool.find_cached_prefix([1, 2, 3, 9, 5, 6]) == (blocks[:1], 2)  # stops at the first miss
    assert pool.find_cached_prefix([1, 2, 3, 4], extra_keys=("other model",)) == ([], 0)
    s = pool.stats()
    assert (s["hits"], s["queries"]) == (3 + 1 + 0, 4 + 3 + 2)
    assert s["hit_rate"] == pytest.approx(4 / 9)
    assert pool.lookup(compute_block_hashes([1, 2], 2)[0]) == blocks[0]


def test_freed_cached_block_stays_findable_until_reused_lru_first():
    pool = BlockPool(3, block_size=2)
    a = _cache_sequence(pool, [1, 2, 3, 4, 5, 6])
    hashes = compute_block_hashes([1, 2, 3, 4, 5, 6], 2)
    pool.free(a)  # free queue: a2, a1, a0
    assert pool.stats()["cached"] == 3
    assert pool.find_cached_prefix([1, 2, 3, 4, 5, 6])[0] == a
    pool.touch([a[2]])  # a hit on a free block takes it out of the queue...
    pool.free([a[2]])  # ...and freeing it again makes it the most recently used
    got = pool.allocate(1)
    assert got == [a[1]]
    assert pool.lookup(hashes[1]) is None and pool.lookup(hashes[0]) == a[0]
    assert pool.lookup(hashes[2]) == a[2]
    assert pool.stats()["cached"] == 2
    pool.check_invariants()


def test_a_second_block_with_the_same_content_is_not_registered():
    pool = BlockPool(4, block_size=2)
    h = compute_block_hashes([1, 2], 2)[0]
    b1, b2 = pool.allocate(2)
    assert pool.cache_full_block(b1, h)
    assert not pool.cache_full_block(b2, h)
    assert pool.block_hash(b2) is None and pool.lookup(h) == b1
    pool.free([b1, b2])
    pool.check_invariants()


def test_check_invariants_detects_corruption():
    pool = BlockPool(4, block_size=2)
    b = pool.allocate(1)[0]
    pool._ref[b] = 0  # leaked: ref 0 but not in the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(4, block_size=2)
    b = pool.allocate(1)[0]
    pool.cache_full_block(b, b"x" * 32)
    pool._hash[b] = b"y" * 32
    with pytest.raises(AssertionError):
        pool.check_invariants()


class PoolMachine(RuleBasedStateMachine):
    """The pool against a plain-list model of the LRU queue, ref counts and hash map."""

    N = 8

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.N, block_size=1)
        self.holdings: list[list[int]] = []  # each: the blocks one holder references
        self.queue = list(range(self.N))  # model free queue, head first
        self.hash_of: dict[int, bytes] = {}
        self.next_hash = 0

    @rule(n=st.integers(0, 4))
    def allocate(self, n: int) -> None:
        if n > len(self.queue):
            with pytest.raises(KVPoolExhaustedError):
                self.pool.allocate(n)
            return
        got = self.pool.allocate(n)
        want, self.queue = self.queue[:n], self.queue[n:]
        assert got == want
        for b in got:
            self.hash_of.pop(b, None)
        self.holdings.append(got)

    @precondition(lambda self: self.holdings)
    @rule(i=st.integers(0, 20))
    def free(self, i: int) -> None:
        blocks = self.holdings.pop(i % len(self.holdings))
        self.pool.free(blocks)
        for b in reversed(blocks):
            if not any(b in h for h in self.holdings):
                self.queue.append(b)

    @precondition(lambda self: self.holdings)
    @rule(i=st.integers(0, 20))
    def share(self, i: int) -> None:
        blocks = list(self.holdings[i % len(self.holdings)])
        self.pool.touch(blocks)
        self.holdings.append(blocks)

    @precondition(lambda self: self.holdings)
    @rule(i=st.integers(0, 20), j=st.integers(0, 20), dup=st.booleans())
    def cache(self, i: int, j: int, dup: bool) -> None:
        blocks = self.holdings[i % len(self.holdings)]
        if not blocks:
            return
        b = blocks[j % len(blocks)]
        if dup and self.hash_of:  # try to register content some other block already holds
            h = next(iter(self.hash_of.values()))
        else:
            h = self.next_hash.to_bytes(32, "little")
            self.next_hash += 1
        if b in self.hash_of:
            if self.hash_of[b] != h:
                with pytest.raises(RuntimeError):
                    self.pool.cache_full_block(b, h)
            return
        assert self.pool.cache_full_block(b, h) == (h not in self.hash_of.values())
        if h not in self.hash_of.values():
            self.hash_of[b] = h

    @rule(i=st.integers(0, 20))
    def hit(self, i: int) -> None:  # a prefix-cache hit on any cached block, free or not
        if not self.hash_of:
            return
        b, h = sorted(self.hash_of.items())[i % len(self.hash_of)]
        assert self.pool.lookup(h) == b
        self.pool.touch([b])
        if b in self.queue:
            self.queue.remove(b)
        self.holdings.append([b])

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_invariants()
        assert list(self.pool._free) == self.queue
        for b in range(self.N):
            assert self.pool.ref_count(b) == sum(h.count(b) for h in self.holdings)
            assert self.pool.block_hash(b) == self.hash_of.get(b)
        s = self.pool.stats()
        assert s["cached"] == sum(1 for b in self.queue if b in self.hash_of)

    def teardown(self) -> None:
        for blocks in self.holdings:
            self.pool.free(blocks)
        self.pool.check_invariants()
        assert self.pool.stats()["free"] == self.N


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
