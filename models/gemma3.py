"""Gemma 3 (text): embeddings scaled by sqrt(n_embd), four RMSNorms per block (pre and post
attention, pre and post FFN), per-head q/k norm, GELU(tanh) gated FFN, tied embeddings.

Five of every six layers use a sliding window with their own RoPE base (10k; the global
layers use `gemma3.rope.freq_base`). Norm weights already include Gemma's `1 +` offset:
the GGUF converter bakes it in, so the norm is a plain RMSNorm here. The output head is
the embedding matrix unless the file carries `output.weight`.
"""

from __future__ import annotations

import math
from dataclasses import replace

from edgeinfer.metadata import MAX_CTX, meta_int
from edgeinfer.models.base import Transformer
from edgeinfer.rope import ROPE_NEOX

SWA_PATTERN = 6  # layer i is global when (i + 1) % 6 == 0, as llama.cpp's set_swa_pattern(6)
ROPE_BASE_SWA = 10_000.0


class Gemma3(Transformer):
    ROPE_MODE = ROPE_NEOX
    DEFAULT_NORM_EPS = 1e-6
    DEFAULT_ROPE_BASE = 1_000_000.0

    @classmethod
    def adjust_config(cls, cfg, gf):
        window = meta_int(gf.metadata, "gemma3.attention.sliding_window", 0, MAX_CTX, 0)
        swa = tuple(bool(window) and (i % SWA_PATTERN) < SWA_PATTERN - 1 for i in range(cfg.n_layer))
        # gemma 27B scales by n_embd / n_head instead of the head size (llama.cpp does the same)
        big = cfg.n_layer == 62
        scale = 1.0 / math.sqrt(cfg.n_embd / cfg.n_head if big else cfg.head_dim)
        return replace(cfg, sliding_window=window, swa_layers=swa, rope_base_swa=ROPE_BASE_SWA,
                       attn_scale=scale, embed_scale=math.sqrt(cfg.n_embd))

    @classmethod
    def layer_tensors(cls, cfg, i):
        t = super().layer_tensors(cfg, i)
        p = f"blk.{i}."
        t[p + "attn_q_norm.weight"] = (cfg.head_dim,)
        t[p + "attn_k_norm.weight"] = (cfg.head_dim,)
        t[p + "post_attention_norm.weight"] = (cfg.n_embd,)
        t[p + "post_ffw_norm.weight"] = (cfg.n_embd,)
        return t

    def layer(self, i, x, positions, slots, kv):
        be, cfg, p = self.backend, self.config, f"blk.{i}."
        n, eps = x.shape[0], cfg.norm_eps
        h = be.rms_norm(x, p + "attn_norm.weight", eps)
        q, k, v = be.linear_many([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], h)
        q = q.reshape(n, cfg.n_head, cfg.head_dim)
        k = k.reshape(n, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(n, cfg.n_head_kv, cfg.head_dim_v)
        q = be.rms_norm(q, p + "attn_q_norm.weight", eps)
        k = be.rms_norm(k, p + "attn_k_norm.weight", eps)
        attn = self.attention(i, q, k, v, positions, slots, kv)
        h = be.linear(p + "attn_output.weight", attn)
        x = be.residual_rms_norm(x, h, p + "post_attention_norm.weight", eps)
        h = be.rms_norm(x, p + "ffn_norm.weight", eps)
        h = be.linear(p + "ffn_down.weight", be.gated_linear(p + "ffn_gate.weight", p + "ffn_up.weight", h, "gelu"))
        return be.residual_rms_norm(x, h, p + "post_ffw_norm.weight", eps)
