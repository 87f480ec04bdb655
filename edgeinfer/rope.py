"""RoPE's modes and the per-layer arguments every backend's `rope` takes (models and backends share them)."""

from __future__ import annotations

from typing import NamedTuple

ROPE_NORM = "norm"  # rotate adjacent pairs (x0, x1), (x2, x3): llama
ROPE_NEOX = "neox"  # rotate halves (x0, x_{d/2}): qwen2, qwen3, gemma3


class RopeArgs(NamedTuple):
    """`Backend.rope(x, positions, *args)` after x and positions, for one layer."""

    n_dims: int
    base: float
    freq_scale: float
    mode: str
    freq_factors: str | None  # the GGUF tensor of per-frequency factors, if the file has one
