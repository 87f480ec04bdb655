"""BERT encoders (all-MiniLM, mxbai-embed-large, bge): post-norm blocks with biased LayerNorm,
learned absolute positions, non-causal attention, GELU feed-forward. They embed, never generate.

The graph is llama.cpp's `llm_build_bert`: token + token-type row 0 + position embeddings,
LayerNorm; per block attention (fused `attn_qkv` or separate q/k/v, with biases), residual,
LayerNorm, FFN, residual, LayerNorm. Several sequences run in one pass: the matrices see all
their tokens together, attention stays within each sequence.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from edgeinfer.errors import EdgeInferError
from edgeinfer.metadata import meta_bool, meta_float, meta_str_array
from edgeinfer.models.base import Transformer


class Bert(Transformer):
    GENERATES = False
    POSITION_EMBEDDINGS = True  # learned absolute positions; nomic-bert ropes instead
    DEFAULT_NORM_EPS = 1e-12

    @classmethod
    def adjust_config(cls, cfg, gf):
        md, arch = gf.metadata, cfg.arch
        eps = meta_float(md, f"{arch}.attention.layer_norm_epsilon", 0.0, 1.0, cls.DEFAULT_NORM_EPS)
        fused = f"blk.0.attn_qkv.weight" in gf.tensors
        causal = meta_bool(md, f"{arch}.attention.causal", False)
        if causal:
            raise EdgeInferError(f"{gf.path}: causal {arch} encoders are not supported")
        types = gf.tensors.get("token_types.weight")
        n_types = types.shape[1] if types is not None and len(types.shape) == 2 else 0
        labels = meta_str_array(md, f"{arch}.classifier.output_labels", None)  # llama.cpp's n_cls_out
        n_cls_out = len(labels) if labels else 1
        return replace(cfg, norm_eps=eps, tied_embeddings=True,
                       extra={**cfg.extra, "fused_qkv": fused, "n_token_types": n_types, "n_cls_out": n_cls_out})

    @classmethod
    def global_tensors(cls, cfg):
        t = {"token_embd.weight": (cfg.n_embd, cfg.n_vocab),
             "token_embd_norm.weight": (cfg.n_embd,), "token_embd_norm.bias": (cfg.n_embd,)}
        if cls.POSITION_EMBEDDINGS:
            t["position_embd.weight"] = (cfg.n_embd, cfg.n_ctx_train)
        return t

    @classmethod
    def layer_tensors(cls, cfg, i):
        p, e = f"blk.{i}.", cfg.n_embd
        if cfg.extra.get("fused_qkv"):
            t = {p + "attn_qkv.weight": (e, cfg.q_dim + 2 * cfg.kv_dim)}
        else:
            t = {p + f"attn_{x}.{kind}": shape for x, dim in (("q", cfg.q_dim), ("k", cfg.kv_dim), ("v", cfg.kv_dim))
                 for kind, shape in (("weight", (e, dim)), ("bias", (dim,)))}
        t.update({
            p + "attn_output.weight": (cfg.q_dim, e),
            p + "attn_output_norm.weight": (e,), p + "attn_output_norm.bias": (e,),
            p + "ffn_up.weight": (e, cfg.n_ff), p + "ffn_down.weight": (cfg.n_ff, e),
            p + "layer_output_norm.weight": (e,), p + "layer_output_norm.bias": (e,),
        })
        return t

    @classmethod
    def optional_tensors(cls, cfg):
        e, n_out = cfg.n_embd, cfg.extra.get("n_cls_out", 1)
        t = {"token_types.weight": (e, cfg.extra.get("n_token_types", 0)),
             # a cross-encoder's classification head (rerankers: pooling type rank)
             "cls.weight": (e, e), "cls.bias": (e,), "cls.output.weight": (e, n_out), "cls.output.bias": (n_out,)}
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            t.update({p + "attn_qkv.bias": (cfg.q_dim + 2 * cfg.kv_dim,), p + "attn_output.bias": (cfg.n_embd,),
                      p + "ffn_up.bias": (cfg.n_ff,), p + "ffn_down.bias": (cfg.n_embd,)})
        return t

    def max_tokens(self, n_ctx: int) -> int:
        """The longest input: the context, and the learned positions the file has."""
        return min(n_ctx, self.config.n_ctx_train) if self.POSITION_EMBEDDINGS else n_ctx

    def forward(self, tokens, positions, kv, logits_for=None):
        raise EdgeInferError(f"{self.config.arch} is an embedding model: it cannot generate text "
                             f"(use embeddings: Model.embed, /api/embed, /v1/embeddings)")

    # -- encoding -------------------------------------------------------------------------
    def encode(self, tokens: np.ndarray, seq_lens: list[int]) -> np.ndarray:
        """Hidden states (n_tokens, n_embd) of the sequences laid end to end in `tokens`."""
        cfg, be = self.config, self.backend
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in seq_lens])
        x = be.get_rows("token_embd.weight", tokens)
        if "token_types.weight" in self.gguf.tensors:  # every token is "sentence A", as llama.cpp
            x = x + be.get_rows("token_types.weight", np.zeros(1, np.int64))[0]
        if self.POSITION_EMBEDDINGS:
            x = be.get_rows("position_embd.weight", positions) + x
        x = be.layer_norm(x, "token_embd_norm.weight", "token_embd_norm.bias", cfg.norm_eps)
        for i in range(cfg.n_layer):
            be.at_layer(i)
            x = self.encoder_layer(i, x, positions, seq_lens)
        be.at_layer(None)
        return x

    def classify(self, pooled: np.ndarray) -> np.ndarray:
        """llama.cpp's rank pooling after the [CLS] row: `cls` + bias, tanh, then `cls.output`
        + bias, each where the file has it; (n, n_embd) -> (n, n_cls_out)."""
        x = np.atleast_2d(np.asarray(pooled, np.float32))
        if "cls.weight" in self.gguf.tensors:
            x = np.tanh(self.project("cls", x)).astype(np.float32)
        if "cls.output.weight" in self.gguf.tensors:
            x = self.project("cls.output", x)
        return x

    def encoder_layer(self, i: int, x: np.ndarray, positions: np.ndarray, seq_lens: list[int]) -> np.ndarray:
        cfg, be, p = self.config, self.backend, f"blk.{i}."
        n = x.shape[0]
        if cfg.extra.get("fused_qkv"):
            qkv = self.project(p + "attn_qkv", x)
            q, k, v = np.split(qkv, [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=1)
        else:
            q, k, v = (self.project(p + f"attn_{x_}", x) for x_ in "qkv")
        q = q.reshape(n, cfg.n_head, cfg.head_dim)
        k = k.reshape(n, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(n, cfg.n_head_kv, cfg.head_dim_v)
        q, k = self.position_qk(i, q, k, positions)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        parts, start = [], 0
        for length in seq_lens:  # attention never crosses sequences
            s = slice(start, start + length)
            parts.append(be.attention_full(q[s], k[s], v[s], scale))
            start += length
        attn = np.concatenate(parts).reshape(n, -1)
        cur = self.project(p + "attn_output", attn) + x
        cur = be.layer_norm(cur, p + "attn_output_norm.weight", p + "attn_output_norm.bias", cfg.norm_eps)
        cur = self.ffn(i, cur) + cur
        return be.layer_norm(cur, p + "layer_output_norm.weight", p + "layer_output_norm.bias", cfg.norm_eps)

    def position_qk(self, i, q, k, positions):
        """BERT's positions are in the embeddings already."""
        return q, k

    def ffn(self, i: int, x: np.ndarray) -> np.ndarray:
        p = f"blk.{i}."
        return self.project(p + "ffn_down", self.backend.gelu(self.project(p + "ffn_up", x)))

    def project(self, name: str, x: np.ndarray) -> np.ndarray:
        """A linear layer plus its bias when the file has one."""
        out = self.backend.linear(name + ".weight", x)
        if name + ".bias" in self.gguf.tensors:
            out = out + self.backend.vector(name + ".bias")
        return out
