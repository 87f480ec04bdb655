"""qwen35 and qwen35moe against llama.cpp, and what their files leave to the loader.

Parity as tests/test_moe.py holds the MoE families: prompt logits within max(0.01, 2 x
llama.cpp's own default-vs-flash-attention spread), 32 decode steps on llama.cpp's greedy
tokens within the same bound, and our own greedy tokens equal to llama.cpp's. Measured on
Q8_0: max |diff| 0 (bit for bit, prefill and decode, dense and MoE); on F32 ~2e-5 prefill
and ~2e-4 decode (ggml's F32 matmuls, tinyBLAS and vec_dot_f32, against edgeinfer's)."""

from __future__ import annotations

import numpy as np
import pytest
from llama_oracle import importorskip_oracle
from gguf_factory import TinyShape, bpe_vocab, write_tiny_model
from oracles import check_against_llama_cpp, engine_for, greedy_tokens

from edgeinfer.errors import EdgeInferError
from edgeinfer.loader import open_model
from edgeinfer.models import family_for
from edgeinfer.models.qwen35 import _unrotated_pairs

PROMPT = [1, 30, 40, 50, 60, 70, 80, 90, 100, 110]


def _file(tmp_path, arch="qwen35", qtype="Q8_0", extra=None, **shape):
    shape = {"n_layer": 4, **shape}
    return str(write_tiny_model(tmp_path / f"{arch}-{qtype}.gguf", arch, qtype, vocab=bpe_vocab("qwen35"),
                                shape=TinyShape(**shape), extra_metadata=extra))


@pytest.mark.parametrize("arch,qtype,backend", [("qwen35", "Q8_0", "cpu"), ("qwen35", "F32", "cpu"),
                                                ("qwen35moe", "Q8_0", "cpu"), ("qwen35", "F32", "reference")])
def test_matches_llama_cpp(tmp_path, arch, qtype, backend):
    path = _file(tmp_path, arch, qtype)
    engine = engine_for(path, backend)
    floor = 0.05 if backend == "reference" and qtype != "F32" else 0.01
    got, want, _, theirs = check_against_llama_cpp(path, engine, PROMPT, floor=floor)
    if qtype == "Q8_0" and backend == "cpu":
        assert np.abs(got - want).max() == 0  # ggml's order throughout
    assert greedy_tokens(engine, PROMPT, 32) == theirs


def test_config_as_llama_cpp_reads_it(tmp_path):
    cfg = open_model(_file(tmp_path, n_layer=8, full_attention_interval=4)).config
    assert family_for("qwen35").__name__ == "Qwen35"
    assert cfg.recurrent_layers == (True, True, True, False) * 2
    dn = cfg.delta_net
    assert (dn.n_k_heads, dn.n_v_heads, dn.head_k_dim, dn.head_v_dim, dn.conv_kernel) == (2, 4, 32, 32, 4)
    assert dn.conv_dim == 2 * 2 * 32 + 4 * 32 and cfg.rope_sections == (3, 1, 2, 0)
    # the recurrent-layers array wins over the interval (the tensors follow the array)
    flags = [True, True, True, False] * 2
    cfg = open_model(_file(tmp_path, n_layer=8, full_attention_interval=4,
                           extra={"qwen35.attention.recurrent_layers": flags,
                                  "qwen35.full_attention_interval": 2})).config
    assert cfg.recurrent_layers == tuple(flags)
    with pytest.raises(EdgeInferError, match="blk.1.attn_q.weight"):  # an array the tensors disagree with
        open_model(_file(tmp_path, n_layer=8, full_attention_interval=4,
                         extra={"qwen35.attention.recurrent_layers": [True, False] * 4}))


def test_nextn_layers_are_counted_in_block_count_and_not_run(tmp_path):
    # a 5-block file whose last block stands for an MTP layer: 4 trunk layers run
    path = _file(tmp_path, n_layer=5, extra={"qwen35.nextn_predict_layers": 1})
    cfg = open_model(path).config
    assert cfg.n_layer == 4 and cfg.n_layer_nextn == 1 and len(cfg.recurrent_layers) == 4
    engine_for(path, "reference").prefill([1, 2, 3], engine_for(path, "reference").new_cache())


def test_the_moe_file_has_no_feed_forward_length(tmp_path):
    mf = open_model(_file(tmp_path, "qwen35moe"))
    assert "qwen35moe.feed_forward_length" not in mf.gguf.metadata
    cfg = mf.config
    assert cfg.n_ff_exp == 128 and cfg.extra["n_ff_shexp"] == 128 and cfg.n_expert == 8


def test_ssm_a_is_stored_negative_and_value_heads_tile_key_heads(tmp_path):
    path = _file(tmp_path, "qwen35", "F32")
    engine = engine_for(path, "reference")
    a = engine.backend.vector("blk.0.ssm_a")
    assert (a < 0).all()  # -exp(A_log): every head decays
    assert engine.config.delta_net.n_v_heads % engine.config.delta_net.n_k_heads == 0  # tiled (kernel tests)


def test_unrotated_mrope_pairs():
    assert list(_unrotated_pairs(64, (11, 11, 10, 0))) == []  # Qwen3.5's sections: every pair
    assert list(_unrotated_pairs(16, (3, 1, 2, 0))) == [4]


def test_bad_sections_and_heads_are_one_line_errors(tmp_path):
    with pytest.raises(EdgeInferError, match="rope.dimension_sections"):
        open_model(_file(tmp_path, extra={"qwen35.rope.dimension_sections": [0, 0, 0, 0]}))
    with pytest.raises(EdgeInferError, match="cannot tile"):
        open_model(_file(tmp_path, extra={"qwen35.ssm.group_count": 3}))


@pytest.mark.parametrize("text", ["Héllo wörld e\u0301te \u0915\u093f\u0924\u093e\u092c 123 don't",
                                  "x\u0301\u0302!? \n\n a \u0645\u064e\u0631\u0652\u062d\u064e\u0628\u064b\u0627",
                                  "\u0301leading mark, and\u0308 'LL \u00e9\u0301\u0327"])
def test_qwen35_pre_tokenizer_matches_llama_cpp(tmp_path, text):
    """Letter runs take combining marks (\\p{M}); the fast and the reference splitters agree."""
    llama_cpp = importorskip_oracle()
    from edgeinfer.tokenizer import Tokenizer

    path = _file(tmp_path, "qwen35", "Q8_0")
    ref = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    tok = Tokenizer.from_metadata(open_model(path).gguf.metadata)
    want = ref.tokenize(text.encode(), add_bos=False, special=False)
    assert tok.tokenize(text, add_special=False) == want
    assert tok.tokenize_reference(text, add_special=False) == want


def test_the_gpu_plan_counts_states_not_kv_for_recurrent_layers(tmp_path):
    from edgeinfer.backends.offload import STATE_COPIES, model_sizes_from_gguf

    mf = open_model(_file(tmp_path, n_layer=4, full_attention_interval=2))
    cfg, sizes = mf.config, model_sizes_from_gguf(mf.gguf, mf.config)
    dn = cfg.delta_net
    state = STATE_COPIES * 4 * (int(np.prod(dn.conv_state_shape)) + int(np.prod(dn.ssm_state_shape)))
    tensors = [sum(t.n_bytes for n, t in mf.gguf.tensors.items() if n.startswith(f"blk.{i}.")) for i in range(4)]
    assert sizes.kv_values_per_token == (0, 2 * cfg.kv_dim, 0, 2 * cfg.kv_dim)
    assert list(sizes.layer_weights) == [tensors[0] + state, tensors[1], tensors[2] + state, tensors[3]]
