"""Quantized K/V caches against llama.cpp itself: the same tiny model with the same type_k /
type_v and flash attention on gives the same logits, bit for bit, over a prompt and 20
greedy steps (llama.cpp's Hadamard rotations and flash-attention order, kv/cache_types.py)."""
from __future__ import annotations

import numpy as np
import pytest
from llama_oracle import importorskip_oracle

from edgeinfer.engine import Engine, EngineOptions
from edgeinfer.kv.cache_types import GGML_TYPE_ID
from edgeinfer.loader import open_model
from gguf_factory import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kvq") / "m.gguf", "llama", "Q8_0", seed=3)


@pytest.mark.parametrize("tk,tv", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q8_0"),
                                   ("iq4_nl", "iq4_nl"), ("f16", "f16")])  # f16: -fa on
def test_logits_and_greedy_tokens_equal_llama_cpp(tiny, tk, tv):
    llama_cpp = importorskip_oracle()
    prompt = [1] + np.random.default_rng(0).integers(3, 200, 20).tolist()
    ref = llama_cpp.Llama(model_path=str(tiny), logits_all=True, n_ctx=96, n_batch=96, n_threads=2, verbose=False,
                          flash_attn=True, type_k=GGML_TYPE_ID[tk], type_v=GGML_TYPE_ID[tv])
    ref.eval(prompt)
    engine = Engine(open_model(tiny), EngineOptions(n_ctx=96, cache_type_k=tk, cache_type_v=tv, flash_attn="on"))
    kv = engine.new_cache()
    got = engine.forward(np.array(prompt), np.arange(len(prompt)), kv, logits_for=np.arange(len(prompt)))
    assert np.array_equal(got, np.array(ref.scores[:len(prompt)]))
    ours, theirs = [], []
    logits = got[-1]
    for step in range(20):
        want = np.array(ref.scores[ref.n_tokens - 1])
        assert np.array_equal(logits, want), step
        theirs.append(int(np.argmax(want)))
        ours.append(int(np.argmax(logits)))
        ref.eval(theirs[-1:])
        logits = engine.forward(np.array(theirs[-1:]), np.array([len(prompt) + step]), kv)[-1]
    assert ours == theirs


def test_flash_attn_flag_checks_in_one_line(tiny):
    from edgeinfer.kv.cache_types import CacheTypeError

    with pytest.raises(CacheTypeError, match=r"^--flash-attn off: a quantized K/V cache \(K q8_0, V f16\)"):
        Engine(open_model(tiny), EngineOptions(n_ctx=16, cache_type_k="q8_0", flash_attn="off"))
    with pytest.raises(CacheTypeError, match=r"^--flash-attn: expected on, off or auto, got 'maybe'$"):
        Engine(open_model(tiny), EngineOptions(n_ctx=16, flash_attn="maybe"))
    assert not Engine(open_model(tiny), EngineOptions(n_ctx=16)).cache_types.flash_order  # auto, f16
