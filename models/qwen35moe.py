"""Qwen 3.5 / 3.6 MoE (35B-A3B and kin): the qwen35 block with a mixture of experts and a
gated shared expert for its FFN, as llama.cpp's src/models/qwen35moe.cpp builds it.

The router is qwen3moe's (softmax over `expert_count`, top `expert_used_count`, weights
renormalised; edgeinfer.experts). Beside it a shared SwiGLU expert (`ffn_*_shexp`, of
`expert_shared_feed_forward_length` rows, else feed_forward_length) whose output is scaled
by sigmoid(ffn_gate_inp_shexp . h), one gate value per token. The file has no
feed_forward_length: an expert's row count is `expert_feed_forward_length`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from edgeinfer.metadata import MAX_FF, meta_int
from edgeinfer.models.moe import expert_shapes, softmax_routed_experts, with_experts
from edgeinfer.models.qwen35 import Qwen35


class Qwen35Moe(Qwen35):
    DEFAULT_FF = 0  # absent from the files

    @classmethod
    def adjust_config(cls, cfg, gf):
        cfg = with_experts(super().adjust_config(cfg, gf), gf)
        n_shexp = meta_int(gf.metadata, f"{cfg.arch}.expert_shared_feed_forward_length", 1, MAX_FF, cfg.n_ff)
        return replace(cfg, extra={**cfg.extra, "n_ff_shexp": n_shexp})

    @classmethod
    def ffn_tensors(cls, cfg, i):
        p, e, n_sh = f"blk.{i}.", cfg.n_embd, cfg.extra["n_ff_shexp"]
        return {
            p + "ffn_gate_inp.weight": (e, cfg.n_expert),
            **expert_shapes(cfg, i),
            p + "ffn_gate_inp_shexp.weight": (e,),
            p + "ffn_gate_shexp.weight": (e, n_sh),
            p + "ffn_up_shexp.weight": (e, n_sh),
            p + "ffn_down_shexp.weight": (n_sh, e),
        }

    def feed_forward(self, i, x):
        be, cfg, p = self.backend, self.config, f"blk.{i}."
        h = be.rms_norm(x, p + "post_attention_norm.weight", cfg.norm_eps)
        logits = np.asarray(be.linear(p + "ffn_gate_inp.weight", h), np.float32)
        moe = softmax_routed_experts(be, cfg, i, h, logits)
        g, u = be.linear_many([p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"], h)
        shared = be.linear(p + "ffn_down_shexp.weight", be.silu_mul(g, u))
        gate = self.dn.sigmoid_mul(np.ones((h.shape[0], 1), np.float32), self.shared_gate_logits(i, h))
        # the gate is a per-token scalar from the host: on an offloaded layer the sum is formed
        # there too (np.asarray downloads; a host array passes through)
        return x + (np.asarray(moe) + np.asarray(shared) * gate).astype(np.float32)

    def shared_gate_logits(self, i: int, h: np.ndarray) -> np.ndarray:
        """ffn_gate_inp_shexp (a vector) . h per token, as ggml's F32 mul_mat sums it: (n, 1)."""
        return np.asarray(self.backend.linear(f"blk.{i}.ffn_gate_inp_shexp.weight", h), np.float32).reshape(-1, 1)
