"""A vision MLP's activation as ggml's CPU computes it (GELU and quick GELU from F16 tables),
shared by the encoders' CPU ops and the GPU ops' host fallback."""
from __future__ import annotations

import numpy as np

from edgeinfer.backends.base import _gelu_f16_table  # ggml's CPU GELU table, built in one place
from edgeinfer.kernels_cpu import ops


def activation(x: np.ndarray, op: str, in_place: bool = False) -> np.ndarray:
    """The MLP's activation as ggml's CPU computes it (GELU and quick GELU from F16 tables).
    in_place: GELU overwrites x (a product nothing else reads) instead of a fresh array: at
    4096 patches x 4304 that array is 70 MB, beyond malloc's heap, so every layer paid its
    page faults anew."""
    x = np.asarray(x, np.float32)
    if op == "silu":
        with np.errstate(over="ignore"):
            return (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32)
    if op == "gelu":
        return ops.gelu(x, _gelu_f16_table(), out=x if in_place and x.flags.c_contiguous and x.flags.writeable
                        else None)
    return _gelu_quick_table()[x.astype(np.float16).view(np.uint16)]


_QUICK: list[np.ndarray] = []


def _gelu_quick_table() -> np.ndarray:
    """ggml's quick-GELU table: x * sigmoid(1.702 x) for every F16 input, rounded to F16."""
    if not _QUICK:
        x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
        with np.errstate(all="ignore"):
            y = x * (np.float32(1.0) / (np.float32(1.0) + np.exp(np.float32(-1.702) * x)))
        _QUICK.append(y.astype(np.float16).astype(np.float32))
    return _QUICK[0]
