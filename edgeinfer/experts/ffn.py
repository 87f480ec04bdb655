"""The expert feed-forward of a mixture-of-experts layer, reading only the chosen experts.

A token's output is sum_j w_j * down_e(silu(gate_e(h)) * up_e(h)) over its chosen experts
e = experts[j], in the order routing chose them (llama.cpp adds them in that order). The
(token, expert) assignments of a chunk are grouped by expert, and `Backend.expert_batch`
runs every active expert with all its tokens, reading that expert's rows of the 3-D tensors
once (the CPU backend: one kernel call for gate and up, one for down, a layer). A decoded
token reads its k experts' slabs and nothing else of the layer's experts.
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
    flat = experts.reshape(-1)  # assignment t * k + j: token t's j-th expert
    order = np.argsort(flat, kind="stable")  # assignments grouped by expert
    active, counts = np.unique(flat[order], return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)])
    g, u = backend.expert_batch([gate, up], active, starts, order // k, h)
    y = backend.expert_batch([down], active, starts, np.arange(n * k), backend.silu_mul(g, u))[0]
    per_assignment = np.empty_like(y)
    per_assignment[order] = y
    per_assignment = per_assignment.reshape(n, k, -1)
    out = None
    for j in range(k):  # ggml: experts * weights, then their sum slot by slot
        term = (per_assignment[:, j] * weights[:, j:j + 1]).astype(np.float32)
        out = term if out is None else (out + term).astype(np.float32)
    return out
