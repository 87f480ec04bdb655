"""Llama 2 / 3 / 3.1 / 3.2 and Mistral: pre-norm blocks, RoPE (adjacent pairs), SwiGLU.

Llama 3.1's RoPE scaling arrives precomputed as the `rope_freqs.weight` tensor, which
`Transformer.attention` applies as per-frequency divisors, as llama.cpp does.
"""

from __future__ import annotations

import numpy as np

from edgeinfer.models.base import ROPE_NORM, Transformer


class Llama(Transformer):
    ROPE_MODE = ROPE_NORM

    def layer(self, i, x, positions, slots, kv):
        be, cfg, p = self.backend, self.config, f"blk.{i}."
        n = x.shape[0]
        h = be.rms_norm(x, p + "attn_norm.weight", cfg.norm_eps)
        q = self.project(p + "attn_q", h).reshape(n, cfg.n_head, cfg.head_dim)
        k = self.project(p + "attn_k", h).reshape(n, cfg.n_head_kv, cfg.head_dim)
        v = self.project(p + "attn_v", h).reshape(n, cfg.n_head_kv, cfg.head_dim_v)
        q, k = self.qk_norm(i, q, k)
        attn = self.attention(i, q, k, v, positions, slots, kv)
        x = x + be.linear(p + "attn_output.weight", attn)
        h = be.rms_norm(x, p + "ffn_norm.weight", cfg.norm_eps)
        return x + self.swiglu_ffn(i, h)

    def project(self, name: str, h: np.ndarray) -> np.ndarray:
        """Linear layer plus its bias when the file has one (qwen2 has them on q/k/v)."""
        out = self.backend.linear(name + ".weight", h)
        if name + ".bias" in self.gguf.tensors:
            out += self.backend.vector(name + ".bias")
        return out

    def qk_norm(self, i: int, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """No per-head norm in llama; qwen3 overrides."""
        return q, k
