"""Per-layer K/V head counts (Gemma 4 26B-A4B, 31B, 12B: fewer on the global layers) in every
cache and what sizes or saves one: each layer's rows have its own heads, every byte count
is the sum over the layers keeping K/V of n_head_kv_of(l) * (head_dim_k + head_dim_v) *
element size. The fixture is 31B's kind (gemma4_sized_file): 6 layers, 8 Q heads, K/V
heads (4, 4, 1) * 2 with head sizes (32, 32, 64) * 2, so a global layer keeps fewer values
than a sliding one. Parity with llama.cpp (f16 K/V) is tests/test_gemma4.py's; here the
q8_0 cache against llama.cpp's, and the session features against cold runs."""

from __future__ import annotations

import numpy as np
import pytest
from llama_oracle import importorskip_oracle
from gguf_factory import gemma4_sized_file
from oracles import cold_greedy, greedy, random_ids

from edgeinfer.errors import EdgeInferError
from edgeinfer.generate import collect
from edgeinfer.kernels_cpu import kv_quant
from edgeinfer.kv.cache_types import CacheTypes, of_config
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.kv.paged import PagedKVCache
from edgeinfer.kv.pool_sizing import model_kv_bytes_per_token, plan_pools
from edgeinfer.loader import open_model

HEADS = (4, 4, 1) * 2
SIZES = (32, 32, 64) * 2
F16_BYTES_PER_TOKEN = sum(2 * h * 2 * d for h, d in zip(HEADS, SIZES))
N_CTX = 64


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return gemma4_sized_file(tmp_path_factory.mktemp("g4kv"), "31B", "F32")


@pytest.fixture(scope="module")
def model(path):
    import edgeinfer

    return edgeinfer.load(path, backend="reference", n_ctx=N_CTX)


def test_every_cache_sizes_each_layer_by_its_heads(path):
    cfg = open_model(path).config
    assert F16_BYTES_PER_TOKEN == 2 * 2 * (4 * (4 * 32) + 2 * (1 * 64)) == 2560
    assert model_kv_bytes_per_token(cfg) == F16_BYTES_PER_TOKEN
    kv = KVCache(cfg, 16)
    assert [a.shape for a in kv.k] == [a.shape for a in kv.v] == [(16, h, d) for h, d in zip(HEADS, SIZES)]
    assert kv.nbytes == 16 * F16_BYTES_PER_TOKEN
    cache = PagedKVCache(cfg, {0: 4, 16: 6}, block_size=8)
    assert [(g.window, g.layers) for g in cache.groups] == [(0, (2, 5)), (16, (0, 1, 3, 4))]
    assert [g.bytes_per_block for g in cache.groups] == [8 * 2 * 2 * 2 * 64, 8 * 2 * 4 * 2 * 4 * 32]
    assert [a.shape[2:] for a in cache.k] == [(h, d) for h, d in zip(HEADS, SIZES)]
    assert [a.shape[1:] for a in cache.k_flat] == [(h, d) for h, d in zip(HEADS, SIZES)]
    assert set(plan_pools(cfg, 64, 8).blocks) == {0, 16}


def test_quantized_bytes_and_the_offload_plan(path):
    from edgeinfer.backends.offload import GiB, DeviceInfo, model_sizes_from_gguf, plan_for_model

    mf = open_model(path)
    cfg = mf.config
    types = of_config(cfg, CacheTypes("q8_0", "q8_0"))
    q8 = kv_quant.BLOCK_BYTES["q8_0"] / kv_quant.QK
    assert model_kv_bytes_per_token(cfg, types=types) == sum(2 * h * d * q8 for h, d in zip(HEADS, SIZES)) == 1360
    sizes = model_sizes_from_gguf(mf.gguf, cfg)
    assert sizes.kv_values_per_token == tuple(2 * h * d for h, d in zip(HEADS, SIZES))
    card = DeviceInfo("sim", 8 * GiB, 8 * GiB, (8, 6))
    plan = plan_for_model(mf.gguf, cfg, 1024, gpu_layers=99, device=card)
    assert plan.gpu_layers == list(range(6)) and plan.vram_kv == 1024 * F16_BYTES_PER_TOKEN
    plan = plan_for_model(mf.gguf, cfg, 1024, gpu_layers=99, device=card, cache_types=types)
    assert plan.vram_kv == 1024 * 1360


def test_show_reports_heads_and_kv_bytes_per_token(path, capsys):
    import json

    from edgeinfer.cli import main

    assert main(["show", path]) == 0
    out = capsys.readouterr().out
    assert "8 (KV per layer: 4 on 4 layers, 1 on 2)" in out and f"{F16_BYTES_PER_TOKEN} bytes, f16" in out
    assert main(["show", path, "-ctk", "q8_0", "-ctv", "q8_0"]) == 0
    assert "1360 bytes, K q8_0, V q8_0" in capsys.readouterr().out
    assert main(["show", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["head_count_kv"] == list(HEADS)


def test_q8_0_cache_equals_llama_cpp(tmp_path):
    """q8_0 K and V, flash attention on both sides: the logits of the prompt and of 12 greedy
    steps as llama.cpp's (to the logit cap's tanh), the paged pool's as the contiguous cache's."""
    llama_cpp = importorskip_oracle()
    from edgeinfer.engine import Engine, EngineOptions
    from edgeinfer.kv.cache_types import GGML_TYPE_ID

    file = gemma4_sized_file(tmp_path, "31B", "Q8_0")
    prompt = [1] + np.random.default_rng(0).integers(3, 200, 20).tolist()
    ref = llama_cpp.Llama(model_path=file, logits_all=True, n_ctx=96, n_batch=96, n_threads=2, verbose=False,
                          flash_attn=True, type_k=GGML_TYPE_ID["q8_0"], type_v=GGML_TYPE_ID["q8_0"])
    ref.eval(prompt)
    engine = Engine(open_model(file), EngineOptions(n_ctx=96, cache_type_k="q8_0", cache_type_v="q8_0",
                                                    flash_attn="on"))
    kv = engine.new_cache()
    assert kv.k[2].shape == (96, 1, kv_quant.row_bytes("q8_0", 64))
    got = engine.forward(np.array(prompt), np.arange(len(prompt)), kv, logits_for=np.arange(len(prompt)))
    assert np.abs(got - np.array(ref.scores[:len(prompt)])).max() <= 1e-5
    logits = got[-1]
    for step in range(12):
        want = np.array(ref.scores[ref.n_tokens - 1])
        assert np.abs(logits - want).max() <= 1e-5, step
        ref.eval([int(np.argmax(want))])
        logits = engine.forward(np.array([int(np.argmax(want))]), np.array([len(prompt) + step]), kv)[-1]
    cache = PagedKVCache(engine.config, 16, block_size=8, cache_types=engine.cache_types)
    seq = cache.new_sequence(96)
    assert np.array_equal(engine.prefill(prompt, seq), engine.prefill(prompt, engine.new_cache()))


# -- session features ----------------------------------------------------------------------------

def _mgr(model, **kw):
    from edgeinfer.session_manager import SessionManager

    return SessionManager(model.engine, model.tokenizer, n_ctx=N_CTX, block_size=8, model_id="g4kv", **kw)


def test_prefix_cache_reuses_blocks_and_answers_as_a_cold_run(model):
    mgr, eng, tok = _mgr(model), model.engine, model.tokenizer
    rng = np.random.default_rng(1)
    a = random_ids(rng, 20, eng.config.n_vocab)
    first = collect(mgr.generate(a, greedy(4)))
    assert first.tokens == cold_greedy(eng, tok, a, 4)
    b = a + first.tokens + random_ids(rng, 5, eng.config.n_vocab)
    second = collect(mgr.generate(b, greedy(4)))
    assert second.tokens == cold_greedy(eng, tok, b, 4) and second.usage.cached_tokens >= 16
    mgr.check_invariants()


def test_saved_kv_has_each_layers_heads_and_resumes_exactly(model, tmp_path):
    from edgeinfer.sessions.session_file import SavedSession, load_session, save_session

    cfg, eng, tok = model.engine.config, model.engine, model.tokenizer
    mgr = _mgr(model)
    a = random_ids(np.random.default_rng(3), 18, cfg.n_vocab)
    collect(mgr.generate(a, greedy(3)))
    tokens, k, v, pos, *_ = mgr.export_kv()
    n = len(pos)
    assert [x.shape for x in k] == [y.shape for y in v] == [(n, h, d) for h, d in zip(HEADS, SIZES)]
    assert sum(x.nbytes + y.nbytes for x, y in zip(k, v)) == n * F16_BYTES_PER_TOKEN
    identity = {"name": "g4kv"}
    path = save_session(tmp_path / "s.npz", SavedSession(tokens=tokens, k=k, v=v, pos=pos), identity)
    saved = load_session(path, identity, config=cfg, n_ctx=N_CTX)
    assert saved.kv_refused is None and saved.n_kv == n
    fresh = _mgr(model)
    assert fresh.import_kv(saved.tokens, saved.k, saved.v, saved.pos) == n
    more = tokens + random_ids(np.random.default_rng(4), 4, cfg.n_vocab)
    out = collect(fresh.generate(more, greedy(4)))
    assert out.usage.cached_tokens >= n - 1 and out.tokens == cold_greedy(eng, tok, more, 4)
    # one head count for every layer (the model's largest) does not fit the global layers
    uniform = [np.zeros((n, 4, d), np.float16) for d in SIZES]
    with pytest.raises(EdgeInferError, match="do not fit"):
        fresh.import_kv(tokens, uniform, uniform, pos)
    # the file's check refuses it too, layer by layer
    bad = SavedSession(tokens=tokens, k=k[:2] + [uniform[2]] + k[3:], v=v, pos=pos)
    refused = load_session(save_session(tmp_path / "bad.npz", bad, identity), identity, config=cfg, n_ctx=N_CTX,
                           warn=lambda _: None)
    assert refused.k is None and "k2 has shape" in refused.kv_refused


def test_the_context_shift_rerotates_each_layers_heads(model):
    """A shifted sequence's kept keys stay, the moved ones are their old keys re-roped by
    -n_discard in their own heads (a global layer's 1, a sliding layer's 4); a generation
    through a shift goes on with the pool consistent."""
    from edgeinfer.kv import context_shift

    engine = model.engine
    toks = random_ids(np.random.default_rng(7), 40, engine.config.n_vocab)
    cache = PagedKVCache(engine.config, {0: 8, 16: 8}, 8, dtype=np.float32)
    seq = cache.new_sequence(40)
    engine.prefill(toks, seq)
    seq.record_tokens(toks)
    before = {i: np.array(seq.layer_view(i)[0]) for i in (2, 5)}  # global layers: every row held
    n_discard = context_shift.shift_context(engine, seq, n_keep=5)
    assert n_discard == 17
    for i, k in before.items():
        after = seq.layer_view(i)[0]
        assert after.shape == (40 - n_discard, 1, 64)
        assert np.array_equal(after[:5], k[:5])
        moved = context_shift.rope_shift(engine.backend, engine.model, i, k[5 + n_discard:],
                                         np.full(40 - 5 - n_discard, -n_discard))
        np.testing.assert_array_equal(after[5:], moved)
    for i in (0, 1, 3, 4):
        assert seq.layer_view(i)[0].shape[1:] == (4, 32)
    engine.decode(7, seq)
    cache.check_invariants()

    mgr = _mgr(model, context_shift=True, n_keep=4)
    prompt = random_ids(np.random.default_rng(8), N_CTX - 6, model.engine.config.n_vocab)
    out = collect(mgr.generate(prompt, greedy(12)))
    assert len(out.tokens) == 12 and mgr.stats()["context_shifts"] == 1
    mgr.check_invariants()
