"""What every mixture-of-experts family shares: how many experts, how many a token uses and
an expert's row count (from the file), the names and shapes of a layer's 3-D expert tensors,
and the softmax-routed expert FFN most families run on them."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from edgeinfer.errors import MetadataError
from edgeinfer.experts import ffn, routing
from edgeinfer.metadata import MAX_EXPERTS, MAX_FF, meta_int
from edgeinfer.models.config import ModelConfig

if TYPE_CHECKING:
    from edgeinfer.gguf_file import GGUFFile


def with_experts(cfg: ModelConfig, gf: "GGUFFile") -> ModelConfig:
    """cfg with n_expert, n_expert_used and n_ff_exp from `{arch}.expert_*` keys. An expert's
    row count is `expert_feed_forward_length`, else feed_forward_length / expert_used_count."""
    md, key = gf.metadata, f"{cfg.arch}."
    n_expert = meta_int(md, key + "expert_count", 1, MAX_EXPERTS)
    n_used = meta_int(md, key + "expert_used_count", 1, n_expert)
    n_ff_exp = meta_int(md, key + "expert_feed_forward_length", 1, MAX_FF, cfg.n_ff // n_used)
    if n_ff_exp < 1:
        raise MetadataError(f"{gf.path}: metadata key {key + 'expert_feed_forward_length'!r} is missing and "
                            f"feed_forward_length / expert_used_count is 0")
    return replace(cfg, n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp)


def without_dense_ffn(tensors: dict, i: int) -> dict:
    """A dense block's tensor table for layer i with its FFN matrices taken out (the experts
    stand in their place); returns the same dict."""
    for part in ("gate", "up", "down"):
        del tensors[f"blk.{i}.ffn_{part}.weight"]
    return tensors


def expert_names(i: int, kind: str = "weight") -> list[str]:
    """Layer i's gate, up and down expert tensors (`kind`: "weight", or "bias" for gpt-oss's)."""
    return [f"blk.{i}.ffn_{part}_exps.{kind}" for part in ("gate", "up", "down")]


def expert_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """GGML shapes of layer i's gate, up and down expert matrices: (columns, rows, experts)."""
    gate, up, down = expert_names(i)
    ff, e = cfg.n_ff_exp, cfg.n_expert
    return {gate: (cfg.n_embd, ff, e), up: (cfg.n_embd, ff, e), down: (ff, cfg.n_embd, e)}


def softmax_routed_experts(backend, cfg: ModelConfig, i: int, h, logits, **kwargs):
    """Layer i's experts on h as llama.cpp's softmax gating picks them: softmax over all
    experts, the top `expert_used_count`, their weights renormalised (no key says so);
    `kwargs` go to edgeinfer.experts.ffn.swiglu_experts (activation, down_scale)."""
    experts, weights = routing.softmax_topk(logits, cfg.n_expert_used, normalize=True)
    return ffn.swiglu_experts(backend, h, experts, weights, *expert_names(i), **kwargs)
