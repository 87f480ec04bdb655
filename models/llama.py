"""Llama 2 / 3 / 3.1 / 3.2 and Mistral: pre-norm blocks, RoPE (adjacent pairs), SwiGLU.

Llama 3.1's RoPE scaling arrives precomputed as the `rope_freqs.weight` tensor, which
`Transformer.attention` applies as per-frequency divisors, as llama.cpp does.
"""

from __future__ import annotations

import numpy as np

from edgeinfer.models.base import Transformer
from edgeinfer.rope import ROPE_NORM


class Llama(Transformer):
    ROPE_MODE = ROPE_NORM

    def layer(self, i, x, positions, slots, kv):
        be, cfg, p = self.backend, self.config, f"blk.{i}."
        n = x.shape[0]
        h = be.rms_norm(x, p + "attn_norm.weight", cfg.norm_eps)
        q, k, v = self.project_many([p + "attn_q", p + "attn_k", p + "attn_v"], h)
        q = q.reshape(n, cfg.n_head, cfg.head_dim)
        k = k.reshape(n, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(n, cfg.n_head_kv, cfg.head_dim_v)
        q, k = self.qk_norm(i, q, k)
        attn = self.attention(i, q, k, v, positions, slots, kv)
        x = self.add_attention_output(i, attn, x)
        return self.feed_forward(i, x)

    def add_attention_output(self, i: int, attn: np.ndarray, x: np.ndarray) -> np.ndarray:
        """x + the attention's output projection (gpt-oss adds a bias)."""
        return self.backend.linear_residual(f"blk.{i}.attn_output.weight", attn, x)

    def feed_forward(self, i: int, x: np.ndarray) -> np.ndarray:
        """x + the block's pre-norm SwiGLU feed-forward (mixtures of experts override it)."""
        p = f"blk.{i}."
        return self.backend.norm_swiglu_residual(x, p + "ffn_norm.weight", self.config.norm_eps,
                                                 p + "ffn_gate.weight", p + "ffn_up.weight", p + "ffn_down.weight")

    def project_many(self, names: list[str], h: np.ndarray) -> list[np.ndarray]:
        """Linear layers on the same input, plus their biases when the file has them (qwen2
        has them on q/k/v)."""
        outs = self.backend.linear_many([name + ".weight" for name in names], h)
        for name, out in zip(names, outs):
            if name + ".bias" in self.gguf.tensors:
                out += self.backend.vector(name + ".bias")
        return outs

    def qk_norm(self, i: int, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """No per-head norm in llama; qwen3 overrides."""
        return q, k
