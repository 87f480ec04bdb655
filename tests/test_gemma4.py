"""gemma4 against llama.cpp, and what its files leave to the loader.

Parity as tests/test_qwen35.py holds its families: prompt logits within max(0.01, 2 x
llama.cpp's own default-vs-flash-attention spread), 32 decode steps on llama.cpp's greedy
tokens within the same bound, and our own greedy tokens equal to llama.cpp's. The fixtures
exercise what Gemma 4 adds: per-layer sliding flags, two head sizes, shared K/V layers
(the last 4 of 8), per-layer embeddings, per-layer FFN sizes, V = K on global layers,
layer_output_scale, proportional RoPE, the logit cap, and (MoE) the experts beside the
shared MLP with per-expert down scales; the 26B-A4B / 31B / 12B kinds (gemma4_sized_file):
per-layer K/V head counts, fewer on the global layers, with V = K there.

Measured (CPU backend, Q8_0): MoE bit for bit but for the cap's tanh (4.8e-7); dense 0
on 31 of 32 prompt rows and 0.05 on one token (llama.cpp's own spread there: 0.19);
F32 on the reference backend ~2.5e-3 (spread 4e-3)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_factory import gemma4_file, gemma4_sized_file
from oracles import check_against_llama_cpp, engine_for, greedy_tokens

from edgeinfer.engine import Engine, EngineOptions
from edgeinfer.errors import EdgeInferError
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.kv.paged import PagedKVCache
from edgeinfer.kv.pool_sizing import model_kv_bytes_per_token, plan_pools
from edgeinfer.loader import open_model
from edgeinfer.models import family_for

PROMPT = [1, 30, 40, 50, 60, 70, 80, 90, 100, 110]


@pytest.mark.parametrize("moe,qtype,backend", [(False, "Q8_0", "cpu"), (True, "Q8_0", "cpu"),
                                               (False, "F32", "reference")])
def test_matches_llama_cpp(tmp_path, moe, qtype, backend):
    path = gemma4_file(tmp_path, qtype, moe)
    engine = engine_for(path, backend)
    got, want, _, theirs = check_against_llama_cpp(path, engine, PROMPT)
    if moe and qtype == "Q8_0":
        assert np.abs(got - want).max() <= 1e-6  # ggml's order throughout (tanh to 1 ulp)
    assert greedy_tokens(engine, PROMPT, 32) == theirs


@pytest.mark.parametrize("size,qtype,backend", [("26B-A4B", "Q8_0", "cpu"), ("31B", "Q8_0", "cpu"),
                                                ("31B", "F32", "reference")])
def test_per_layer_kv_heads_match_llama_cpp(tmp_path, size, qtype, backend):
    path = gemma4_sized_file(tmp_path, size, qtype)
    engine = engine_for(path, backend)
    cfg = engine.config
    assert len(set(cfg.n_head_kv_layers)) == 2 and cfg.n_head_kv == 4
    got, want, _, theirs = check_against_llama_cpp(path, engine, PROMPT)
    if qtype == "Q8_0" and size == "26B-A4B":
        assert np.abs(got - want).max() <= 1e-6
    assert greedy_tokens(engine, PROMPT, 32) == theirs


def test_per_layer_kv_heads_in_the_config(tmp_path):
    """26B-A4B's kind: 4 K/V heads on sliding layers, 2 on global ones (no attn_v: V = K); each
    layer's K/V bytes follow its own heads and head size."""
    cfg = open_model(gemma4_sized_file(tmp_path, "26B-A4B")).config
    assert cfg.n_head_kv_layers == (4, 4, 2) * 2 and [cfg.n_head_kv_of(i) for i in range(6)] == [4, 4, 2] * 2
    assert cfg.swa_layers == (True, True, False) * 2 and cfg.n_expert == 8
    assert [cfg.saved_kv_shapes(i) for i in range(3)] == [((4, 32), (4, 32))] * 2 + [((2, 64), (2, 64))]
    assert [cfg.kv_values_of(i) for i in range(6)] == [4 * 64, 4 * 64, 2 * 128] * 2
    uniform = open_model(gemma4_file(tmp_path)).config  # one count: no per-layer tuple
    assert uniform.n_head_kv_layers == () and uniform.n_head_kv_of(3) == 2


def test_config_as_llama_cpp_reads_it(tmp_path):
    cfg = open_model(gemma4_file(tmp_path)).config
    assert family_for("gemma4").__name__ == "Gemma4"
    assert cfg.swa_layers == (True, True, True, False) * 2 and cfg.sliding_window == 16
    assert (cfg.head_dim, cfg.head_dim_swa) == (64, 32)
    assert [cfg.head_dim_of(i) for i in range(8)] == [32, 32, 32, 64] * 2
    # n_kv_from_start = 8 - 4: sliding layers reuse layer 4 - 2, global ones layer 4 - 1
    assert [cfg.kv_source(i) for i in range(8)] == [0, 1, 2, 3, 2, 2, 2, 3]
    assert cfg.kv_layers == (0, 1, 2, 3)
    assert cfg.n_ff_layers == (256,) * 4 + (512,) * 4 and cfg.n_ff == 512
    assert cfg.extra["n_embd_per_layer"] == 32 and cfg.extra["final_logit_softcapping"] == 30.0
    assert cfg.rope_base_swa == 10_000.0 and cfg.rope_dims_swa == 32 and cfg.attn_scale == 1.0
    # llama.cpp caps at 30 when the key is absent; 0 turns the cap off
    absent = open_model(gemma4_file(tmp_path, extra={"gemma4.final_logit_softcapping": None},
                                    name="nocap.gguf")).config
    assert absent.extra["final_logit_softcapping"] == 30.0
    moe = open_model(gemma4_file(tmp_path, moe=True)).config
    assert moe.n_expert == 8 and moe.n_expert_used == 2 and all(moe.extra["moe_layers"])


def test_bad_metadata_is_one_line(tmp_path):
    with pytest.raises(EdgeInferError, match="sliding_window_pattern"):
        open_model(gemma4_file(tmp_path, extra={"gemma4.attention.sliding_window_pattern": None}, name="a.gguf"))
    with pytest.raises(EdgeInferError, match="sliding_window_pattern"):
        open_model(gemma4_file(tmp_path, extra={"gemma4.attention.sliding_window_pattern": [True, False]},
                               name="b.gguf"))
    with pytest.raises(EdgeInferError, match="shared_kv_layers"):  # fewer than 2 layers keep K/V
        open_model(gemma4_file(tmp_path, extra={"gemma4.attention.shared_kv_layers": 7}, name="c.gguf"))


def test_per_layer_embeddings_are_read_only_for_the_batch(tmp_path):
    engine = engine_for(gemma4_file(tmp_path), "cpu")
    seen = []
    get_rows = engine.backend.get_rows

    def spy(name, ids):
        seen.append((name, len(ids)))
        return get_rows(name, ids)

    engine.backend.get_rows = spy
    engine.prefill([1, 5, 6], engine.new_cache())
    assert ("per_layer_token_embd.weight", 3) in seen


# -- K/V memory: a shared K/V is stored and counted once ------------------------------------------

def _kv_values(cfg) -> int:
    return sum(cfg.n_head_kv * 2 * cfg.head_dim_of(i) for i in range(cfg.n_layer) if cfg.kv_source(i) == i)


def test_shared_kv_is_stored_once(tmp_path):
    cfg = open_model(gemma4_file(tmp_path)).config
    # 3 sliding layers of 2 x 32 + 1 global of 2 x 64, K and V, f16; the 4 shared layers nothing
    assert model_kv_bytes_per_token(cfg) == 2 * 2 * (3 * 2 * 32 + 2 * 64) == 1280
    assert model_kv_bytes_per_token(cfg) == 2 * _kv_values(cfg)
    kv = KVCache(cfg, 16)
    assert [a.shape for a in kv.k[:4]] == [(16, 2, 32)] * 3 + [(16, 2, 64)]
    assert all(a.shape[0] == 0 for a in kv.k[4:] + kv.v[4:])
    assert kv.nbytes == 16 * 1280
    cache = PagedKVCache(cfg, {0: 4, 16: 6}, block_size=8)
    assert [(g.window, g.layers) for g in cache.groups] == [(0, (3,)), (16, (0, 1, 2))]
    assert [g.bytes_per_block for g in cache.groups] == [8 * 2 * 2 * 128, 8 * 2 * 3 * 128]
    assert all(cache.k[i].size == 0 for i in range(4, 8))
    assert cache.group_of[7] is cache.group_of[3] and cache.group_of[5] is cache.group_of[2]
    plan = plan_pools(cfg, 64, 8)
    assert set(plan.blocks) == {0, 16}


def test_the_offload_plan_counts_a_shared_kv_once(tmp_path):
    from edgeinfer.backends.offload import model_sizes_from_gguf

    mf = open_model(gemma4_file(tmp_path))
    sizes = model_sizes_from_gguf(mf.gguf, mf.config)
    assert sizes.kv_values_per_token == (128, 128, 128, 256, 0, 0, 0, 0)
    assert 2 * sum(sizes.kv_values_per_token) == model_kv_bytes_per_token(mf.config)


def test_show_reports_kv_bytes_per_token(tmp_path, capsys):
    from edgeinfer.cli import main

    path = gemma4_file(tmp_path)
    assert main(["show", path]) == 0
    out = capsys.readouterr().out
    assert "K/V per token" in out and "1280 bytes" in out and "4 of 8 layers reuse" in out


# -- session features ----------------------------------------------------------------------------

N_CTX = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import edgeinfer

    path = gemma4_file(tmp_path_factory.mktemp("g4"), "F32")
    return edgeinfer.load(path, backend="reference", n_ctx=N_CTX)


def _mgr(model, **kw):
    from edgeinfer.session_manager import SessionManager

    return SessionManager(model.engine, model.tokenizer, n_ctx=N_CTX, block_size=8, model_id="g4", **kw)


def test_prefix_cache_reuses_blocks_and_answers_as_a_cold_run(model):
    from oracles import cold_greedy, greedy, random_ids

    from edgeinfer.generate import collect

    mgr, eng, tok = _mgr(model), model.engine, model.tokenizer
    rng = np.random.default_rng(1)
    a = random_ids(rng, 20, eng.config.n_vocab)
    first = collect(mgr.generate(a, greedy(4)))
    assert first.tokens == cold_greedy(eng, tok, a, 4) and first.usage.cached_tokens == 0
    b = a + first.tokens + random_ids(rng, 5, eng.config.n_vocab)  # the next turn resends the history
    second = collect(mgr.generate(b, greedy(4)))
    assert second.tokens == cold_greedy(eng, tok, b, 4) and second.usage.cached_tokens >= 16
    c = a[:16] + random_ids(rng, 6, eng.config.n_vocab)  # an edit: the shared prefix is reused
    third = collect(mgr.generate(c, greedy(3)))
    assert third.tokens == cold_greedy(eng, tok, c, 3) and third.usage.cached_tokens >= 16
    mgr.check_invariants()


def test_saved_kv_keeps_a_shared_kv_once_and_resumes_exactly(model, tmp_path):
    from oracles import cold_greedy, greedy, random_ids

    from edgeinfer.generate import collect
    from edgeinfer.sessions.session_file import SavedSession, load_session, save_session

    cfg, eng, tok = model.engine.config, model.engine, model.tokenizer
    mgr = _mgr(model)
    a = random_ids(np.random.default_rng(3), 18, cfg.n_vocab)
    collect(mgr.generate(a, greedy(3)))
    tokens, k, v, pos, *_ = mgr.export_kv()
    n = len(pos)
    assert [x.shape[2] for x in k] == [32, 32, 32, 64, 0, 0, 0, 0]  # shared layers: no columns
    assert sum(x.nbytes + y.nbytes for x, y in zip(k, v)) == n * model_kv_bytes_per_token(cfg)
    identity = {"name": "g4"}
    path = save_session(tmp_path / "g4.npz", SavedSession(tokens=tokens, k=k, v=v, pos=pos), identity)
    saved = load_session(path, identity, cfg.n_layer, config=cfg, n_ctx=N_CTX)
    assert saved.kv_refused is None and saved.n_kv == n
    fresh = _mgr(model)
    assert fresh.import_kv(saved.tokens, saved.k, saved.v, saved.pos) == n
    more = tokens + random_ids(np.random.default_rng(4), 4, cfg.n_vocab)
    out = collect(fresh.generate(more, greedy(4)))
    assert out.usage.cached_tokens >= n - 1 and out.tokens == cold_greedy(eng, tok, more, 4)
    bad = [np.zeros((n, cfg.n_head_kv, 32), np.float16)] * cfg.n_layer  # a layer of the wrong size
    with pytest.raises(EdgeInferError, match="do not fit"):
        fresh.import_kv(tokens, bad, bad, pos)


@pytest.mark.parametrize("swa", [False, True])
def test_context_shift_rerotates_each_layers_rope(tmp_path, swa):
    """One layer (K/V depend on token and position only): after a shift the next logits equal a
    cold run over the shifted tokens, with the global layer's proportional RoPE or the
    sliding layer's base and head size."""
    from oracles import random_ids

    from edgeinfer.kv import context_shift

    path = gemma4_file(tmp_path, "F32", n_layer=1, shared_kv_layers=0, n_ff_layers=(), swa_pattern=(swa,),
                       extra={"gemma4.attention.sliding_window": 64}, name=f"one-{swa}.gguf")
    engine = Engine(open_model(path), EngineOptions(n_ctx=40, backend="reference"))
    toks = random_ids(np.random.default_rng(7), 40, engine.config.n_vocab)
    cache = PagedKVCache(engine.config, 8, 8, dtype=np.float32)
    seq = cache.new_sequence(40)
    engine.prefill(toks, seq)
    seq.record_tokens(toks)
    n_discard = context_shift.shift_context(engine, seq, n_keep=5)
    assert n_discard == 17
    warm = engine.decode(7, seq)
    reference = engine.prefill(toks[:5] + toks[5 + n_discard:] + [7], KVCache(engine.config, 40, np.float32))
    np.testing.assert_allclose(warm, reference, rtol=0, atol=5e-5)


def test_generation_through_a_shift_with_shared_kv(model):
    from oracles import greedy, random_ids

    from edgeinfer.generate import collect

    mgr = _mgr(model, context_shift=True, n_keep=4)
    prompt = random_ids(np.random.default_rng(8), N_CTX - 6, model.engine.config.n_vocab)
    out = collect(mgr.generate(prompt, greedy(12)))
    assert len(out.tokens) == 12 and mgr.stats()["context_shifts"] == 1
    mgr.check_invariants()
