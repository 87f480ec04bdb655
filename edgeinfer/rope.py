"""RoPE's modes and the per-layer arguments every backend's `rope` takes (models and backends share them)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

ROPE_NORM = "norm"  # rotate adjacent pairs (x0, x1), (x2, x3): llama
ROPE_NEOX = "neox"  # rotate halves (x0, x_{d/2}): qwen2, qwen3, gemma3

YARN_BETA_FAST = 32.0  # llama.cpp's defaults; no GGUF key sets them
YARN_BETA_SLOW = 1.0


class Yarn(NamedTuple):
    """YaRN's extension of RoPE as ggml's rope_yarn applies it to one layer's angles.

    Pair i's angle mixes the interpolated (freq_scale * theta) and the original theta by
    ramp(i) * ext_factor, where ramp falls from 1 to 0 between the correction dims
    corr_low..corr_high; cos and sin are multiplied by mscale."""

    ext_factor: float
    mscale: float
    corr_low: float
    corr_high: float


class RopeArgs(NamedTuple):
    """`Backend.rope(x, positions, *args)` after x and positions, for one layer."""

    n_dims: int
    base: float
    freq_scale: float
    mode: str
    freq_factors: str | None  # the GGUF tensor of per-frequency factors, if the file has one
    yarn: Yarn | None = None


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float = YARN_BETA_FAST,
                   beta_slow: float = YARN_BETA_SLOW) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims in float32: the first and last pair index the ramp spans."""
    f32 = np.float32

    def corr_dim(n_rot: float) -> np.float32:
        turns = f32(f32(f32(n_rot) * f32(2)) * f32(math.pi))
        num = f32(f32(n_dims) * f32(math.log(f32(f32(n_ctx_orig) / turns))))
        return f32(num / f32(f32(2) * f32(math.log(f32(base)))))

    start = math.floor(corr_dim(beta_fast))
    end = math.ceil(corr_dim(beta_slow))
    return float(max(0, start)), float(min(n_dims - 1, end))


def yarn_for(n_dims: int, n_ctx_orig: int, base: float, freq_scale: float, attn_factor: float = 1.0) -> Yarn:
    """llama.cpp's YaRN settings for a file with rope.scaling.type = yarn (ext_factor 1).

    llama.cpp sets the attention factor to get_mscale(factor) = 1 + 0.1 ln(factor), then
    cancels it by 1 / (1 + 0.1 ln(factor)) because ggml's rope_yarn multiplies by that
    same term again; the product, in float32 as theirs, is what cos and sin carry.
    `attn_factor` is the file's rope.scaling.attn_factor."""
    f32 = np.float32
    factor = f32(f32(1) / f32(freq_scale))
    log_factor = f32(math.log(factor))
    mscale = f32(f32(f32(0.1) * log_factor) + f32(1)) if factor > 1 else f32(1)
    mscale = f32(mscale * f32(f32(1) / f32(f32(1) + f32(f32(0.1) * log_factor))))
    mscale = f32(mscale * f32(attn_factor))
    # rope_yarn: mscale *= 1 + 0.1 * logf(1 / freq_scale)
    mscale = f32(mscale * f32(f32(1) + f32(f32(0.1) * f32(math.log(f32(f32(1) / f32(freq_scale)))))))
    low, high = yarn_corr_dims(n_dims, n_ctx_orig, base)
    return Yarn(1.0, float(mscale), low, high)
