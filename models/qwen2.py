"""Qwen 2 / 2.5: the llama block with biases on q/k/v and NeoX-style RoPE (rotate halves)."""

from __future__ import annotations

from edgeinfer.models.llama import Llama
from edgeinfer.rope import ROPE_NEOX


class Qwen2(Llama):
    ROPE_MODE = ROPE_NEOX
    DEFAULT_NORM_EPS = 1e-6
    DEFAULT_ROPE_BASE = 1_000_000.0

    @classmethod
    def layer_tensors(cls, cfg, i):
        t = super().layer_tensors(cfg, i)
        p = f"blk.{i}."
        t[p + "attn_q.bias"] = (cfg.q_dim,)
        t[p + "attn_k.bias"] = (cfg.kv_dim,)
        t[p + "attn_v.bias"] = (cfg.n_head_kv * cfg.head_dim_v,)
        return t
