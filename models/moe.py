"""What every mixture-of-experts family reads from its file: how many experts, how many a
token uses, and an expert's row count."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from edgeinfer.errors import MetadataError
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
