"""Expert routing: from a token's router logits to its chosen experts and their weights, in
ggml's order (llama.cpp's build_moe_ffn), so that the same experts win as in llama.cpp.

- `softmax_topk` (qwen3moe): softmax over all experts (ggml_soft_max_f32: the vector exp
  over 8 lanes at a time, 16 on AVX-512, each vector's sum added in double), the top k by
  probability, their probabilities renormalised to sum 1 (the sum clamped below at 2^-14, as llama.cpp does). Compiled
  (kernels_cpu.moe_routing); `softmax_topk_reference` is the numpy statement of it.
- `topk_softmax` (gpt-oss): the top k of the logits (the router's bias added), then a
  softmax over those k only. One numpy step per layer.
"""

from __future__ import annotations

import numpy as np

F16_MIN_NORMAL = np.float32(6.103515625e-5)  # llama.cpp's clamp of the weights' sum


def ggml_softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis as ggml_compute_forward_soft_max_f32: exp(x - max) a vector
    of LANES at a time (ggml_v_expf; 8, or 16 on AVX-512) with each vector's horizontal sum
    added in double, the tail with libm's expf; then every value times (float)(1 / sum)."""
    from edgeinfer.kernels_cpu import ggml_math_ref, libm  # Numba: not at import, the CLI and server start light

    lanes = ggml_math_ref.LANES
    x = np.asarray(logits, np.float32)
    shifted = (x - x.max(axis=-1, keepdims=True)).astype(np.float32)
    n = x.shape[-1]
    body = n - n % lanes
    y = np.empty_like(shifted)
    y[..., :body] = ggml_math_ref.expf_any(shifted[..., :body])
    y[..., body:] = libm.expf(shifted[..., body:])
    groups = y[..., :body].reshape(y.shape[:-1] + (body // lanes, lanes))
    total = np.cumsum(ggml_math_ref.hsum_vec(groups).astype(np.float64), axis=-1)[..., -1] if body else 0.0
    tail = y[..., body:].astype(np.float64)
    total = total + (np.cumsum(tail, axis=-1)[..., -1] if n > body else 0.0)
    scale = (1.0 / np.asarray(total, np.float64)).astype(np.float32)
    return (y * scale[..., None]).astype(np.float32)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores per row, largest first (ties: the lower index first)."""
    order = np.argsort(-np.asarray(scores, np.float32), axis=-1, kind="stable")
    return order[..., :k]


def softmax_topk(logits: np.ndarray, k: int, normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(experts (n, k) int64, weights (n, k) float32) for router logits (n, n_expert)."""
    from edgeinfer.kernels_cpu import moe_routing

    return moe_routing.route(logits, k, normalize)


def softmax_topk_reference(logits: np.ndarray, k: int, normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """softmax_topk in numpy, op for op."""
    probs = ggml_softmax(logits)
    chosen = top_k(probs, k)
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if normalize:
        total = np.cumsum(weights.astype(np.float64), axis=-1)[..., -1:].astype(np.float32)
        weights = (weights / np.maximum(total, F16_MIN_NORMAL)).astype(np.float32)
    return chosen.astype(np.int64), weights


def topk_softmax(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """gpt-oss's routing (llama.cpp's SOFTMAX_WEIGHT gating): the top k of the (biased)
    router logits, then a softmax over the k chosen logits only."""
    logits = np.asarray(logits, np.float32)
    chosen = top_k(logits, k)
    return chosen.astype(np.int64), ggml_softmax(np.take_along_axis(logits, chosen, axis=-1))
