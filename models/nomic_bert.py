"""nomic-bert (nomic-embed-text): the BERT block with RoPE (NeoX pairs) instead of learned
positions, a fused `attn_qkv`, and a SwiGLU feed-forward without biases."""

from __future__ import annotations

from edgeinfer.models.bert import Bert
from edgeinfer.rope import ROPE_NEOX


class NomicBert(Bert):
    POSITION_EMBEDDINGS = False
    ROPE_MODE = ROPE_NEOX

    @classmethod
    def layer_tensors(cls, cfg, i):
        t = super().layer_tensors(cfg, i)
        t[f"blk.{i}.ffn_gate.weight"] = (cfg.n_embd, cfg.n_ff)
        return t

    def position_qk(self, i, q, k, positions):
        rope = self.rope_args(i)
        return self.backend.rope(q, positions, *rope), self.backend.rope(k, positions, *rope)

    def ffn(self, i, x):
        be, p = self.backend, f"blk.{i}."
        gate, up = be.linear_many([p + "ffn_gate.weight", p + "ffn_up.weight"], x)
        return self.project(p + "ffn_down", be.silu_mul(gate, up))
