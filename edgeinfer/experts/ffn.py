"""The expert feed-forward of a mixture-of-experts layer, reading only the chosen experts.

A token's output is sum_j w_j * down_e(silu(gate_e(h)) * up_e(h)) over its chosen experts
e = experts[j], in the order routing chose them (llama.cpp adds them in that order). The
(token, expert) assignments of a chunk are grouped by expert, and `Backend.expert_batch`
runs every active expert with all its tokens, reading that expert's rows of the 3-D tensors
once (the CPU backend: one kernel call for gate and up, one for down, a layer). A decoded
token reads its k experts' slabs and nothing else of the layer's experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from edgeinfer.backends.base import Backend


def swiglu_experts(backend: "Backend", h: np.ndarray, experts: np.ndarray, weights: np.ndarray, gate: str,
                   up: str, down: str, *, biases: tuple[str, str, str] | None = None,
                   activation: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """sum_j weights[t, j] * FFN_{experts[t, j]}(h[t]) for every token t; h (n, n_embd) float32.

    `biases`: the per-expert bias tensors of gate, up and down (gpt-oss), each (n_expert,
    rows), added to each expert's output rows as ggml_add_id does. `activation(gate, up)`:
    SiLU(gate) * up unless given (gpt-oss's clamped variant)."""
    n, k = experts.shape
    flat = experts.reshape(-1)  # assignment t * k + j: token t's j-th expert
    order = np.argsort(flat, kind="stable")  # assignments grouped by expert
    active, counts = np.unique(flat[order], return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)])
    expert_of_row = flat[order]  # grouped row -> its expert
    g, u = backend.expert_batch([gate, up], active, starts, order // k, h)
    if biases is not None:
        g = g + _expert_rows(backend, biases[0], expert_of_row)
        u = u + _expert_rows(backend, biases[1], expert_of_row)
    act = backend.silu_mul(g, u) if activation is None else activation(g, u)
    y = backend.expert_batch([down], active, starts, np.arange(n * k), act)[0]
    if biases is not None:
        y = y + _expert_rows(backend, biases[2], expert_of_row)
    per_assignment = np.empty_like(y)
    per_assignment[order] = y
    per_assignment = per_assignment.reshape(n, k, -1)
    out = None
    for j in range(k):  # ggml: experts * weights, then their sum slot by slot
        term = (per_assignment[:, j] * weights[:, j:j + 1]).astype(np.float32)
        out = term if out is None else (out + term).astype(np.float32)
    return out


def _expert_rows(backend: "Backend", name: str, experts: np.ndarray) -> np.ndarray:
    """Rows of a per-expert bias tensor (GGML shape (rows, n_expert)) for the given experts."""
    n_expert = backend.gguf.tensors[name].shape[1]
    return backend.vector(name).reshape(n_expert, -1)[experts]
