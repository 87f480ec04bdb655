"""The expert feed-forward of a mixture-of-experts layer, reading only the chosen experts.

A token's output is sum_j w_j * down_e(silu(gate_e(h)) * up_e(h)) over its chosen experts
e = experts[j], in the order routing chose them (llama.cpp adds them in that order). The
(token, expert) assignments of a chunk are grouped by expert, and `Backend.expert_batch`
runs every active expert with all its tokens, reading that expert's rows of the 3-D tensors
once (the CPU backend: one kernel call for gate and up, one for down, a layer; the GPU: one
launch each). A decoded token reads its k experts' slabs and nothing else of the layer's
experts. `Backend.expert_bias` and `Backend.expert_combine` add per-expert biases and
weigh and sum each token's expert outputs on the side where the experts ran.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from edgeinfer.backends.base import Backend


def swiglu_experts(backend: "Backend", h: Any, experts: np.ndarray, weights: np.ndarray, gate: str,
                   up: str, down: str, *, biases: tuple[str, str, str] | None = None,
                   activation: Callable[[Any, Any], Any] | None = None, down_scale: str | None = None) -> Any:
    """sum_j weights[t, j] * FFN_{experts[t, j]}(h[t]) for every token t; h (n, n_embd) float32,
    on the host or where the backend keeps the layer's activations.

    `biases`: the per-expert bias tensors of gate, up and down (gpt-oss), each (n_expert,
    rows), added to each expert's output rows as ggml_add_id does. `activation(gate, up)`:
    SiLU(gate) * up unless given (gpt-oss's clamped variant, gemma4's GELU). `down_scale`: a
    per-expert scale vector (n_expert,) multiplying each expert's down output before the
    routing weights (ggml's `ffn_down_exps.scale`)."""
    n, k = experts.shape
    flat = experts.reshape(-1)  # assignment t * k + j: token t's j-th expert
    order = np.argsort(flat, kind="stable")  # assignments grouped by expert
    expert_of_row = flat[order]  # grouped row -> its expert
    active, counts = np.unique(expert_of_row, return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)])
    g, u = backend.expert_batch([gate, up], active, starts, order // k, h)
    if biases is not None:
        g = backend.expert_bias(g, biases[0], expert_of_row)
        u = backend.expert_bias(u, biases[1], expert_of_row)
    act = backend.silu_mul(g, u) if activation is None else activation(g, u)
    y = backend.expert_batch([down], active, starts, np.arange(n * k), act)[0]
    if biases is not None:
        y = backend.expert_bias(y, biases[2], expert_of_row)
    if down_scale is not None:
        y = backend.scale_rows(y, backend.vector(down_scale)[expert_of_row])
    return backend.expert_combine(y, order, weights)
