"""K/V cache types in the caches: quantized rows stored as ggml blocks (rotated as llama.cpp
rotates them), block hashes that never mix types, the paged pool giving the same logits as
the contiguous cache, the context shift re-roping quantized keys, and the one-line errors."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.kernels_cpu import kv_quant
from edgeinfer.kv.cache_types import CacheTypeError, CacheTypes, of_config, parse
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.kv.paged import PagedKVCache
from gguf_factory import write_tiny_model

from dataclasses import replace

from test_paged_kv import CFG as _SMALL

CFG = replace(_SMALL, head_dim=64, head_dim_v=64, rope_dims=64)   # whole 32-value blocks, a 64 rotation


def test_parse_names_the_flag_and_the_allowed_types():
    assert parse("Q8_0", "--cache-type-k") == "q8_0"
    with pytest.raises(CacheTypeError, match=r"^--cache-type-v: unknown cache type 'q9' \(allowed: f16, q8_0"):
        parse("q9", "--cache-type-v")
    assert parse("IQ4_NL", "--cache-type-k") == "iq4_nl"
    with pytest.raises(CacheTypeError, match=r"^--cache-type-k: bf16 is not supported \(allowed: .*iq4_nl\)$"):
        parse("bf16", "--cache-type-k")


def test_contiguous_cache_stores_rotated_quantized_rows():
    types = of_config(CFG, CacheTypes("q8_0", "q4_0"))
    kv = KVCache(CFG, 8, cache_types=types)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, CFG.n_head_kv, CFG.head_dim)).astype(np.float32)
    v = rng.standard_normal((3, CFG.n_head_kv, CFG.head_dim_v)).astype(np.float32)
    kv.append(np.arange(3))
    kv.store(0, np.arange(3), k, v)
    kr, vr, _ = kv.layer_view(0)
    assert kr.dtype == np.uint8 and kr.shape[-1] == kv_quant.row_bytes("q8_0", CFG.head_dim)
    assert (types.rot_k, types.rot_v) == (64, 64)
    want = kv_quant.quantize("q8_0", kv_quant.fwht(k, 64))
    assert np.array_equal(kr, want)
    assert np.allclose(types.decode("k", kr), k, atol=0.05)
    assert np.allclose(types.decode("v", vr), v, atol=0.5)


def test_head_sizes_not_in_whole_blocks_are_refused():
    with pytest.raises(CacheTypeError, match="^--cache-type-k: q8_0 needs head sizes that are multiples of 32"):
        of_config(_SMALL, CacheTypes("q8_0", "f16"))


def test_block_hashes_differ_by_cache_type():
    tokens = list(range(32))
    hashes = []
    for types in (None, CacheTypes("q8_0", "q8_0"), CacheTypes("q8_0", "f16")):
        cache = PagedKVCache(CFG, 8, block_size=4, cache_types=types)
        from edgeinfer.kv.block_pool import compute_block_hashes

        hashes.append(compute_block_hashes(tokens, 4, cache.extra_keys)[0])
    assert len(set(hashes)) == 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kvt") / "m.gguf", "llama", "Q8_0", seed=5)


def test_paged_pool_matches_contiguous_and_shift_and_sessions(tiny):
    import edgeinfer
    from edgeinfer.errors import EdgeInferError
    from edgeinfer.sampling import SamplingParams

    model = edgeinfer.load(tiny, n_ctx=48, cache_type_k="q4_0", cache_type_v="q8_0", context_shift=True, n_keep=4)
    engine = model.engine
    assert engine.cache_types.quantized
    prompt = [1] + list(range(5, 25))
    kv = engine.new_cache()
    want = engine.prefill(prompt, kv)
    seq = model.sessions.cache.new_sequence(48)
    got = engine.prefill(prompt, seq)
    assert np.array_equal(got, want)
    model.sessions.cache.release(seq)
    # a generation past the window shifts the context (quantized K re-roped) and goes on
    chunks = list(model.sessions.generate(prompt, SamplingParams(temperature=0, max_tokens=40)))
    assert chunks[-1].finish_reason is not None
    assert model.sessions.shifts >= 1
    with pytest.raises(EdgeInferError, match=r"^saved K/V are K f16, V f16 and this run's cache is K q4_0, V q8_0 "
                                             r"\(-ctk/-ctv\)"):
        model.sessions.import_kv([1, 2], [], [], np.arange(2))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding layers whose dropped rows are blank
def test_saved_sessions_keep_quantized_kv_and_refuse_other_types(tmp_path, arch):
    """K/V saved under q4_0/q8_0 are the cache's raw blocks (rows a window dropped marked by NaN
    block scales); they resume bit for bit under the same types and are refused in one line
    under others."""
    import edgeinfer
    from edgeinfer.errors import EdgeInferError
    from edgeinfer.generate import collect
    from edgeinfer.sessions.session_file import load_session, save_session, SavedSession
    from edgeinfer.sampling import SamplingParams
    from gguf_factory import TinyShape

    shape = TinyShape(n_embd=64, n_layer=6, n_head=2, n_head_kv=1, head_dim=64, n_ff=64,
                      extra={"sliding_window": 8})
    path = str(write_tiny_model(tmp_path / f"{arch}.gguf", arch, "Q8_0", shape=shape, seed=6))

    def load(k="q4_0", v="q8_0"):
        return edgeinfer.load(path, n_ctx=96, cache_type_k=k, cache_type_v=v)

    greedy = SamplingParams(temperature=0, max_tokens=6)
    first = load()
    prompt = [1] + [5 + i % 40 for i in range(72)]  # past two 32-token drops of the window
    collect(first.sessions.generate(prompt, greedy))
    kv = first.sessions.export_kv()
    assert kv.kv_types == "k=q4_0,v=q8_0"
    assert kv.k[0].dtype == np.uint8 and kv.k[0].shape[-1] == kv_quant.row_bytes("q4_0", 64)
    if arch == "gemma3":  # the window dropped the oldest rows of a sliding layer: marked blank
        types = first.engine.cache_types
        blank = types.blank_mask("k", kv.k[0])
        assert blank[:32].all() and not blank[-8:].any() and np.array_equal(blank, types.blank_mask("v", kv.v[0]))
        full = [i for i in range(first.config.n_layer) if not first.config.is_swa(i)]
        assert full and not any(types.blank_mask("k", kv.k[i]).any() for i in full)  # global layers hold every row
    saved = SavedSession(messages=[{"role": "user", "content": "x"}])
    saved.set_kv(kv)
    file = save_session(tmp_path / "s.npz", saved, first.identity)
    back = load_session(file, first.identity, config=first.config, n_ctx=96)
    assert back.kv_refused is None and back.kv_types == kv.kv_types
    for a, b in zip(back.k + back.v, kv.k + kv.v):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    fresh = load()
    assert fresh.sessions.import_kv(*back.saved_kv()) == len(kv.pos)
    more = kv.tokens + [7, 8, 9]
    want = collect(first.sessions.generate(more, greedy))
    got = collect(fresh.sessions.generate(more, greedy))
    assert got.tokens == want.tokens and got.usage.cached_tokens >= len(kv.pos) - 1
    for other in (load("f16", "f16"), load("q8_0", "q8_0")):
        with pytest.raises(EdgeInferError, match=r"^saved K/V are K q4_0, V q8_0 and this run's cache is"):
            other.sessions.import_kv(*back.saved_kv())


def test_props_and_ps_report_the_cache_types(tmp_path):
    from starlette.testclient import TestClient

    import edgeinfer
    from edgeinfer.server import ServerConfig, create_app
    from gguf_factory import write_tiny_model

    path = write_tiny_model(tmp_path / "m.gguf", "llama", "F32")
    model = edgeinfer.load(str(path), n_ctx=64, gpu_layers=0, cache_type_k="q8_0", cache_type_v="q4_0")
    with TestClient(create_app(ServerConfig(model_name="tiny"), model), base_url="http://127.0.0.1") as c:
        props = c.get("/props").json()
        assert (props["cache_type_k"], props["cache_type_v"]) == ("q8_0", "q4_0")
        ps = c.get("/api/ps").json()["models"][0]
        assert (ps["cache_type_k"], ps["cache_type_v"]) == ("q8_0", "q4_0")
