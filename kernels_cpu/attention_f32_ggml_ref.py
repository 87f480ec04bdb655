"""numpy twin of attention_f32_ggml's softmax (ggml_soft_max_ext without a mask), whole rows at
a time: the reference its compiled kernel is held to. The products around it are f32_ggml's,
held to the oracle's ggml_mul_mat directly."""
from __future__ import annotations

import numpy as np

from . import ggml_math_ref as gmr
from .libm import expf as libm_expf


def softmax_rows(s: np.ndarray, scale: float) -> np.ndarray:
    """(rows, n) scores -> weights: times the scale, minus the row's max, ggml_v_expf a vector
    of LANES at a time (each vector's sum in float32, the vectors' sums in double), the
    leftovers by libm's expf (each added in double), then times float32(1 / sum)."""
    lanes = gmr.LANES
    w = (np.asarray(s, np.float32) * np.float32(scale)).astype(np.float32)
    x = (w - w.max(axis=1, keepdims=True)).astype(np.float32)
    whole = x.shape[1] - x.shape[1] % lanes
    e = np.empty_like(x)
    e[:, :whole] = gmr.expf_any(x[:, :whole])
    e[:, whole:] = libm_expf(x[:, whole:])
    total = np.zeros(x.shape[0], np.float64)
    for c in range(0, whole, lanes):
        total += gmr.hsum_vec(e[:, c:c + lanes]).astype(np.float64)
    for j in range(whole, x.shape[1]):
        total += e[:, j].astype(np.float64)
    return (e * (1.0 / total).astype(np.float32)[:, None]).astype(np.float32)
