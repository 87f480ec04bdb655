"""Qwen3.5's multi-token-prediction block: one more decoder block after the trunk that
predicts the token after next (llama.cpp's qwen35.cpp, `graph_mtp`).

For a token x at position p and the trunk's final normed hidden state h of position p - 1
(what the output head reads; zeros where there is none):

    cur = eh_proj(concat(rms_norm(embed(x), enorm), rms_norm(h, hnorm)))
    cur = cur + gated_attention(rms_norm(cur, attn_norm))      # its own K/V, positions p
    cur = cur + ffn(rms_norm(cur, post_attention_norm))        # the family's FFN (dense or MoE)
    h'  = rms_norm(cur, shared_head_norm or output_norm)
    logits = shared_head_head or the model's output head (h')

The block is blk.{n_layer}: the file counts it in block_count and says how many there are
in `nextn_predict_layers` (models/qwen35.py reads both). Its logits at position p draft
the token at p + 1; h' chains into the next draft step as the h of position p.

It runs on the trunk family's own building blocks (gated attention, FFN) with a K/V cache
of its own: a contiguous cache whose layer `n_layer` is the block and whose other layers
hold nothing (`mtp_config`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from edgeinfer.errors import UnsupportedModelError

NEXTN_TENSORS = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight")


def mtp_block(model) -> int:
    """The MTP block's index in the file, or a one-line UnsupportedModelError when the model
    has none llama.cpp could run (exactly one, with its nextn tensors)."""
    cfg = model.config
    if cfg.n_layer_nextn == 0:
        raise UnsupportedModelError(f"--draft mtp: this {cfg.arch} model has no multi-token-prediction "
                                    f"layers (Qwen3.5 files with {cfg.arch}.nextn_predict_layers have one)")
    if cfg.n_layer_nextn != 1:
        raise UnsupportedModelError(f"the model has {cfg.n_layer_nextn} multi-token-prediction layers; "
                                    f"--draft mtp runs files with one (as llama.cpp does)")
    il = cfg.n_layer
    missing = [f"blk.{il}.{t}" for t in NEXTN_TENSORS if f"blk.{il}.{t}" not in model.gguf.tensors]
    if missing:
        raise UnsupportedModelError(f"the model's multi-token-prediction block lacks {missing[0]}")
    return il


def mtp_config(config):
    """The config of the MTP block's own K/V cache: layer n_layer is a full-attention layer and
    the trunk's layers hold nothing (they read the block's K/V, config.kv_source, so no rows
    and no recurrent state are kept for them)."""
    il = config.n_layer
    return replace(config, n_layer=il + 1, n_layer_nextn=0, recurrent_layers=(), kv_source_layers=(il,) * (il + 1))


class MtpHead:
    """The MTP block of a loaded qwen35 / qwen35moe model (its backend holds the weights)."""

    def __init__(self, model) -> None:
        self.model = model
        self.il = mtp_block(model)
        self.config = model.config
        self.cache_config = mtp_config(model.config)
        tensors = model.gguf.tensors
        p = f"blk.{self.il}."
        self.embed = p + "nextn.embed_tokens.weight" if p + "nextn.embed_tokens.weight" in tensors \
            else "token_embd.weight"
        self.head_norm = p + "nextn.shared_head_norm.weight" if p + "nextn.shared_head_norm.weight" in tensors \
            else "output_norm.weight"
        if p + "nextn.shared_head_head.weight" in tensors:
            self.head = p + "nextn.shared_head_head.weight"
        else:
            self.head = "token_embd.weight" if self.config.tied_embeddings else "output.weight"

    def new_cache(self, n_ctx: int):
        """A K/V cache for the block alone."""
        from edgeinfer.kv.contiguous import KVCache

        return KVCache(self.cache_config, n_ctx)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, h_prev: np.ndarray, kv,
                logits_for: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(logits of rows logits_for (default: the last), h' of every row) for tokens at
        positions, each with the trunk's h of the position before it; appends to kv."""
        m, be, cfg = self.model, self.model.backend, self.config
        p, eps, il = f"blk.{self.il}.", cfg.norm_eps, self.il
        tokens = np.asarray(tokens, np.int64)
        positions = np.asarray(positions, np.int64)
        if logits_for is None:
            logits_for = np.array([len(tokens) - 1])
        e = be.rms_norm(be.get_rows(self.embed, tokens), p + "nextn.enorm.weight", eps)
        h = be.rms_norm(np.ascontiguousarray(h_prev, np.float32), p + "nextn.hnorm.weight", eps)
        x = be.linear(p + "nextn.eh_proj.weight", np.concatenate([np.asarray(e), np.asarray(h)], axis=1))
        slots = kv.append(positions)
        a = be.rms_norm(x, p + "attn_norm.weight", eps)
        x = x + m.gated_attention(il, a, positions, slots, kv)
        x = m.feed_forward(il, x)
        h_out = np.asarray(be.rms_norm(x, self.head_norm, eps))
        if len(logits_for) == 0:  # catching up: only the K/V matter
            return np.zeros((0, cfg.n_vocab), np.float32), h_out
        return np.asarray(be.linear(self.head, h_out[logits_for])), h_out
