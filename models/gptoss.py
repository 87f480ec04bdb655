"""gpt-oss (llama.cpp's openai-moe): a mixture of experts with attention sinks, sliding-window
and full layers alternating, YaRN RoPE and biases almost everywhere.

As llama.cpp's openai-moe.cpp builds it, block by block:
- attention: RMS norm, Q/K/V with biases, NeoX RoPE with YaRN on every layer (the sliding
  layers too), attention whose softmax counts one learned sink logit per head
  (`attn_sinks`), the output projection plus its bias, the residual;
- the even-numbered layers slide over `attention.sliding_window` tokens (llama.cpp's
  set_swa_pattern(2); a `sliding_window_pattern` key overrides it as in llama.cpp);
- experts: `post_attention_norm`, a router with a bias whose top `expert_used_count`
  logits are softmaxed among themselves, expert matrices and biases for gate, up and down,
  and the clamped SwiGLU (alpha 1.702, limit 7) between them.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from edgeinfer.errors import MetadataError
from edgeinfer.experts import ffn, routing
from edgeinfer.metadata import MAX_CTX, MAX_LAYERS, MAX_ROPE_BASE, meta_float, meta_int
from edgeinfer.models.llama import Llama
from edgeinfer.models.moe import expert_names, expert_shapes, with_experts, without_dense_ffn
from edgeinfer.rope import ROPE_NEOX

SWA_PATTERN = 2  # llama.cpp's default for openai-moe: layer i slides when i % 2 == 0


class GptOss(Llama):
    ROPE_MODE = ROPE_NEOX
    SWA_ROPE_SCALED = True  # llama.cpp: rope_freq_scale_train_swa = rope_freq_scale_train

    @classmethod
    def adjust_config(cls, cfg, gf):
        md, key = gf.metadata, f"{cfg.arch}."
        cfg = with_experts(cfg, gf)
        window = meta_int(md, key + "attention.sliding_window", 1, MAX_CTX)
        swa = swa_layers(gf, key + "attention.sliding_window_pattern", cfg.n_layer, SWA_PATTERN)
        base_swa = meta_float(md, key + "rope.freq_base_swa", 0.0, MAX_ROPE_BASE, 0.0, lo_exclusive=True)
        return replace(cfg, sliding_window=window, swa_layers=swa, rope_base_swa=base_swa)

    @classmethod
    def layer_tensors(cls, cfg, i):
        t = without_dense_ffn(super().layer_tensors(cfg, i), i)
        p = f"blk.{i}."
        del t[p + "ffn_norm.weight"]
        e, ff = cfg.n_expert, cfg.n_ff_exp
        t.update({
            p + "post_attention_norm.weight": (cfg.n_embd,),
            p + "attn_sinks.weight": (cfg.n_head,),
            p + "attn_output.bias": (cfg.n_embd,),
            p + "ffn_gate_inp.weight": (cfg.n_embd, e),
            p + "ffn_gate_inp.bias": (e,),
            **expert_shapes(cfg, i),
            p + "ffn_gate_exps.bias": (ff, e),
            p + "ffn_up_exps.bias": (ff, e),
            p + "ffn_down_exps.bias": (cfg.n_embd, e),
        })
        return t

    @classmethod
    def optional_tensors(cls, cfg):
        t = super().optional_tensors(cfg)
        for i in range(cfg.n_layer):  # llama.cpp takes Q/K/V biases when present (gpt-oss files have them)
            p = f"blk.{i}."
            t.update({p + "attn_q.bias": (cfg.q_dim,), p + "attn_k.bias": (cfg.kv_dim,),
                      p + "attn_v.bias": (cfg.n_head_kv * cfg.head_dim_v,)})
        return t

    def attention_sinks(self, i):
        return f"blk.{i}.attn_sinks.weight"

    def add_attention_output(self, i, attn, x):
        be = self.backend
        return x + (be.linear(f"blk.{i}.attn_output.weight", attn) + be.vector(f"blk.{i}.attn_output.bias"))

    def feed_forward(self, i, x):
        h = self.backend.rms_norm(x, f"blk.{i}.post_attention_norm.weight", self.config.norm_eps)
        return x + self.experts(i, h)

    def experts(self, i: int, h: np.ndarray) -> np.ndarray:
        be, cfg, p = self.backend, self.config, f"blk.{i}."
        logits = np.asarray(be.linear(p + "ffn_gate_inp.weight", h), np.float32) + be.vector(p + "ffn_gate_inp.bias")
        chosen, weights = routing.topk_softmax(logits, cfg.n_expert_used)
        return ffn.swiglu_experts(be, h, chosen, weights, *expert_names(i),
                                  biases=tuple(expert_names(i, "bias")), activation=be.swiglu_oai)


def swa_layers(gf, key: str, n_layer: int, default_pattern: int) -> tuple[bool, ...]:
    """Which layers slide, as llama.cpp's load_swa_pattern reads it: a per-layer array of
    bools under `key`, else a pattern n under it (layer i slides when i % n < n - 1; 0: all
    slide), else `default_pattern`."""
    value = gf.metadata.get(key)
    if isinstance(value, (list, tuple, np.ndarray)) and not isinstance(value, (str, bytes)):
        flags = list(value)
        if len(flags) != n_layer or not all(isinstance(f, (bool, np.bool_)) or f in (0, 1) for f in flags):
            raise MetadataError(f"{gf.path}: metadata key {key!r} must hold {n_layer} booleans, one a layer")
        return tuple(bool(f) for f in flags)
    n = meta_int(gf.metadata, key, 0, MAX_LAYERS, default_pattern)
    return tuple(n == 0 or i % n < n - 1 for i in range(n_layer))
