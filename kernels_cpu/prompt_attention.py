"""Long prompts' attention through float matrix products: the masked softmax rows, and the
products on Numba's OpenMP team.

kv_attention.attention_blas takes a prompt chunk past EXACT_MAX_QUERIES queries here: its
queries go in blocks, each against the keys it can see, Q.K^T and the weighted values by
BLAS's sgemm, the softmax between them (same roundings at the boundaries as the exact
kernel: Q and the weights in F16, the sum in double). `attention_team` runs the (KV head,
query block) pieces in one parallel region that calls numpy's own OpenBLAS (blas_sgemm.py),
claimed costliest first; where that sgemm cannot be found, attention_blas runs the pieces
with numpy on the worker pool.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .blas_sgemm import sgemm, sgemm_address
from .dispatch import _fetch_add
from .f16 import f16_round, has_f16c
from .kv_attention_ir import scale_and_max16, via_f16
from .softmax_rows import NO_NANS as _NO_NANS
from .softmax_rows import exp_nonpositive

_JIT = dict(cache=True, nogil=True)
_VECTOR_F16 = has_f16c()


_MAX = {"nnan", "nsz", "reassoc"}   # lets a float max or sum loop vectorize (no bit target here)


@njit(**_JIT)
def _seen_keys(kpos, qpos, window):
    """seen[i, j]: whether query i (at qpos[i]) sees key j (at kpos[j]): causal, in the window."""
    seen = np.empty((qpos.shape[0], kpos.shape[0]), np.bool_)
    for i in range(qpos.shape[0]):
        p = qpos[i]
        for j in range(kpos.shape[0]):
            seen[i, j] = kpos[j] <= p and (window <= 0 or p - kpos[j] < window)
    return seen


@njit(**_JIT)
def _scale_and_max(row, scale, seen, m):
    """row <- row * scale; the maximum of m and the seen keys' scaled scores."""
    body = row.shape[0] - row.shape[0] % 16
    m = max(m, scale_and_max16(row, scale, seen, body))
    for j in range(body, row.shape[0]):
        v = np.float32(row[j] * scale)
        row[j] = v
        if seen[j] and v > m:
            m = v
    return m


@njit(fastmath=_NO_NANS, **_JIT)
def _exp_seen(row, seen, m):
    """row[j] <- exp(row[j] - m) for the keys the query sees (finite, <= m), 0 for the others."""
    for j in range(row.shape[0]):
        e = exp_nonpositive(min(row[j] - m, np.float32(0.0)))   # an unseen key's may be > 0
        row[j] = e if seen[j] else np.float32(0.0)


@njit(fastmath=_MAX, **_JIT)
def _sum_f64(row):
    total = 0.0
    for j in range(row.shape[0]):
        total += np.float64(row[j])
    return total


@njit(**_JIT)
def softmax_rows_f16(scores, scale, kpos, qpos, window, row_sinks):
    """Masked softmax of each row of scores * scale in place, weights rounded to F16 (the
    cache type); row r belongs to query r % len(qpos), whose keys are those with kpos <=
    its position (and within the window), its sink row_sinks[r] (-inf: none).

    One row at a time through L1, four vectorized passes: the scaled row and its maximum
    over the seen keys, ggml_v_expf's polynomial (softmax_rows.exp_nonpositive: the inputs
    are <= 0), the sum in double (in partial sums: there is no bit-exact target here, as
    the products around it are BLAS's), and the F16-rounded quotients. It replaced three
    passes around numpy's exp, the max and the sum each one scalar chain: 2.2 -> 0.5 ms
    for a 64-query block over 512 keys, 32 heads (45% of attention_blas's time)."""
    n = qpos.shape[0]
    seen = _seen_keys(kpos, qpos, window)
    for r in range(scores.shape[0]):
        row = scores[r]
        mine = seen[r % n]
        m = _scale_and_max(row, scale, mine, row_sinks[r])
        if m == -np.inf:   # sees no key and has no sink: no weights
            row[:] = 0.0
            continue
        _exp_seen(row, mine, m)
        total = _sum_f64(row)
        if row_sinks[r] > -np.inf:
            total += np.float64(math.exp(np.float32(row_sinks[r] - m)))
        inv = np.float32(1.0 / total)
        for j in range(row.shape[0]):
            if _VECTOR_F16:
                row[j] = via_f16(np.float32(row[j] * inv))
            else:
                row[j] = f16_round(np.float32(row[j] * inv))


@njit(**_JIT)
def _piece(fn, q, k, v, kpos, qpos, kq_scale, window, sinks, h, a, e, k0, k1, out):
    """Queries a..e-1 of the heads of KV head h against keys k0..k1-1: out[a:e, those heads]."""
    n_head, hd = q.shape[1], q.shape[2]
    n_kv, hdv = k.shape[1], v.shape[2]
    group = n_head // n_kv
    nb, nk = e - a, k1 - k0
    m = group * nb   # rows (head in group, query): one GEMM for the whole group
    qg = np.empty((m, hd), np.float32)
    row_sinks = np.empty(m, np.float32)
    for g in range(group):
        for t in range(nb):
            qg[g * nb + t] = q[a + t, h * group + g]
            row_sinks[g * nb + t] = sinks[h * group + g]
    scores = np.empty((m, nk), np.float32)
    # K of head h: rows k0.. of (S, n_kv, hd), a row stride of n_kv * hd; Q K^T takes it transposed
    sgemm(fn, 1, m, nk, hd, qg, 0, hd, k, (k0 * n_kv + h) * hd, n_kv * hd, scores, 0, nk)
    softmax_rows_f16(scores, kq_scale, kpos[k0:k1], qpos[a:e], window, row_sinks)
    og = np.empty((m, hdv), np.float32)
    sgemm(fn, 0, m, hdv, nk, scores, 0, nk, v, (k0 * n_kv + h) * hdv, n_kv * hdv, og, 0, hdv)
    for g in range(group):
        for t in range(nb):
            out[a + t, h * group + g] = og[g * nb + t]


@njit(parallel=True, **_JIT)
def attention_team(fn, q, k, v, kpos, qpos, kq_scale, window, sinks, pieces, out, nt):
    """out (n, n_head, hd_v) of the pieces (KV head, first query, end query, first key, end
    key), rows of `pieces` in the order they are claimed (costliest first: the last ones
    then even the threads out). q (n, n_head, hd) F16-rounded, k (S, n_kv, hd) and v (S,
    n_kv, hd_v) float32 C-contiguous; fn: blas_sgemm.sgemm_address()."""
    claims = np.zeros(1, np.int64)
    for _ in prange(nt):   # one iteration per thread
        i = _fetch_add(claims, 1)
        while i < pieces.shape[0]:
            h, a, e, k0, k1 = pieces[i, 0], pieces[i, 1], pieces[i, 2], pieces[i, 3], pieces[i, 4]
            _piece(fn, q, k, v, kpos, qpos, kq_scale, window, sinks, h, a, e, k0, k1, out)
            i = _fetch_add(claims, 1)


def long_prompt_attention_kernel():
    """The kernel a long prompt's attention compiles on this machine (for the warm-up's
    check): the team's where numpy's sgemm can be called, else the pool path's softmax."""
    return attention_team if sgemm_address() else softmax_rows_f16

