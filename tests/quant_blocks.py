"""Random but valid GGUF weight blocks for kernel tests (reusable by other test files)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from gguf_factory import random_blocks as _factory_blocks

# Types gguf.quants can quantize: made from random floats; the rest are written as bytes.
QUANTIZABLE = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)


def random_blocks(qtype: T, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes (n_rows, row_bytes) uint8 of a random (n_rows, n_cols) weight of `qtype`,
    unit scale, with scales of both signs."""
    return np.ascontiguousarray(_factory_blocks(qtype, n_rows, n_cols, rng, std=1.0, negative_scales=True))


def q4k_scales_mins(sc: np.ndarray):
    """(rows, 12) packed Q4_K/Q5_K scale bytes -> (rows, 8) 6-bit scales, (rows, 8) 6-bit mins."""
    sc = sc.astype(np.int64)
    scales, mins = np.zeros((sc.shape[0], 8), np.int64), np.zeros((sc.shape[0], 8), np.int64)
    for j in range(8):
        if j < 4:
            scales[:, j], mins[:, j] = sc[:, j] & 63, sc[:, j + 4] & 63
        else:
            scales[:, j] = (sc[:, j + 4] & 15) | ((sc[:, j - 4] >> 6) << 4)
            mins[:, j] = (sc[:, j + 4] >> 4) | ((sc[:, j] >> 6) << 4)
    return scales, mins


def fma_f32(a, b, c):
    """a * b + c rounded once to float32 (an fma on float32 inputs)."""
    return (np.asarray(a, np.float64) * b + c).astype(np.float32)


def hsum8(a):
    """The AVX horizontal sum of 8 float lanes (last axis), in its order."""
    t = a[..., :4] + a[..., 4:]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])


def f16_values(b):
    """(..., 2) uint8 fp16 bytes -> (...) float32."""
    return b.copy().view(np.float16)[..., 0].astype(np.float32)
