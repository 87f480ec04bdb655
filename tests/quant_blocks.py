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
