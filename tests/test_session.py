"""SessionManager: prefix reuse (block cache + resident sequence), chunked prefill, pool
accounting, cancel/failure clean-up, and context shift, checked against cache-free runs
(a contiguous KVCache driven through the engine directly)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import edgeinfer
from edgeinfer.errors import EdgeInferError
from edgeinfer.generate import collect
from edgeinfer.kv import context_shift
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.kv.paged import PagedKVCache
from edgeinfer.kv.pool_sizing import group_pool_blocks
from edgeinfer.results import FinishReason
from edgeinfer.session_manager import SessionManager
from gguf_factory import TinyShape, bpe_vocab, spm_vocab, write_tiny_model
from oracles import cold_run, greedy, operations, random_ids, run_operations

N_CTX = 64


@pytest.fixture(scope="module")
def model(tiny_models):
    # A small prefill chunk so prompts are prefilled in several pieces.
    return edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=N_CTX, prefill_chunk=5)


def _manager(model, **kw) -> SessionManager:
    kw.setdefault("block_size", 4)
    return SessionManager(model.engine, model.tokenizer, n_ctx=N_CTX, model_id="tiny", **kw)


def _used_blocks(mgr: SessionManager) -> int:
    return mgr.stats()["used"]


# -- prefix reuse ------------------------------------------------------------------------------

def test_cached_and_uncached_runs_give_the_same_logits(model):
    mgr = _manager(model)
    rng = np.random.default_rng(1)
    prompt = random_ids(rng, 23, model.config.n_vocab)
    collect(mgr.generate(prompt, greedy(3)))
    # A new sequence reusing the cached full blocks, prefilling only the rest.
    seq = mgr.cache.new_sequence(N_CTX)
    longer = prompt + random_ids(rng, 6, model.config.n_vocab)
    n = mgr.cache.reuse_prefix(seq, longer[:-1])
    assert n == 20  # 5 full blocks of 4 of the 23-token prompt
    warm = model.engine.prefill(longer[n:], seq)
    _, cold = cold_run(model.engine, model.tokenizer, longer, 0)
    np.testing.assert_allclose(warm, cold, rtol=0, atol=1e-5)
    mgr.cache.release(seq)
    mgr.check_invariants()


def test_growing_conversation_reuses_everything_before(model):
    mgr = _manager(model)
    rng = np.random.default_rng(2)
    history = random_ids(rng, 9, model.config.n_vocab)
    for turn in range(3):
        result = collect(mgr.generate(history, greedy(4)))
        expect, _ = cold_run(model.engine, model.tokenizer, history, 4)
        assert result.tokens == expect
        if turn:  # everything but the last prompt token was cached by the previous turn
            assert result.usage.cached_tokens == len(history) - 1 - len(new)
        new = random_ids(rng, 5, model.config.n_vocab)
        history = history + result.tokens + new
        mgr.check_invariants()


def test_regenerate_and_edit_last_reuse_the_prefix(model):
    mgr = _manager(model)
    rng = np.random.default_rng(3)
    before = random_ids(rng, 14, model.config.n_vocab)
    last = random_ids(rng, 5, model.config.n_vocab)
    first = collect(mgr.generate(before + last, greedy(4)))
    again = collect(mgr.generate(before + last, greedy(4)))  # regenerate
    assert again.tokens == first.tokens
    assert again.usage.cached_tokens == len(before + last) - 1
    edited = before + random_ids(rng, 6, model.config.n_vocab)  # edit the last message
    result = collect(mgr.generate(edited, greedy(4)))
    assert result.usage.cached_tokens >= len(before)
    assert result.tokens == cold_run(model.engine, model.tokenizer, edited, 4)[0]
    mgr.check_invariants()


def test_other_conversations_prefix_survives_in_the_block_cache(model):
    mgr = _manager(model)
    rng = np.random.default_rng(4)
    a = random_ids(rng, 17, model.config.n_vocab)
    b = random_ids(rng, 17, model.config.n_vocab)
    collect(mgr.generate(a, greedy(2)))
    collect(mgr.generate(b, greedy(2)))  # conversation a is no longer resident
    result = collect(mgr.generate(a + [5, 6], greedy(2)))
    assert result.usage.cached_tokens == 16  # a's full blocks, from the prefix cache
    stats = mgr.stats()
    assert stats["hits"] > 0 and 0 < stats["hit_rate"] <= 1


def test_cancelled_generation_returns_its_blocks(model):
    mgr = _manager(model)
    rng = np.random.default_rng(5)
    cancel = threading.Event()
    chunks = mgr.generate(random_ids(rng, 10, model.config.n_vocab), greedy(30), cancel)
    next(chunks)
    assert _used_blocks(mgr) > 0
    cancel.set()
    last = list(chunks)[-1]
    assert last.finish_reason == FinishReason.CANCELLED
    assert _used_blocks(mgr) == 0
    mgr.check_invariants()


def test_failed_generation_returns_its_blocks(model):
    mgr = _manager(model)
    rng = np.random.default_rng(6)

    def boom(done, total):
        if done >= 10:
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        collect(mgr.generate(random_ids(rng, 20, model.config.n_vocab), greedy(3), progress=boom))
    assert _used_blocks(mgr) == 0
    mgr.check_invariants()
    # An abandoned stream (a client that went away) gives its blocks back too.
    chunks = mgr.generate(random_ids(rng, 12, model.config.n_vocab), greedy(20))
    next(chunks)
    chunks.close()
    assert _used_blocks(mgr) == 0
    mgr.check_invariants()


def test_chunked_prefill_reports_progress(model):
    mgr = _manager(model)
    seen = []
    collect(mgr.generate(list(range(3, 21)), greedy(1), progress=lambda d, t: seen.append((d, t))))
    assert seen == [(5, 18), (10, 18), (15, 18), (18, 18)]


def test_model_api_goes_through_the_manager(model):
    model.reset()
    a = model.generate([3, 4, 5, 6, 7, 8, 9, 10], max_tokens=3, temperature=0)
    b = model.generate([3, 4, 5, 6, 7, 8, 9, 10, 11, 12], max_tokens=3, temperature=0)
    assert b.usage.cached_tokens == 8
    stats = model.stats()
    assert stats["requests"] >= 2 and stats["used"] > 0
    model.reset()
    c = model.generate([3, 4, 5, 6, 7, 8, 9, 10], max_tokens=3, temperature=0)
    assert c.usage.cached_tokens == 0 and c.tokens == a.tokens


def test_pool_size_policy():
    assert group_pool_blocks(4096, 16, [(0, 1000)]) == [512]  # 2 x n_ctx
    assert group_pool_blocks(4096, 16, [(0, 1000)], kv_pool_mb=1) == [257]  # capped, but one full context fits
    assert group_pool_blocks(100, 16, [(0, 1000)], pool_tokens=1000) == [63]


# -- property test: random operation sequences ------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations(12))
def test_random_operations_keep_accounting_exact_and_outputs_cache_free(model, ops):
    # A pool of exactly one context (+1 block) forces evictions of cached blocks.
    mgr = _manager(model, pool_tokens=N_CTX)

    def only_the_resident_holds_blocks(mgr):
        assert _used_blocks(mgr) == -(-mgr.stats()["resident_tokens"] // mgr.block_size)

    run_operations(mgr, ops, model.engine, model.tokenizer, n_ctx=N_CTX,
                   after_answer=only_the_resident_holds_blocks)


# -- context shift -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_layer_models(tmp_path_factory):
    """One-layer models: layer-0 K/V depend on token and position only, so after a context
    shift the next logits must equal a cold run over the shifted tokens."""
    root = tmp_path_factory.mktemp("one_layer")
    out = {}
    for arch in ("llama", "qwen3", "gemma3"):
        vocab = bpe_vocab("qwen2") if arch.startswith("qwen") else spm_vocab()
        path = write_tiny_model(root / f"{arch}.gguf", arch, "F32", vocab=vocab, shape=TinyShape(n_layer=1))
        out[arch] = edgeinfer.load(str(path), backend="reference", n_ctx=40)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("dtype,atol", [(np.float32, 5e-5), (np.float16, 1e-2)])
def test_context_shift_equals_cold_run_over_shifted_tokens(one_layer_models, arch, dtype, atol):
    m = one_layer_models[arch]
    engine = m.engine
    toks = random_ids(np.random.default_rng(7), 40, m.config.n_vocab)
    cache = PagedKVCache(engine.config, 8, 8, dtype=dtype)
    seq = cache.new_sequence(40)
    engine.prefill(toks, seq)
    seq.record_tokens(toks)
    n_discard = context_shift.shift_context(engine, seq, n_keep=5)
    assert n_discard == (40 - 5) // 2
    shifted = toks[:5] + toks[5 + n_discard:]
    assert seq.tokens == shifted and seq.n_used == len(shifted)
    warm = engine.decode(7, seq)
    cold = KVCache(engine.config, 40, dtype=dtype)
    reference = engine.prefill(shifted + [7], cold)
    np.testing.assert_allclose(warm, reference, rtol=0, atol=atol)
    cache.check_invariants()


def test_context_shift_without_rerope_would_be_caught(one_layer_models, monkeypatch):
    """The oracle above can fail: skip the key rotation and the logits differ."""
    m = one_layer_models["llama"]
    engine = m.engine
    monkeypatch.setattr(context_shift, "rope_shift", lambda backend, model, layer, k, delta: k)
    toks = random_ids(np.random.default_rng(7), 40, m.config.n_vocab)
    cache = PagedKVCache(engine.config, 8, 8, dtype=np.float32)
    seq = cache.new_sequence(40)
    engine.prefill(toks, seq)
    seq.record_tokens(toks)
    n_discard = context_shift.shift_context(engine, seq, n_keep=5)
    warm = engine.decode(7, seq)
    reference = engine.prefill(toks[:5] + toks[5 + n_discard:] + [7], KVCache(engine.config, 40, np.float32))
    assert np.abs(warm - reference).max() > 1e-3


def test_generation_through_a_shift_matches_cold_runs(one_layer_models):
    m = one_layer_models["llama"]
    mgr = SessionManager(m.engine, m.tokenizer, n_ctx=40, block_size=8, context_shift=True, n_keep=4)
    prompt = random_ids(np.random.default_rng(8), 30, m.config.n_vocab)
    result = collect(mgr.generate(prompt, greedy(25)))
    if len(result.tokens) < 25:
        pytest.skip("the random model ended early")  # eog sampled before reaching the shift
    assert mgr.stats()["context_shifts"] == 1
    # Replay: token 10 is sampled over a full window of 40; before its K/V is written the
    # window shifts: keep 4, drop (40 - 4) // 2 = 18, and every later token sees that.
    history = list(prompt)
    for i, tok in enumerate(result.tokens):
        if len(history) > 40:
            history = history[:4] + history[4 + 18:]
        if i in (10, 11, 15, 24):  # a few steps after the shift (and one before) vs a cold run
            _, logits = cold_run(m.engine, m.tokenizer, history, 0)
            assert int(np.argmax(logits)) == tok, i
        history.append(tok)
    assert _used_blocks(mgr) == 0  # a shifted sequence is not kept for reuse
    mgr.check_invariants()


def test_full_context_without_shift_stops_with_length(one_layer_models):
    m = one_layer_models["llama"]
    mgr = SessionManager(m.engine, m.tokenizer, n_ctx=40, block_size=8)
    prompt = random_ids(np.random.default_rng(8), 30, m.config.n_vocab)
    result = collect(mgr.generate(prompt, greedy(25)))
    if result.finish_reason == FinishReason.STOP:
        pytest.skip("the random model ended early")
    assert result.finish_reason == FinishReason.LENGTH
    assert len(prompt) + len(result.tokens) == 40 + 1  # the last token is sampled, not stored
    mgr.check_invariants()


def test_bad_n_keep_is_a_one_line_error(model):
    mgr = _manager(model)
    with pytest.raises(EdgeInferError) as err:
        collect(mgr.generate([3, 4, 5], greedy(2), n_keep=-1))
    assert "\n" not in str(err.value)
