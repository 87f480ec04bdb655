"""Per-layer-group KV on a model mixing sliding-window and global layers (a tiny 6-layer
gemma3: layers 0-4 slide over a window of 8, layer 5 attends to everything).

The sliding-window group gives its blocks back as a conversation grows far past the window
while the global group keeps them; prefix reuse (block cache and resident sequence),
regenerate / edit / fork / cancel, context shift, saved K/V and the simulated GPU path stay
equal to cache-free runs, and pool accounting stays exact per group."""

from __future__ import annotations

import threading

import cuda_device
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import edgeinfer
from edgeinfer.kv import context_shift
from edgeinfer.generate import collect
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.kv.groups import DROPPED, layer_groups
from edgeinfer.kv.paged import PagedKVCache
from edgeinfer.results import FinishReason
from edgeinfer.sessions.session_file import SavedSession, load_session, save_session
from edgeinfer.kv.pool_sizing import group_pool_blocks
from edgeinfer.session_manager import SessionManager
from gguf_factory import TinyShape, spm_vocab, write_tiny_model
from oracles import (DEVICE_ATOL, branching_prompts, cold_greedy, compare_managers, greedy, operations, random_ids,
                     run_operations)

WINDOW = 8
N_CTX = 96
BS = 4
SHAPE = TinyShape(n_embd=64, n_layer=6, n_head=4, n_head_kv=2, head_dim=64, n_ff=128,
                  extra={"sliding_window": WINDOW})


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mixed") / "gemma3-mixed.gguf", "gemma3", "F32",
                            vocab=spm_vocab(), shape=SHAPE)


@pytest.fixture(scope="module")
def mixed(mixed_path):
    return edgeinfer.load(str(mixed_path), backend="reference", n_ctx=N_CTX, prefill_chunk=5)


def _manager(model, **kw) -> SessionManager:
    kw.setdefault("block_size", BS)
    kw.setdefault("n_ctx", model.engine.n_ctx)
    return SessionManager(model.engine, model.tokenizer, model_id="mixed", **kw)


def _group_used(mgr: SessionManager) -> tuple[int, int]:
    full, swa = mgr.stats()["groups"]
    return full["used"], swa["used"]


def _check_resident_accounting(mgr: SessionManager) -> None:
    """Between requests only the resident holds blocks: all of its global ones, and its
    sliding-window ones less those it dropped."""
    for g in mgr.stats()["groups"]:
        assert g["used"] + g["free"] == g["total"] and g["cached"] <= g["free"]
    seq = mgr._resident
    full_used, swa_used = _group_used(mgr)
    if seq is None:
        assert (full_used, swa_used) == (0, 0)
        return
    blocks = -(-seq.n_used // BS)
    assert full_used == blocks
    assert swa_used == blocks - seq.tables[1].n_dropped


def test_layers_group_by_window(mixed):
    cfg = mixed.config
    assert [cfg.is_swa(i) for i in range(6)] == [True] * 5 + [False]
    assert layer_groups(cfg) == [(0, (5,)), (WINDOW, (0, 1, 2, 3, 4))]
    assert layer_groups(cfg, device_layers=[0, 1]) == [(0, (5,)), (WINDOW, (0, 1, 2, 3, 4))]
    assert layer_groups(cfg, device_layers=[4, 5]) == [(0, (4, 5)), (WINDOW, (0, 1, 2, 3))]
    mgr = _manager(mixed)
    full, swa = mgr.cache.groups
    assert full.num_blocks == 2 * N_CTX // BS  # 2 x n_ctx, as before
    # the largest prefill pass is 5 + 5 // 4 = 6 rows (Engine.chunk_bounds); one sequence needs
    # ceil((8 - 1 + 6) / 4) + 1 + 8 (32-token drop quantum) = 13 blocks: twice that
    assert mixed.engine.max_prefill_rows == 6
    assert swa.num_blocks == 26


def test_pool_sizes_follow_the_groups():
    # Gemma 3 270M at 4096: 3 global layers, 15 of window 512, 1 KiB per layer and token
    sizes = group_pool_blocks(4096, 16, [(0, 3 * 1024), (512, 15 * 1024)], prefill_chunk=256)
    assert sizes == [512, 2 * (48 + 1 + 2)]
    # a memory cap shrinks both in proportion, never below one sequence's need
    small = group_pool_blocks(4096, 16, [(0, 3 * 1024), (512, 15 * 1024)], kv_pool_mb=30, prefill_chunk=256)
    assert small == [512 * 30 // 48, 102 * 30 // 48]
    assert small[0] * 3 * 16 + small[1] * 15 * 16 <= 30 * 1024
    tiny = group_pool_blocks(4096, 16, [(0, 3 * 1024), (512, 15 * 1024)], kv_pool_mb=1, prefill_chunk=256)
    assert tiny == [257, 51]
    # a window as long as the context is a full-attention group in all but name
    assert group_pool_blocks(64, 4, [(0, 8), (64, 8)]) == [32, 32]


def test_sliding_window_blocks_go_back_as_a_conversation_grows(mixed):
    """A chat growing to ~5 x n_window x 6: the global group holds every block, the
    sliding-window group a bounded handful, and every answer equals a cache-free run."""
    model = edgeinfer.load(str(mixed.path), backend="reference", n_ctx=320, prefill_chunk=16)
    mgr = _manager(model, n_ctx=320)
    rng = np.random.default_rng(11)
    vocab = model.config.n_vocab
    need = -(-(WINDOW - 1 + model.engine.max_prefill_rows) // BS) + 1 + 8  # one sequence's bound in the window group
    history: list[int] = []
    peak_swa = 0
    for turn in range(6):
        history = history + random_ids(rng, 40, vocab)
        result = None
        for chunk in mgr.generate(history, greedy(8)):
            peak_swa = max(peak_swa, _group_used(mgr)[1])
            if chunk.finish_reason is not None:
                result = chunk
        tokens = mgr.resident_tokens()[len(history):]
        if turn in (0, 5):
            assert tokens == cold_greedy(model.engine, model.tokenizer, history, 8)[:len(tokens)]
        if turn:
            assert result.usage.cached_tokens >= len(history) - 41
        history = history + tokens
        _check_resident_accounting(mgr)
        mgr.check_invariants()
    seq = mgr._resident
    assert seq.n_used > 250
    full_used, swa_used = _group_used(mgr)
    assert full_used == -(-seq.n_used // BS)  # ~70 blocks: everything
    assert swa_used <= need and peak_swa <= need  # <= 16 blocks, however long the chat
    assert seq.tables[1].n_dropped >= 48 and seq.tables[1].blocks[:48] == [DROPPED] * 48
    s = mgr.stats()
    assert s["used"] == full_used + swa_used and s["kv_bytes_used"] < s["kv_bytes_total"]


def test_dropping_keeps_logits_bit_identical_to_the_contiguous_cache(mixed):
    engine = mixed.engine
    rng = np.random.default_rng(12)
    prompt = random_ids(rng, 70, mixed.config.n_vocab)
    cache = PagedKVCache(engine.config, {0: 32, WINDOW: 16}, block_size=BS)
    seq = cache.new_sequence(N_CTX)
    ref = KVCache(engine.config, N_CTX)
    got = [engine.prefill(prompt, seq)]  # chunks of 5: later chunks drop what they cannot see
    want = [engine.prefill(prompt, ref)]
    for tok in (5, 6, 7, 8, 9, 10):
        got.append(engine.decode(tok, seq))
        want.append(engine.decode(tok, ref))
    assert seq.tables[1].n_dropped == 16 and seq.tables[0].n_dropped == 0  # 64 tokens, 2 x 32
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    cache.check_invariants()


def test_regenerate_edit_and_branch_reuse_what_the_window_needs(mixed):
    mgr = _manager(mixed)
    rng = np.random.default_rng(13)
    vocab = mixed.config.n_vocab
    prompt = random_ids(rng, 60, vocab)
    first = collect(mgr.generate(prompt, greedy(6)))
    assert mgr._resident.tables[1].n_dropped > 0
    again = collect(mgr.generate(prompt, greedy(6)))  # regenerate: its window blocks come back
    assert again.tokens == first.tokens and again.usage.cached_tokens == len(prompt) - 1
    edited = prompt[:50] + random_ids(rng, 4, vocab)
    result = collect(mgr.generate(edited, greedy(6)))
    assert result.usage.cached_tokens == 50
    assert result.tokens == cold_greedy(mixed.engine, mixed.tokenizer, edited, 6)
    # back to the first conversation: its blocks come from the prefix cache (global: all of
    # them; window: the last ones before the hit point)
    back = collect(mgr.generate(prompt + first.tokens + [7, 8], greedy(6)))
    assert back.usage.cached_tokens >= 60
    assert back.tokens == cold_greedy(mixed.engine, mixed.tokenizer, prompt + first.tokens + [7, 8], 6)
    _check_resident_accounting(mgr)
    mgr.check_invariants()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations(30))
def test_random_operations_keep_group_accounting_exact_and_outputs_cache_free(mixed, ops):
    # Pools at their minimum (one context + 1 block; one window + chunk) force evictions of
    # cached blocks; prompts run far past the window, so sliding-window blocks are dropped,
    # taken back, and lost (then the reuse is shorter and the rest recomputed).
    mgr = _manager(mixed, kv_pool_mb=0.001)
    assert [g.num_blocks for g in mgr.cache.groups] == [N_CTX // BS + 1, 13]
    run_operations(mgr, ops, mixed.engine, mixed.tokenizer, n_ctx=N_CTX, new_min=20, fail_at=10,
                   after_answer=_check_resident_accounting)


def test_context_shift_through_a_dropped_window(mixed):
    """Generation runs through context shifts with the window group's early blocks gone;
    accounting stays exact and the shifted sequence is not kept for reuse."""
    model = edgeinfer.load(str(mixed.path), backend="reference", n_ctx=64, prefill_chunk=8)
    mgr = _manager(model, n_ctx=64, context_shift=True, n_keep=4)
    prompt = random_ids(np.random.default_rng(14), 60, model.config.n_vocab)
    result = collect(mgr.generate(prompt, greedy(40)))
    if len(result.tokens) < 40:
        pytest.skip("the random model ended early")
    assert mgr.stats()["context_shifts"] >= 1 and mgr.stats()["used"] == 0
    mgr.check_invariants()


@pytest.mark.parametrize("n_keep", [0, 5])
def test_shift_with_dropped_blocks_equals_a_cold_run_on_one_layer(tmp_path, n_keep):
    """One sliding-window layer: K/V depend on token and position only, so after a shift the
    next logits equal a cold run over the shifted tokens, even though the group had given
    back its early blocks (the kept prefix is outside the new window here)."""
    path = write_tiny_model(tmp_path / "one.gguf", "gemma3", "F32", vocab=spm_vocab(),
                            shape=TinyShape(n_embd=64, n_layer=1, n_head=2, n_head_kv=1, head_dim=32,
                                            n_ff=128, extra={"sliding_window": WINDOW}))
    m = edgeinfer.load(str(path), backend="reference", n_ctx=40, prefill_chunk=4)
    engine = m.engine
    toks = random_ids(np.random.default_rng(7), 40, m.config.n_vocab)
    cache = PagedKVCache(engine.config, 16, BS, dtype=np.float32, drop_align=BS)
    seq = cache.new_sequence(40)
    engine.prefill(toks, seq)
    seq.record_tokens(toks)
    assert seq.n_dropped > 0
    n_discard = context_shift.shift_context(engine, seq, n_keep=n_keep)
    assert n_discard == (40 - n_keep) // 2
    shifted = toks[:n_keep] + toks[n_keep + n_discard:]
    assert seq.tokens == shifted and seq.n_used == len(shifted)
    cache.check_invariants()
    warm = engine.decode(7, seq)
    cold = engine.prefill(shifted + [7], KVCache(engine.config, 40, dtype=np.float32))
    np.testing.assert_allclose(warm, cold, rtol=0, atol=5e-5)
    cache.check_invariants()


def test_saved_kv_round_trip_with_dropped_window_rows(mixed, tmp_path):
    mgr = _manager(mixed)
    rng = np.random.default_rng(15)
    prompt = random_ids(rng, 70, mixed.config.n_vocab)
    first = collect(mgr.generate(prompt, greedy(5)))
    tokens, k, v, pos, *_ = mgr.export_kv()
    assert len(tokens) == len(pos) == len(prompt) + len(first.tokens) - 1
    gone = mgr._resident.tables[1].n_dropped * BS
    assert gone > 0
    assert np.isnan(k[0][:gone]).all() and not np.isnan(k[0][gone:]).any()  # window layer: rows it lacks
    assert not np.isnan(k[5]).any()  # the global layer: every row
    path = save_session(tmp_path / "s.npz", SavedSession(tokens=tokens, k=k, v=v, pos=pos), mixed.identity)
    loaded = load_session(path, mixed.identity, mixed.config.n_layer)
    mgr.reset()
    assert mgr.import_kv(loaded.tokens, loaded.k, loaded.v, loaded.pos) == len(tokens)
    assert mgr.resident_tokens() == tokens
    _check_resident_accounting(mgr)
    follow = tokens + [5, 6, 7]
    again = collect(mgr.generate(follow, greedy(5)))
    assert again.usage.cached_tokens == len(tokens)
    assert again.tokens == cold_greedy(mixed.engine, mixed.tokenizer, follow, 5)
    # exporting the imported sequence gives the same K/V (NaN where the window lets go)
    mgr.reset()
    mgr.import_kv(tokens, k, v, pos)
    t2, k2, v2, *_ = mgr.export_kv()
    assert t2 == tokens
    for a, b in zip(k2 + v2, k + v):
        np.testing.assert_array_equal(a, b)
    mgr.check_invariants()


# -- the emulated GPU (the CUDA emulator, as in tests/test_gpu_paged_kv.py) ----------------------

@pytest.mark.parametrize("k", [2, 6])
def test_device_layers_with_a_window_group_match_cpu_only(mixed_path, cuda_emulator, k):
    """k=2: the device layers all slide, so the device holds the window group (which drops);
    k=6: the device layers mix, so they all sit in the full-attention group (no window group)."""
    from test_gpu_paged_kv import _gpu_engine

    device = cuda_emulator
    cpu = edgeinfer.load(str(mixed_path), backend="reference", n_ctx=N_CTX, prefill_chunk=5)
    engine = _gpu_engine(mixed_path, k=k, head=True, n_ctx=N_CTX)
    mgrs = [_manager(cpu), SessionManager(engine, cpu.tokenizer, n_ctx=N_CTX, block_size=BS, model_id="mixed")]
    dev_group = mgrs[1].cache.primary
    assert dev_group.device is not None and dev_group.window == (WINDOW if k == 2 else 0)
    assert len(mgrs[1].cache.groups) == (2 if k == 2 else 1)
    rng = np.random.default_rng(16)
    vocab = cpu.config.n_vocab
    compare_managers(mgrs, [cpu.engine, engine], branching_prompts(rng, vocab, 60, branch_at=40, edit_at=53),
                     atol=DEVICE_ATOL)
    if k == 2:
        assert any(s.tables[dev_group.index].n_dropped for s in mgrs[1].cache._live)
    assert device["attention"] > 0 and cuda_device.kv_stores(device) > 0
    cancel = threading.Event()
    chunks = mgrs[1].generate(random_ids(rng, 30, vocab), greedy(30), cancel)
    next(chunks)
    cancel.set()
    assert list(chunks)[-1].finish_reason == FinishReason.CANCELLED
    assert mgrs[1].stats()["used"] == 0
    mgrs[1].check_invariants()


def test_context_shift_with_a_device_window_group_matches_cpu_only(mixed_path, cuda_emulator):
    """The window group on the (emulated) device drops blocks; a context shift rebuilds it
    from rows downloaded from VRAM, as the CPU-only manager rebuilds its host group."""
    from test_gpu_paged_kv import _gpu_engine

    cpu = edgeinfer.load(str(mixed_path), backend="reference", n_ctx=64, prefill_chunk=5)
    engine = _gpu_engine(mixed_path, k=2, n_ctx=64)
    mgrs = [SessionManager(e, cpu.tokenizer, n_ctx=64, block_size=BS, context_shift=True, n_keep=4)
            for e in (cpu.engine, engine)]
    assert mgrs[1].cache.primary.window == WINDOW and mgrs[1].cache.primary.device is not None
    prompt = random_ids(np.random.default_rng(17), 60, cpu.config.n_vocab)
    results = [collect(m.generate(prompt, greedy(30))) for m in mgrs]
    assert results[1].tokens == results[0].tokens
    shifts = [m.stats()["context_shifts"] for m in mgrs]
    assert shifts[0] == shifts[1]
    if shifts[0] == 0:
        pytest.skip("the random model ended early")
    for m in mgrs:
        assert m.stats()["used"] == 0
        m.check_invariants()
