"""Qwen 3 MoE (Qwen3-30B-A3B and kin): the qwen3 block with a mixture of experts for its FFN.

As llama.cpp's qwen3moe.cpp builds it: a softmax router (`ffn_gate_inp`) over
`expert_count` experts, the top `expert_used_count`, their weights always renormalised (no
key says so), and SwiGLU experts stored as 3-D tensors `ffn_{gate,up,down}_exps`. An expert's
row count is `expert_feed_forward_length`, else feed_forward_length / expert_used_count.
"""

from __future__ import annotations

import numpy as np

from edgeinfer.models.moe import expert_shapes, softmax_routed_experts, with_experts, without_dense_ffn
from edgeinfer.models.qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    @classmethod
    def adjust_config(cls, cfg, gf):
        return with_experts(super().adjust_config(cfg, gf), gf)

    @classmethod
    def layer_tensors(cls, cfg, i):
        t = without_dense_ffn(super().layer_tensors(cfg, i), i)
        p = f"blk.{i}."
        t[p + "ffn_gate_inp.weight"] = (cfg.n_embd, cfg.n_expert)
        t.update(expert_shapes(cfg, i))
        return t

    def feed_forward(self, i, x):
        be, cfg, p = self.backend, self.config, f"blk.{i}."
        h = be.rms_norm(x, p + "ffn_norm.weight", cfg.norm_eps)
        logits = np.asarray(be.linear(p + "ffn_gate_inp.weight", h), np.float32)
        return x + softmax_routed_experts(be, cfg, i, h, logits)
