"""Models whose matrices are i-quants, alone and mixed as Unsloth's UD files mix them, against llama.cpp."""
from __future__ import annotations

import pytest

from gguf_factory import TinyShape, write_tiny_model
from oracles import check_against_llama_cpp, engine_for, greedy_tokens

PROMPT = [1, 30, 40, 50, 60, 70, 80, 90, 100, 110]
SHAPE = TinyShape(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64)
# a UD-Q2_K_XL-like mix: i-quants for the big matrices, K-quants beside them
UD_MIX = {"attn_q.weight": "IQ2_XXS", "attn_k.weight": "IQ2_S", "attn_v.weight": "IQ3_S",
          "attn_output.weight": "IQ3_XXS", "ffn_gate.weight": "IQ1_S", "ffn_up.weight": "IQ1_M",
          "ffn_down.weight": "IQ2_XS", "output.weight": "Q6_K", "token_embd.weight": "Q4_K"}


@pytest.mark.parametrize("qtype", ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "UD"])
def test_greedy_tokens_are_llama_cpp_s(tmp_path, qtype):
    mix = UD_MIX if qtype == "UD" else None
    path = write_tiny_model(tmp_path / "m.gguf", "llama", "Q4_K" if mix else qtype, shape=SHAPE, seed=3,
                            tensor_qtypes=mix)
    engine = engine_for(path, "cpu")
    # logits within llama.cpp's own spread (its flash attention off against on), then its tokens
    _, _, _, theirs = check_against_llama_cpp(path, engine, PROMPT, steps=24)
    assert greedy_tokens(engine, PROMPT, 24) == theirs
