"""The expert feed-forward of a mixture-of-experts layer, reading only the chosen experts.

A token's output is sum_j w_j * down_e(silu(gate_e(h)) * up_e(h)) over its chosen experts
e = experts[j], in the order routing chose them (llama.cpp adds them in that order). The
tokens of a prompt chunk are grouped by expert, so each expert that any token chose runs once,
as one batch, through the backend's quantized matmuls on that expert's rows of the 3-D
tensors (`Backend.expert_linear_many`): a decoded token reads 2 x k expert slabs and nothing
else of the layer's experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from edgeinfer.backends.base import Backend


def swiglu_experts(backend: "Backend", h: np.ndarray, experts: np.ndarray, weights: np.ndarray, gate: str,
                   up: str, down: str) -> np.ndarray:
    """sum_j weights[t, j] * FFN_{experts[t, j]}(h[t]) for every token t; h (n, n_embd) float32."""
    n, k = experts.shape
    out = None
    per_slot: list[np.ndarray | None] = [None] * k  # slot j: (n, n_embd) results of each token's j-th expert
    for e in np.unique(experts):
        rows, slots = np.nonzero(experts == e)
        g, u = backend.expert_linear_many([gate, up], int(e), h[rows])
        y = backend.expert_linear_many([down], int(e), backend.silu_mul(g, u))[0]
        y = np.asarray(y, np.float32)
        for j in range(k):
            mine = slots == j
            if mine.any():
                if per_slot[j] is None:
                    per_slot[j] = np.zeros((n, y.shape[1]), np.float32)
                per_slot[j][rows[mine]] = y[mine]
    for j in range(k):  # ggml: experts * weights, then their sum slot by slot
        term = (per_slot[j] * weights[:, j:j + 1]).astype(np.float32)
        out = term if out is None else (out + term).astype(np.float32)
    return out
