"""Qwen 3: the llama block with RMSNorm on each head of q and k (before RoPE), no biases."""

from __future__ import annotations

from edgeinfer.models.llama import Llama
from edgeinfer.rope import ROPE_NEOX


class Qwen3(Llama):
    ROPE_MODE = ROPE_NEOX
    DEFAULT_NORM_EPS = 1e-6
    DEFAULT_ROPE_BASE = 1_000_000.0

    @classmethod
    def layer_tensors(cls, cfg, i):
        t = super().layer_tensors(cfg, i)
        t[f"blk.{i}.attn_q_norm.weight"] = (cfg.head_dim,)
        t[f"blk.{i}.attn_k_norm.weight"] = (cfg.head_dim,)
        return t

    def qk_norm(self, i, q, k):
        be, eps, p = self.backend, self.config.norm_eps, f"blk.{i}."
        return be.rms_norm(q, p + "attn_q_norm.weight", eps), be.rms_norm(k, p + "attn_k_norm.weight", eps)
