"""Mixture-of-experts routing compiled: softmax over the router logits in ggml's order, the
top k, their weights renormalised (edgeinfer.experts.routing has the numpy reference; the
two agree bit for bit). One call a layer: a decoded token's routing is ~5 us, not numpy's
~200 us of small-array calls.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .expf_glibc import expf
from .ggml_math import LANES, ggml_expf_any, hsum_vec

_JIT = dict(cache=True, nogil=True)  # no fastmath: the order of every float op matters here
F16_MIN_NORMAL = np.float32(6.103515625e-5)


@njit(**_JIT)
def softmax_topk(logits, k, normalize, experts, weights):
    """experts[t], weights[t] (k each, largest probability first; ties: the lower index) for
    router logits (n, n_expert) float32, as ggml_soft_max_f32 (vectors of LANES) and build_moe_ffn."""
    n, m = logits.shape
    body = m - m % LANES
    probs = np.empty(m, np.float32)
    for t in range(n):
        mx = logits[t, 0]
        for e in range(1, m):
            if logits[t, e] > mx:
                mx = logits[t, e]
        total = 0.0  # ggml_float: double
        for g in range(0, body, LANES):
            for i in range(LANES):
                probs[g + i] = ggml_expf_any(np.float32(logits[t, g + i] - mx))
            total += np.float64(hsum_vec(probs, g))
        for e in range(body, m):
            probs[e] = expf(np.float32(logits[t, e] - mx))   # ggml's tail: libm's expf
            total += np.float64(probs[e])
        scale = np.float32(1.0 / total)
        for e in range(m):
            probs[e] = np.float32(probs[e] * scale)
        for j in range(k):  # selection: the largest remaining, the lowest index on ties
            best = -1
            for e in range(m):
                taken = False
                for i in range(j):
                    if experts[t, i] == e:
                        taken = True
                if not taken and (best < 0 or probs[e] > probs[best]):
                    best = e
            experts[t, j] = best
            weights[t, j] = probs[best]
        if normalize:
            s = 0.0
            for j in range(k):
                s += np.float64(weights[t, j])
            s32 = max(np.float32(s), F16_MIN_NORMAL)
            for j in range(k):
                weights[t, j] = np.float32(weights[t, j] / s32)


def route(logits: np.ndarray, k: int, normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    logits = np.ascontiguousarray(logits, np.float32)
    experts = np.empty((logits.shape[0], k), np.int64)
    weights = np.empty((logits.shape[0], k), np.float32)
    softmax_topk(logits, k, normalize, experts, weights)
    return experts, weights


@njit(parallel=True, **_JIT)
def _combine_kernel(y, row_of, weights, out):
    n, k = weights.shape
    for t in prange(n):
        for j in range(k):
            src = y[row_of[t * k + j]]
            wj = weights[t, j]
            if j == 0:
                for c in range(out.shape[1]):
                    out[t, c] = src[c] * wj
            else:
                for c in range(out.shape[1]):
                    out[t, c] = out[t, c] + src[c] * wj   # each product rounded, then the add


def combine(y: np.ndarray, order: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each token's expert outputs weighted and summed, as Backend.expert_combine defines it
    (y: assignments grouped by expert, grouped row i = assignment order[i]; each product
    rounded to float32, the slots added in order): one pass instead of numpy's 2k."""
    n, k = weights.shape
    row_of = np.empty(order.shape[0], np.int64)
    row_of[order] = np.arange(order.shape[0])    # assignment -> its grouped row
    out = np.empty((n, y.shape[1]), np.float32)
    _combine_kernel(np.ascontiguousarray(y, np.float32), row_of, np.ascontiguousarray(weights, np.float32), out)
    return out
