"""Non-causal float32 attention in ggml's order: what libmtmd's encoders compute on the CPU
without flash attention (clip.cpp's build_attn), every query seeing every key.

Per head:
1. KQ = ggml_mul_mat(K, Q). Q is a permuted view, not contiguous, so ggml skips tinyBLAS
   and runs ggml_vec_dot_f32 for every (query, key) pair (f32_ggml.vec_dot_f32).
2. ggml_soft_max_ext without a mask: each score times the scale; the row's max; then
   ggml_vec_soft_max_f32: exp(score - max) by ggml_v_expf a vector of LANES at a time, each
   vector's horizontal sum added to a double, the leftover keys by libm's expf, each added
   to the double; then every weight times float32(1 / sum).
3. KQV = ggml_mul_mat(V^T, weights), V^T contiguous (ggml_cont): tinyBLAS where the key
   count is a multiple of its vector and the head size of 4, else vec_dot_f32 per output
   (f32_ggml.matmul makes that choice).

Why the exact order: an encoder whose matrices are 8-bit (a Q8_0 mmproj) quantizes the
attention's output and every later activation to 8 bits; a last-bit difference here moved
one activation a whole quantum, 2-4e-3 of the embeddings. The numpy reference is
attention_f32_ggml_ref.py; tests hold both to the oracle's own ggml graph.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .expf_glibc import expf as libm_expf
from .attention_f32_ggml_ir import scores_block8, scores_block16
from .f32_ggml import host_lanes, matmul, vec_dot_f32
from .ggml_math import LANES, ggml_expf_any, hsum_vec
from .threads import apply_threads

_JIT = dict(cache=True, nogil=True)   # no fastmath: every float op's order is ggml's


@njit(parallel=True, fastmath={"contract"}, **_JIT)   # vec_dot_f32's a * b + c are fmas (f32_ggml)
def _scores(q, kt, k, s, lanes):
    """s[i, j] = ggml_vec_dot_f32(k[j], q[i]): `lanes` keys at a time in the vector lanes
    (attention_f32_ggml_ir; kt: key_blocks(k)), the keys past the last block one pair at a
    time; queries on the threads."""
    n_keys = k.shape[0]
    whole = n_keys - n_keys % lanes
    for i in prange(q.shape[0]):
        for j0 in range(0, whole, lanes):
            if lanes == 16:
                scores_block16(q, kt, i, j0, s)
            else:
                scores_block8(q, kt, i, j0, s)
        acc, red = np.empty(4 * lanes, np.float32), np.empty(lanes, np.float32)
        for j in range(whole, n_keys):
            s[i, j] = vec_dot_f32(k[j], q[i], lanes, acc, red)


@njit(inline="always", **_JIT)
def _softmax_row(w, scale):
    n = w.shape[0]
    mx = np.float32(-np.inf)
    for j in range(n):
        w[j] = np.float32(w[j] * scale)
        if w[j] > mx:
            mx = w[j]
    total = 0.0
    whole = n - n % LANES
    for c in range(0, whole, LANES):
        for lane in range(LANES):
            w[c + lane] = ggml_expf_any(np.float32(w[c + lane] - mx))
        total += np.float64(hsum_vec(w, c))
    for j in range(whole, n):
        e = libm_expf(np.float32(w[j] - mx))
        total += np.float64(e)
        w[j] = e
    inv = np.float32(1.0 / total)
    for j in range(n):
        w[j] = np.float32(w[j] * inv)


@njit(parallel=True, **_JIT)
def softmax_rows(s, scale):
    """In place: each row of scores -> ggml_soft_max_ext's weights (no mask, no ALiBi)."""
    for i in prange(s.shape[0]):
        _softmax_row(s[i], scale)


def key_blocks(k: np.ndarray, lanes: int) -> np.ndarray:
    """k (keys, d) -> (keys // lanes, d, lanes): each block of `lanes` keys transposed."""
    whole = k.shape[0] - k.shape[0] % lanes
    return np.ascontiguousarray(k[:whole].reshape(-1, lanes, k.shape[1]).transpose(0, 2, 1))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """softmax(q k^T * scale) v for every head in ggml's order: q, k, v (n, heads, d) float32
    -> (n, heads * d). Keys and queries are the same n patches."""
    apply_threads()
    n, n_head, d = q.shape
    lanes = host_lanes()
    scale = np.float32(scale)
    out = np.empty((n, n_head, d), np.float32)
    s = np.empty((n, k.shape[0]), np.float32)
    o = np.empty((n, d), np.float32)
    for h in range(n_head):
        kh = np.ascontiguousarray(k[:, h], np.float32)
        _scores(np.ascontiguousarray(q[:, h], np.float32), key_blocks(kh, lanes), kh, s, lanes)
        softmax_rows(s, scale)
        matmul(np.ascontiguousarray(v[:, h].T, np.float32), s, o)
        out[:, h] = o
    return out.reshape(n, n_head * d)
