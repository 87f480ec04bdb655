"""PagedKVCache: block accounting under random session operations, and K/V that always equal
what the plain contiguous KVCache holds for the same sequence (the oracle)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from edgeinfer.backends.base import Backend
from edgeinfer.kv.block_pool import KVPoolExhaustedError
from edgeinfer.errors import ContextOverflowError, EdgeInferError
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.models.config import ModelConfig
from edgeinfer.kv.paged import PagedKVCache
from edgeinfer.kv.sequence import SequenceKV

CFG = ModelConfig(arch="test", n_vocab=16, n_ctx_train=64, n_embd=8, n_layer=2, n_head=4, n_head_kv=2,
                  head_dim=4, head_dim_v=3, n_ff=8, norm_eps=1e-5, rope_mode="neox", rope_dims=4,
                  rope_base=10000.0)
CFG_SWA = replace(CFG, sliding_window=6, swa_layers=(True, True))  # every layer sliding-window
# gemma3-like mix: layers 0 and 2 slide (window 6), layer 1 attends to everything
CFG_MIX = replace(CFG, n_layer=3, sliding_window=6, swa_layers=(True, False, True))
BS = 4


def kv_values(tokens: list[int], lo: int, hi: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """K/V for tokens lo..hi-1 as a deterministic function of each token's whole prefix,
    like a real model's (so a cached prefix must hold exactly these values)."""
    ks, vs = [], []
    h = 0
    for i in range(hi):
        h = (h * 1_000_003 + tokens[i] + 1) % (1 << 61)
        if i >= lo:
            rng = np.random.default_rng([h, layer])
            ks.append(rng.standard_normal((CFG.n_head_kv, CFG.head_dim)))
            vs.append(rng.standard_normal((CFG.n_head_kv, CFG.head_dim_v)))
    return (np.array(ks).reshape(len(ks), CFG.n_head_kv, CFG.head_dim),
            np.array(vs).reshape(len(vs), CFG.n_head_kv, CFG.head_dim_v))


def write(cache: PagedKVCache, seq: SequenceKV, new: list[int], ref: KVCache | None = None) -> None:
    """What the session manager does per forward: record ids, append, store every layer, commit."""
    before = seq.n_used
    seq.record_tokens(new)
    try:
        positions = np.arange(before, before + len(new))
        slots = seq.append(positions)
        ref_slots = ref.append(positions) if ref is not None else None
        for layer in range(cache.config.n_layer):
            k, v = kv_values(seq.tokens, before, before + len(new), layer)
            seq.store(layer, slots, k, v)
            if ref is not None:
                ref.store(layer, ref_slots, k, v)
    except BaseException:
        seq.truncate(before)  # Engine.forward's pattern
        raise
    cache.commit_full_blocks(seq)


def reference_for(tokens: list[int], n_ctx: int, config: ModelConfig = CFG) -> KVCache:
    ref = KVCache(config, n_ctx)
    if tokens:
        slots = ref.append(np.arange(len(tokens)))
        for layer in range(config.n_layer):
            ref.store(layer, slots, *kv_values(tokens, 0, len(tokens), layer))
    return ref


def assert_same_view(seq: SequenceKV, ref: KVCache) -> None:
    """Every layer's view equals the reference, less the leading rows its group dropped
    (which no later query can see)."""
    assert seq.n_used == ref.n_used
    cache = seq.cache
    for layer in range(cache.config.n_layer):
        g = cache.group_of[layer]
        skip = seq.tables[g.index].n_dropped * cache.block_size
        for got, want in zip(seq.layer_view(layer), ref.layer_view(layer)):
            assert got.shape == want[skip:].shape
            np.testing.assert_array_equal(got, want[skip:])
        if skip:
            pos = ref.layer_view(layer)[2]
            assert (pos[:skip] <= pos[-1] + 1 - g.window).all()


# -- targeted cases ---------------------------------------------------------------------------

def test_prefix_hit_reuses_exactly_the_shared_full_blocks():
    cache = PagedKVCache(CFG, num_blocks=16, block_size=BS)
    shared = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # 3 full blocks
    a = cache.new_sequence(32)
    write(cache, a, shared + [13, 14, 15, 1, 2])
    b = cache.new_sequence(32)
    prompt_b = shared + [9, 9, 9, 9, 9]
    n = cache.reuse_prefix(b, prompt_b)
    assert n == 12
    assert b.block_table == a.block_table[:3]
    s = cache.stats()
    assert (s["hits"], s["queries"]) == (3, 4)  # 4 full blocks asked for, the 4th differs
    assert s["hit_rate"] == 0.75
    write(cache, b, prompt_b[n:])
    assert_same_view(b, reference_for(prompt_b, 32))
    assert_same_view(a, reference_for(shared + [13, 14, 15, 1, 2], 32))
    for blk in a.block_table[:3]:
        assert cache.pool.ref_count(blk) == 2
    cache.check_invariants()


def test_cached_blocks_survive_release_and_lru_eviction_order():
    cache = PagedKVCache(CFG, num_blocks=4, block_size=2)
    a = cache.new_sequence(8)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    write(cache, a, tokens)
    blocks = list(a.block_table)
    cache.release(a)
    assert cache.stats()["cached"] == 4 and cache.stats()["used"] == 0
    # The pool is full of cached free blocks; the tail of `a` was freed first, so it goes first.
    b = cache.new_sequence(8)
    write(cache, b, [9])
    assert b.block_table == [blocks[3]]
    assert cache.stats()["cached"] == 3
    c = cache.new_sequence(8)
    assert cache.reuse_prefix(c, tokens) == 6  # the first three blocks are still there
    assert c.block_table == blocks[:3]
    assert_same_view(c, reference_for(tokens[:6], 8))
    cache.check_invariants()
    for s in (b, c):
        cache.release(s)
    assert cache.stats()["used"] == 0


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    cache = PagedKVCache(CFG, num_blocks=16, block_size=BS)
    a = cache.new_sequence(32)
    write(cache, a, [1, 2, 3, 4, 5, 6])  # 1 full block + 2 tokens in a partial one
    b = cache.fork(a)
    assert b.block_table == a.block_table and cache.stats()["used"] == 2
    write(cache, b, [7, 7])
    write(cache, a, [8])
    assert a.block_table[0] == b.block_table[0]  # full block still shared
    assert a.block_table[1] != b.block_table[1]  # partial block copied on the first write
    assert_same_view(a, reference_for([1, 2, 3, 4, 5, 6, 8], 32))
    assert_same_view(b, reference_for([1, 2, 3, 4, 5, 6, 7, 7], 32))
    cache.check_invariants()


def test_regenerate_inside_a_cached_block_keeps_the_cached_copy_intact():
    cache = PagedKVCache(CFG, num_blocks=16, block_size=BS)
    a = cache.new_sequence(32)
    original = [1, 2, 3, 4, 5, 6, 7, 8]
    write(cache, a, original)
    a.truncate(6)  # regenerate from the middle of the second (cached) block
    write(cache, a, [9, 9, 9])
    assert_same_view(a, reference_for([1, 2, 3, 4, 5, 6, 9, 9, 9], 32))
    b = cache.new_sequence(32)
    assert cache.reuse_prefix(b, original) == 8
    assert_same_view(b, reference_for(original, 32))
    cache.check_invariants()


def test_failed_and_cancelled_generation_return_their_blocks():
    cache = PagedKVCache(CFG, num_blocks=8, block_size=BS)
    a = cache.new_sequence(32)
    write(cache, a, [1, 2, 3, 4, 5])
    used = cache.stats()["used"]
    before = a.n_used

    class Boom(Exception):
        pass

    a.record_tokens(list(range(10)))
    with pytest.raises(Boom):  # an error mid-forward: Engine.forward truncates to `before`
        try:
            a.append(np.arange(before, before + 10))
            raise Boom
        except BaseException:
            a.truncate(before)
            raise
    assert cache.stats()["used"] == used and a.tokens == [1, 2, 3, 4, 5]
    write(cache, a, [6, 7, 8, 9, 10, 11])
    a.truncate(4)  # cancel back to the first block
    assert cache.stats()["used"] == 1
    cache.release(a)
    assert cache.stats()["used"] == 0 and cache.stats()["free"] == 8
    cache.check_invariants()


def test_full_pool_and_full_context_raise_one_line_errors_and_change_nothing():
    cache = PagedKVCache(CFG, num_blocks=2, block_size=BS)
    a = cache.new_sequence(100)
    write(cache, a, [1, 2, 3, 4, 5, 6])
    b = cache.fork(a)
    state = (list(b.block_table), b.n_used, cache.stats())
    # b's partial block is shared: writing needs a copy, and no block is free.
    with pytest.raises(KVPoolExhaustedError) as err:
        write(cache, b, [7])
    assert isinstance(err.value, EdgeInferError) and "\n" not in str(err.value)
    assert (list(b.block_table), b.n_used, cache.stats()) == state and b.tokens == [1, 2, 3, 4, 5, 6]
    c = cache.new_sequence(3)
    with pytest.raises(ContextOverflowError):
        c.append(np.arange(4))
    assert c.n_used == 0 and c.block_table == []
    cache.check_invariants()


def test_commit_skips_blocks_whose_positions_were_shifted():
    cache = PagedKVCache(CFG, num_blocks=4, block_size=BS)
    a = cache.new_sequence(16)
    a.record_tokens([1, 2, 3, 4])
    a.append(np.arange(10, 14))  # e.g. after a context shift: not what a fresh prompt computes
    assert cache.commit_full_blocks(a) == 0
    assert cache.stats()["cached"] == 0 and cache.pool.block_hash(a.block_table[0]) is None


def test_reuse_prefix_needs_an_empty_sequence_and_respects_n_ctx():
    cache = PagedKVCache(CFG, num_blocks=8, block_size=BS)
    a = cache.new_sequence(32)
    write(cache, a, list(range(12)))
    with pytest.raises(ValueError):
        cache.reuse_prefix(a, list(range(12)))
    small = cache.new_sequence(9)
    assert cache.reuse_prefix(small, list(range(12))) == 8


def test_model_forward_on_a_paged_sequence_matches_the_contiguous_cache(tiny_models):
    """The model code runs unchanged on a SequenceKV (gemma3: sliding-window layers too),
    including after a prefix hit, a fork and a regenerate."""
    from edgeinfer.engine import Engine, EngineOptions
    from edgeinfer.loader import open_model

    engine = Engine(open_model(tiny_models["gemma3"]), EngineOptions(n_ctx=64, backend="reference"))
    prompt = [1, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190, 200]
    # The oracle runs the same chunks on a contiguous KVCache, so results must be bit-identical.
    ref = engine.new_cache()
    engine.prefill(prompt[:10], ref)
    ref.truncate(8)
    want = engine.prefill(prompt[8:], ref)
    ref.truncate(13)
    want_regen = engine.prefill(prompt[13:], ref)

    paged = PagedKVCache(engine.config, num_blocks=8, block_size=4, dtype=np.float16)
    a = paged.new_sequence(64)
    a.record_tokens(prompt[:10])
    engine.prefill(prompt[:10], a)
    paged.commit_full_blocks(a)
    b = paged.new_sequence(64)
    n = paged.reuse_prefix(b, prompt[:-1])
    assert n == 8 and b.block_table == a.block_table[:2]
    b.record_tokens(prompt[n:])
    np.testing.assert_array_equal(engine.prefill(prompt[n:], b), want)
    c = paged.fork(b)
    c.truncate(13)  # regenerate from inside a block
    np.testing.assert_array_equal(engine.prefill(prompt[13:], c), want_regen)
    np.testing.assert_array_equal(engine.decode(7, c), engine.decode(7, ref))
    paged.check_invariants()


def _attention(kv, layer: int, positions: np.ndarray, window: int = CFG_SWA.sliding_window) -> np.ndarray:
    q = np.random.default_rng(layer).standard_normal((len(positions), CFG.n_head, CFG.head_dim))
    return Backend(None).attention(q.astype(np.float32), kv, layer, positions, 0.5, window)


def test_append_drops_blocks_no_later_query_sees():
    cache = PagedKVCache(CFG_SWA, num_blocks=8, block_size=BS, drop_align=1)
    a = cache.new_sequence(64)
    ref = KVCache(CFG_SWA, 64)
    write(cache, a, list(range(14)), ref)  # blocks hold positions 0-3, 4-7, 8-11, 12-13
    assert cache.stats()["used"] == 4 and a.n_dropped == 0
    write(cache, a, [5, 6, 7], ref)  # first new position 14, window 6: keys <= 8 are masked
    assert cache.stats()["used"] == 3 and a.n_used == 17 and a.n_dropped == 2
    for layer in range(CFG.n_layer):
        k, v, pos = a.layer_view(layer)
        np.testing.assert_array_equal(k, ref.layer_view(layer)[0][8:])
        np.testing.assert_array_equal(pos, np.arange(8, 17))
    future = np.array([17, 18, 21])  # each sees some key; 22+ would see none
    for layer in range(CFG.n_layer):
        np.testing.assert_allclose(_attention(a, layer, future), _attention(ref, layer, future), atol=1e-6)
    a.truncate(13)  # keys 8.. still cover the window of position 13
    assert a.n_used == 13 and a.n_dropped == 2
    # Position 10 needs key 5 again: its block went back to the pool with its hash and is
    # taken back from the prefix cache (block 0 is not needed).
    a.truncate(10)
    assert a.n_used == 10 and a.n_dropped == 1 and cache.stats()["used"] == 2
    assert_same_view(a, reference_for(list(range(10)), 64, CFG_SWA))
    cache.check_invariants()


def test_truncate_into_dropped_blocks_that_were_evicted_shortens_the_sequence():
    cache = PagedKVCache(CFG_SWA, num_blocks=8, block_size=BS, drop_align=1)
    tokens = list(range(3, 31))
    a = cache.new_sequence(64)
    for lo in range(0, 28, 4):
        write(cache, a, tokens[lo:lo + 4])  # the last append (at 24) drops blocks 0-3 (<= 18)
    assert a.n_dropped == 4 and cache.stats()["used"] == 3
    b = cache.new_sequence(64)
    assert cache.reuse_prefix(b, tokens[:8]) == 8  # takes blocks 0 and 1 back from the free list
    c = cache.new_sequence(64)
    write(cache, c, [1] * 8)  # two more blocks: the never-used one and dropped block 2
    a.truncate(14)  # position 14 needs keys 9.. (blocks 2, 3): block 2 is gone
    assert a.n_used == 8 and a.tokens == tokens[:8] and a.n_dropped == 0  # blocks 0, 1 shared with b
    assert a.block_table == b.block_table
    assert_same_view(a, reference_for(tokens[:8], 64, CFG_SWA))
    write(cache, a, tokens[8:20])
    assert_same_view(a, reference_for(tokens[:20], 64, CFG_SWA))
    cache.check_invariants()


def test_sliding_window_group_drops_while_the_global_group_keeps_everything():
    cache = PagedKVCache(CFG_MIX, num_blocks={0: 16, 6: 6}, block_size=BS, drop_align=1)
    full, swa = cache.groups
    assert (full.window, full.layers, swa.window, swa.layers) == (0, (1,), 6, (0, 2))
    a = cache.new_sequence(64)
    ref = KVCache(CFG_MIX, 64)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 9, 60)]
    for lo in range(0, 60, 3):  # decode-like growth, 3 tokens a step
        write(cache, a, tokens[lo:lo + 3], ref)
        s = cache.stats()["groups"]
        assert s[0]["used"] == -(-a.n_used // BS)  # the global layer keeps every block
        assert s[1]["used"] <= 3  # window 6 + 3 new tokens span at most 3 blocks of 4
        cache.check_invariants()
    assert_same_view(a, ref)
    assert cache.stats()["used"] == 15 + cache.stats()["groups"][1]["used"]
    future = np.array([60, 61])
    for layer in range(3):
        window = CFG_MIX.sliding_window if CFG_MIX.is_swa(layer) else 0
        np.testing.assert_array_equal(_attention(a, layer, future, window), _attention(ref, layer, future, window))
    # A new sequence with the same prompt hits all 15 blocks: the global group has them all,
    # the sliding-window group the ones covering the last window (its older ones may be gone).
    b = cache.new_sequence(64)
    assert cache.reuse_prefix(b, tokens) == 60
    assert b.tables[1].n_dropped == 13 and b.tables[0].n_dropped == 0
    assert_same_view(b, reference_for(tokens, 64, CFG_MIX))
    cache.release(a)
    cache.release(b)
    assert cache.stats()["used"] == 0
    cache.check_invariants()


def test_prefix_hit_needs_only_the_window_blocks_of_a_sliding_window_group():
    cache = PagedKVCache(CFG_MIX, num_blocks={0: 16, 6: 4}, block_size=BS, drop_align=1)
    tokens = list(range(1, 41))
    a = cache.new_sequence(64)
    for lo in range(0, 40, 4):
        write(cache, a, tokens[lo:lo + 4])
    assert [g["used"] for g in cache.stats()["groups"]] == [10, 3]
    cache.release(a)  # 10 global blocks cached; the 4 sliding-window ones hold blocks 6..9
    b = cache.new_sequence(64)
    assert cache.reuse_prefix(b, tokens) == 40  # the window of position 40 needs blocks 8, 9 only
    assert b.tables[1].n_dropped == 8 and cache.stats()["hits"] == 10
    assert_same_view(b, reference_for(tokens, 64, CFG_MIX))
    cache.release(b)
    c = cache.new_sequence(64)
    write(cache, c, [9] * 16)  # takes every sliding-window block: their cached content is gone
    cache.release(c)
    d = cache.new_sequence(64)
    n = cache.reuse_prefix(d, tokens)
    assert n == 0  # the global blocks are still there, but no window before any hit point is
    for lo in range(0, 40, 4):  # prefilled in chunks: the window group needs 3 blocks at a time
        write(cache, d, tokens[lo:lo + 4])
    assert_same_view(d, reference_for(tokens, 64, CFG_MIX))
    cache.check_invariants()


def test_drops_are_aligned_so_attention_stays_bit_exact():
    """With the default 32-token alignment a paged sliding-window layer sums its keys in the
    same accumulators as the contiguous cache: outputs equal bit for bit."""
    cfg = replace(CFG_MIX, sliding_window=10)
    cache = PagedKVCache(cfg, num_blocks={0: 32, 10: 16}, block_size=BS)
    a = cache.new_sequence(100)
    ref = KVCache(cfg, 100)
    rng = np.random.default_rng(1)
    for _ in range(30):
        write(cache, a, [int(t) for t in rng.integers(0, 9, 3)], ref)
        assert a.tables[1].n_dropped % 8 == 0  # 8 blocks of 4 = 32 tokens
    assert a.tables[1].n_dropped >= 16
    q = np.array([a.n_used])
    for layer in range(3):
        window = cfg.sliding_window if cfg.is_swa(layer) else 0
        np.testing.assert_array_equal(_attention(a, layer, q, window), _attention(ref, layer, q, window))


# -- random session operations ----------------------------------------------------------------

N_CTX = 24
NUM_BLOCKS = 14
MAX_SEQS = 5
STEMS = [[0, 1, 0, 1, 1, 1, 0, 0], [0, 1, 0, 1, 2, 2, 2, 2], [3, 3, 3, 3, 3, 3, 3, 3]]
tail = st.lists(st.integers(0, 3), max_size=10)
prompts = st.one_of(tail, st.tuples(st.sampled_from(STEMS), tail).map(lambda t: t[0] + t[1]))


@dataclass
class Live:
    seq: SequenceKV
    ref: KVCache
    cached: int  # prefix length taken from the cache at creation


class PagedKVMachine(RuleBasedStateMachine):
    config = CFG
    num_blocks: int | dict = NUM_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(self.config, num_blocks=self.num_blocks, block_size=BS, drop_align=1)
        self.live: list[Live] = []

    def _state(self, seq: SequenceKV) -> tuple:
        return ([(list(t.blocks), t.n_dropped) for t in seq.tables], seq.n_used, list(seq.tokens),
                [g.pool.num_free for g in self.cache.groups])

    def _extend(self, item: Live, new: list[int]) -> None:
        seq = item.seq
        before_state = self._state(seq)
        try:
            write(self.cache, seq, new, item.ref)
        except ContextOverflowError:
            assert seq.n_used + len(new) > N_CTX
        except KVPoolExhaustedError:
            # some group lacks blocks even counting those its window gives back
            assert any(need > free for need, free in self._needs(before_state, len(new)))
        else:
            return
        assert self._state(seq) == before_state  # all or nothing

    def _needs(self, state: tuple, n: int):
        """(most new blocks, free blocks) per group for n more tokens."""
        tables, n_used, _, free = state
        for (blocks, _), f in zip(tables, free):
            yield -(-(n_used + n) // BS) - len(blocks) + 1, f

    def _pick(self, i: int) -> Live:
        return self.live[i % len(self.live)]

    @precondition(lambda self: len(self.live) < MAX_SEQS)
    @rule(prompt=prompts)
    def new(self, prompt: list[int]) -> None:
        seq = self.cache.new_sequence(N_CTX)
        n = self.cache.reuse_prefix(seq, prompt)
        assert n % BS == 0 and n <= len(prompt) and seq.tokens == prompt[:n]
        item = Live(seq, reference_for(prompt[:n], N_CTX, self.config), n)
        self.live.append(item)
        self._extend(item, prompt[n:])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_SEQS), new=tail)
    def extend(self, i: int, new: list[int]) -> None:
        self._extend(self._pick(i), new)

    @precondition(lambda self: self.live and len(self.live) < MAX_SEQS)
    @rule(i=st.integers(0, MAX_SEQS))
    def fork(self, i: int) -> None:
        item = self._pick(i)
        self.live.append(Live(self.cache.fork(item.seq), copy.deepcopy(item.ref), item.cached))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_SEQS), back=st.one_of(st.integers(0, 3), st.integers(0, 12)), new=tail)
    def regenerate(self, i: int, back: int, new: list[int]) -> None:
        item = self._pick(i)
        keep = max(0, item.seq.n_used - back)
        item.seq.truncate(keep)
        item.ref.truncate(item.seq.n_used)  # less than keep when dropped blocks were needed
        self._extend(item, new)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_SEQS))
    def cancel(self, i: int) -> None:
        item = self._pick(i)
        keep = min(item.cached, item.seq.n_used)
        item.seq.truncate(keep)
        item.ref.truncate(item.seq.n_used)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_SEQS))
    def delete(self, i: int) -> None:
        item = self.live.pop(i % len(self.live))
        self.cache.release(item.seq)

    @invariant()
    def accounting_and_data(self) -> None:
        self.cache.check_invariants()
        s = self.cache.stats()
        assert s["used"] + s["free"] == s["total"] and s["cached"] <= s["free"]
        for item in self.live:
            assert item.seq.tokens[:item.seq.n_used] == item.seq.tokens  # no stray ids
            self.check_view(item.seq, item.ref)

    def check_view(self, seq: SequenceKV, ref: KVCache) -> None:
        assert_same_view(seq, ref)

    def teardown(self) -> None:
        for item in self.live:
            self.cache.release(item.seq)
        self.cache.check_invariants()
        s = self.cache.stats()
        assert s["used"] == 0 and s["free"] == s["total"]


class PagedKVSlidingWindowMachine(PagedKVMachine):
    """The same operations on an all-sliding-window model: appends drop blocks out of the
    window, truncates take them back from the prefix cache (or shorten)."""

    config = CFG_SWA


class PagedKVMixedMachine(PagedKVSlidingWindowMachine):
    """Sliding-window and global layers: two groups, two pools (the window's one small)."""

    config = CFG_MIX
    num_blocks = {0: NUM_BLOCKS, 6: 10}


for machine in (PagedKVMachine, PagedKVSlidingWindowMachine, PagedKVMixedMachine):
    machine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestPagedKV = PagedKVMachine.TestCase
TestPagedKVSlidingWindow = PagedKVSlidingWindowMachine.TestCase
TestPagedKVMixed = PagedKVMixedMachine.TestCase
