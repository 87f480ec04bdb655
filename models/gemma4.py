"""Gemma 4 (E2B, E4B, 12B, 26B-A4B, 31B): Gemma 3's block with per-layer embeddings,
shared K/V layers, two head sizes, per-layer K/V head counts and a mixture of experts, as
llama.cpp's src/models/gemma4.cpp builds it.

- Which layers slide: the `attention.sliding_window_pattern` array (one bool a layer, no
  period); sliding layers have their own head size (`attention.key_length_swa`), rotated
  dims (`rope.dimension_count_swa`, else the global layers') and RoPE base
  (`rope.freq_base_swa`, 10k); global layers rope with `rope_freqs` (proportional RoPE).
- K/V heads: `attention.head_count_kv` may be one per layer (12B, 26B-A4B, 31B: fewer on
  the global layers, config.n_head_kv_of); every cache sizes each layer's rows by its own.
- Attention: Q and K RMS-normed per head with weights, V RMS-normed without one; a layer
  without `attn_v` uses V = K (before K's norm); the attention scale is 1.0 and Q is not
  pre-scaled. The last `attention.shared_kv_layers` layers compute only Q and attend over
  the K/V of layer n_kv - 2 (sliding) or n_kv - 1 (global), n_kv = n_layer - shared
  (llama.cpp's `reuse` in llama-model.cpp): they store nothing (config.kv_source).
- Per-layer embeddings (`embedding_length_per_layer_input` > 0): rows of
  `per_layer_token_embd` (read only for the batch's tokens) * sqrt(n_epl), plus
  rms_norm(per_layer_model_proj(x) / sqrt(n_embd)), times 1/sqrt(2); after each block's FFN,
  x + post_norm(proj(gelu(inp_gate(x)) * that layer's slice)).
- FFN: GELU-gated; in a MoE layer (it has `ffn_gate_inp`) the dense MLP is the shared
  expert (post_ffw_norm_1) beside the experts (pre_ffw_norm_2 ... post_ffw_norm_2), whose
  router reads rms_norm(attn_out) / sqrt(n_embd) * ffn_gate_inp.scale; softmax, top k,
  weights renormalised, an optional per-expert `ffn_down_exps.scale`.
- `layer_output_scale` multiplies the block's output; the logits are soft-capped by
  `final_logit_softcapping` (cap * tanh(l / cap)).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from edgeinfer.backends.base import unit_weight
from edgeinfer.errors import MetadataError, UnsupportedModelError
from edgeinfer.metadata import MAX_CTX, MAX_EMBD, MAX_HEAD_DIM, MAX_ROPE_BASE, meta_float, meta_int
from edgeinfer.models.base import Transformer
from edgeinfer.models.moe import expert_shapes, softmax_routed_experts, with_experts
from edgeinfer.rope import ROPE_NEOX

ROPE_BASE_SWA = 10_000.0  # llama.cpp's rope_freq_base_train_swa when the file has none
FINAL_LOGIT_SOFTCAP = 30.0  # llama.cpp's f_final_logit_softcapping when the file has none (0 turns it off)


class Gemma4(Transformer):
    ROPE_MODE = ROPE_NEOX
    DEFAULT_NORM_EPS = 1e-6
    PER_LAYER_FF = True
    PER_LAYER_KV_HEADS = True  # 26B-A4B, 31B: fewer K/V heads on the global layers

    # -- config -----------------------------------------------------------------------------------
    @classmethod
    def adjust_config(cls, cfg, gf):
        md, path, n = gf.metadata, gf.path, cfg.n_layer

        def key(name: str) -> str:
            return f"{cfg.arch}.{name}"

        swa = _swa_pattern(gf, key("attention.sliding_window_pattern"), n)
        window = meta_int(md, key("attention.sliding_window"), 1, MAX_CTX)
        shared = meta_int(md, key("attention.shared_kv_layers"), 0, n, 0)
        n_kv = n - shared
        sources = list(range(n))
        if shared:
            if n_kv < 2:
                raise MetadataError(f"{path}: metadata key {key('attention.shared_kv_layers')!r} is {shared}: "
                                    f"at least 2 of the {n} layers must keep K/V")
            for i in range(n_kv, n):
                sources[i] = n_kv - (2 if swa[i] else 1)
                if swa[sources[i]] != swa[i]:
                    raise MetadataError(f"{path}: layer {i} would share the K/V of layer {sources[i]}, which "
                                        f"is {'not ' if swa[i] else ''}a sliding-window layer")
        hd_swa = meta_int(md, key("attention.key_length_swa"), 1, MAX_HEAD_DIM)
        hdv_swa = meta_int(md, key("attention.value_length_swa"), 1, MAX_HEAD_DIM)
        if cfg.head_dim != cfg.head_dim_v or hd_swa != hdv_swa:
            raise UnsupportedModelError(f"{path}: Gemma 4 needs key and value heads of one size "
                                        f"({cfg.head_dim}/{cfg.head_dim_v}, sliding {hd_swa}/{hdv_swa})")
        rope_swa = meta_int(md, key("rope.dimension_count_swa"), 1, MAX_HEAD_DIM, cfg.rope_dims)
        if rope_swa % 2 or rope_swa > hd_swa:
            raise MetadataError(f"{path}: metadata key {key('rope.dimension_count_swa')!r} is {rope_swa}: "
                                f"it must be even and at most the sliding head size {hd_swa}")
        base_swa = meta_float(md, key("rope.freq_base_swa"), 0.0, MAX_ROPE_BASE, ROPE_BASE_SWA, lo_exclusive=True)
        n_epl = meta_int(md, key("embedding_length_per_layer_input"), 0, MAX_EMBD, 0)
        softcap = meta_float(md, key("final_logit_softcapping"), 0.0, 1e6, FINAL_LOGIT_SOFTCAP)
        moe_layers = tuple(f"blk.{i}.ffn_gate_inp.weight" in gf.tensors for i in range(n))
        cfg = replace(cfg, sliding_window=window, swa_layers=swa, rope_base_swa=base_swa, attn_scale=1.0,
                      embed_scale=math.sqrt(cfg.n_embd), head_dim_swa=hd_swa, head_dim_v_swa=hdv_swa,
                      rope_dims_swa=rope_swa, kv_source_layers=tuple(sources) if shared else (),
                      extra={**cfg.extra, "n_embd_per_layer": n_epl, "final_logit_softcapping": softcap,
                             "moe_layers": moe_layers})
        if any(moe_layers):
            cfg = with_experts(cfg, gf)
        return cfg

    @classmethod
    def global_tensors(cls, cfg):
        t = super().global_tensors(cfg)
        n_epl = cfg.extra["n_embd_per_layer"]
        if n_epl:
            t["per_layer_token_embd.weight"] = (n_epl * cfg.n_layer, cfg.n_vocab)
            t["per_layer_model_proj.weight"] = (cfg.n_embd, n_epl * cfg.n_layer)
            t["per_layer_proj_norm.weight"] = (n_epl,)
        if not all(cfg.swa_layers):  # the global layers' proportional RoPE (required, as in llama.cpp)
            t["rope_freqs.weight"] = (cfg.head_dim // 2,)
        return t

    @classmethod
    def layer_tensors(cls, cfg, i):
        p, e, hd, ff = f"blk.{i}.", cfg.n_embd, cfg.head_dim_of(i), cfg.n_ff_of(i)
        kv = cfg.n_head_kv_of(i) * hd
        t = {
            p + "attn_norm.weight": (e,),
            p + "attn_q.weight": (e, cfg.n_head * hd),
            p + "attn_q_norm.weight": (hd,),
            p + "attn_output.weight": (cfg.n_head * hd, e),
            p + "post_attention_norm.weight": (e,),
            p + "ffn_norm.weight": (e,),
            p + "ffn_gate.weight": (e, ff),
            p + "ffn_up.weight": (e, ff),
            p + "ffn_down.weight": (ff, e),
            p + "post_ffw_norm.weight": (e,),
        }
        if cfg.owns_kv(i):
            t[p + "attn_k.weight"] = (e, kv)
            t[p + "attn_k_norm.weight"] = (hd,)
        if cfg.extra["moe_layers"][i]:
            t.update({
                p + "ffn_gate_inp.weight": (e, cfg.n_expert),
                p + "ffn_gate_inp.scale": (e,),
                p + "pre_ffw_norm_2.weight": (e,),
                p + "post_ffw_norm_1.weight": (e,),
                p + "post_ffw_norm_2.weight": (e,),
                **expert_shapes(cfg, i),
            })
        n_epl = cfg.extra["n_embd_per_layer"]
        if n_epl:
            t.update({p + "inp_gate.weight": (e, n_epl), p + "proj.weight": (n_epl, e),
                      p + "post_norm.weight": (e,)})
        return t

    @classmethod
    def optional_tensors(cls, cfg):
        t = {}
        for i in range(cfg.n_layer):
            p, kv = f"blk.{i}.", cfg.n_head_kv_of(i) * cfg.head_dim_of(i)
            t[p + "attn_v.weight"] = (cfg.n_embd, kv)  # absent: V = K
            t[p + "layer_output_scale.weight"] = (1,)
            if cfg.n_expert:
                t[p + "ffn_down_exps.scale"] = (cfg.n_expert,)
            if not cfg.owns_kv(i):  # a shared layer's own K may be in the file; it is never used
                t[p + "attn_k.weight"] = (cfg.n_embd, kv)
        return t

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, tokens, positions, kv, logits_for=None):
        logits = super().forward(tokens, positions, kv, logits_for)
        cap = self.config.extra["final_logit_softcapping"]
        if cap:  # ggml: scale by 1/cap, tanh, scale by cap, each in float32
            c = np.float32(cap)
            logits = np.tanh(np.asarray(logits, np.float32) * (np.float32(1.0) / c)) * c
        return logits

    def hidden(self, tokens, positions, kv, rows):
        cfg, be = self.config, self.backend
        tokens = np.asarray(tokens)
        step = self.media_step  # image rows: unscaled, and per-layer rows of token 0 (llama.cpp's padding)
        ids = tokens if step is None else step.token_ids(tokens)
        x = be.get_rows("token_embd.weight", ids)
        x *= np.float32(cfg.embed_scale)
        if step is not None:
            x = step.place(x)
        per_layer = self.per_layer_inputs(ids, x) if cfg.extra["n_embd_per_layer"] else None
        slots = kv.append(positions)
        for i in range(cfg.n_layer):
            be.at_layer(i)
            x = self.block(i, x, positions, slots, kv, per_layer)
        be.at_layer(None)
        return be.rms_norm(x[rows], "output_norm.weight", cfg.norm_eps)

    def per_layer_inputs(self, tokens: np.ndarray, x: np.ndarray) -> np.ndarray:
        """(n, n_layer, n_epl): each layer's input from the per-layer embedding table (only the
        batch's rows are read from the file) and the projection of the scaled embeddings."""
        cfg, be = self.config, self.backend
        n, n_epl = len(tokens), cfg.extra["n_embd_per_layer"]
        rows = be.get_rows("per_layer_token_embd.weight", tokens).reshape(n, cfg.n_layer, n_epl)
        rows = rows * np.float32(math.sqrt(n_epl))
        proj = np.asarray(be.linear("per_layer_model_proj.weight", x), np.float32)
        proj = proj * (np.float32(1.0) / np.float32(math.sqrt(cfg.n_embd)))
        proj = be.rms_norm(proj.reshape(n, cfg.n_layer, n_epl), "per_layer_proj_norm.weight", cfg.norm_eps)
        return ((proj + rows) * (np.float32(1.0) / np.float32(math.sqrt(2.0)))).astype(np.float32)

    def layer(self, i, x, positions, slots, kv):
        return self.block(i, x, positions, slots, kv, None)

    def block(self, i, x, positions, slots, kv, per_layer):
        be, cfg, p = self.backend, self.config, f"blk.{i}."
        eps = cfg.norm_eps
        h = be.rms_norm(x, p + "attn_norm.weight", eps)
        attn = be.linear(p + "attn_output.weight", self.self_attention(i, h, positions, slots, kv))
        attn_out = x + be.rms_norm(attn, p + "post_attention_norm.weight", eps)
        if cfg.extra["moe_layers"][i]:
            out = self.moe_ffn(i, attn_out)
        else:
            out = self.mlp(i, be.rms_norm(attn_out, p + "ffn_norm.weight", eps))
        out = be.rms_norm(out, p + "post_ffw_norm.weight", eps) + attn_out
        if per_layer is not None:
            g = be.gelu(be.linear(p + "inp_gate.weight", out)) * per_layer[:, i, :]
            out = out + be.rms_norm(be.linear(p + "proj.weight", g), p + "post_norm.weight", eps)
        scale = p + "layer_output_scale.weight"
        if scale in self.gguf.tensors:
            out = out * be.vector(scale)[0]
        return out

    def self_attention(self, i, h, positions, slots, kv):
        """Q of layer i over its K/V (or the K/V of the layer it shares): (n, n_head * hd)."""
        be, cfg, p = self.backend, self.config, f"blk.{i}."
        n, hd, eps = h.shape[0], cfg.head_dim_of(i), cfg.norm_eps
        rope = self.rope_args(i)
        owns = cfg.owns_kv(i)
        has_v = owns and p + "attn_v.weight" in self.gguf.tensors
        names = [p + "attn_q.weight"] + ([p + "attn_k.weight"] if owns else []) + ([p + "attn_v.weight"] if has_v else [])
        outs = be.linear_many(names, h) if len(names) > 1 else [be.linear(names[0], h)]
        q = be.rms_norm(outs[0].reshape(n, cfg.n_head, hd), p + "attn_q_norm.weight", eps)
        q = be.rope(q, positions, *rope)
        if owns:
            n_kv = cfg.n_head_kv_of(i)  # the attention groups Q heads by the K/V's own head count
            k = outs[1].reshape(n, n_kv, hd)
            v = (outs[2] if has_v else outs[1]).reshape(n, n_kv, hd)  # no attn_v: V = K
            k = be.rope(be.rms_norm(k, p + "attn_k_norm.weight", eps), positions, *rope)
            v = be.rms_norm(v, unit_weight(hd), eps)  # V is RMS-normed without a weight
            kv.store(i, slots, k, v)
        window = cfg.sliding_window if cfg.is_swa(i) else 0
        out = self.attend(q, kv, cfg.kv_source(i), positions, 1.0, window)
        return out.reshape(n, -1)

    def mlp(self, i, h):
        be, p = self.backend, f"blk.{i}."
        gate, up = be.linear_many([p + "ffn_gate.weight", p + "ffn_up.weight"], h)
        return be.linear(p + "ffn_down.weight", be.gelu_mul(gate, up))

    def moe_ffn(self, i, attn_out):
        """The shared MLP plus the experts, each with its own norms (their sum, before post_ffw_norm)."""
        be, cfg, p = self.backend, self.config, f"blk.{i}."
        eps = cfg.norm_eps
        shared = be.rms_norm(self.mlp(i, be.rms_norm(attn_out, p + "ffn_norm.weight", eps)),
                             p + "post_ffw_norm_1.weight", eps)
        h = be.rms_norm(attn_out, p + "pre_ffw_norm_2.weight", eps)
        r = be.rms_norm(attn_out, unit_weight(cfg.n_embd), eps)
        r = r * (np.float32(1.0) / np.float32(math.sqrt(cfg.n_embd)))
        r = r * be.vector(p + "ffn_gate_inp.scale")
        logits = np.asarray(be.linear(p + "ffn_gate_inp.weight", r), np.float32)
        scale = p + "ffn_down_exps.scale"
        moe = softmax_routed_experts(be, cfg, i, h, logits, activation=be.gelu_mul,
                                     down_scale=scale if scale in self.gguf.tensors else None)
        return shared + be.rms_norm(moe, p + "post_ffw_norm_2.weight", eps)

    def rope_args(self, i):
        """Sliding layers: their rotated dims and base, no factors; global layers: rope_freqs."""
        args = super().rope_args(i)
        if self.config.is_swa(i):
            return args._replace(n_dims=self.config.rope_dims_of(i), freq_factors=None)
        return args


def _swa_pattern(gf, key: str, n_layer: int) -> tuple[bool, ...]:
    """The per-layer sliding-window flags (an array of n_layer bools; llama.cpp requires it)."""
    value = gf.metadata.get(key)
    if value is None:
        raise MetadataError(f"{gf.path}: metadata key {key!r} is missing (one bool per layer)")
    if isinstance(value, (bool, np.bool_, int, np.integer, str, bytes)) or len(value) != n_layer \
            or not all(isinstance(f, (bool, np.bool_)) or f in (0, 1) for f in value):
        raise MetadataError(f"{gf.path}: metadata key {key!r} must hold {n_layer} booleans, one a layer")
    return tuple(bool(f) for f in value)
