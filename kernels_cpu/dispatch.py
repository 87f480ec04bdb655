"""The fast kernels' type dispatch, kernel sets per model types, and rows shared out by claims.

`_dot_rows` and `_deq_row` dispatch on the type id once per run of rows to the row
intrinsics of dot_q32.py, dot_mxfp4.py, dot_kquant.py and dot_q4k_x8.py (each row's whole loop over
blocks is IR; Numba only runs `prange` over rows). `kernels_for` gives copies of them
compiled only for a model's types. Decode matvecs share their rows out by claims on an
atomic counter.
"""
from __future__ import annotations

from types import FunctionType

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from .dot_kquant import (deq_row_iq4_xs, deq_row_q2_k, deq_row_q3_k, deq_row_q4_k, deq_row_q5_k, deq_row_q6_k,
                         row_iq4_xs, row_q2_k, row_q3_k, row_q4_k, row_q5_k, row_q6_k, rows_q5_k, rows_q6_k,
                         tok_iq4_xs, tok_q2_k, tok_q3_k, tok_q4_k, tok_q5_k, tok_q6_k)
from .dot_q32 import (WIDE_TOKEN_TYPES, deq_row_iq4_nl, deq_row_q4_0, deq_row_q4_1, deq_row_q5_0, deq_row_q5_1,
                      deq_row_q8_0, row_iq4_nl, row_q4_0, row_q4_1, row_q5_0, row_q5_1, row_q8_0, rows_q4_0, rows_q4_1,
                      rows_q5_0, rows_q5_1, rows_q8_0, tok_iq4_nl, tok_q4_0, tok_q4_1, tok_q5_0, tok_q5_1, tok_q8_0)
from .dot_iquant import (deq_row_iq1_m, deq_row_iq1_s, deq_row_iq2_s, deq_row_iq2_xs, deq_row_iq2_xxs,
                         deq_row_iq3_s, deq_row_iq3_xxs, row_iq1_m, row_iq1_s, row_iq2_s, row_iq2_xs, row_iq2_xxs,
                         row_iq3_s, row_iq3_xxs)
from .dot_mxfp4 import deq_row_mxfp4, row_mxfp4, rows_mxfp4
from .pair_tokens import pairs_iq4_nl, pairs_q4_0, pairs_q5_0, pairs_q8_0
from .dot_q4k_x8 import deq_row_q4_k_x8, rows4_q4_k, rows8_q4_k_x8
from .ir_helpers import I64, ROWS, TOKENS_A_ROW, WIDE_TOKENS_A_ROW, X8_ROWS
from .quant_kernels import (IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS, MXFP4, Q2_K, Q3_K,
                            Q4_0, Q4_1, Q4_K, Q4_K_X8, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0)
from . import compile_progress, pair_tokens
from .quant_types import FAST_IDS, quant_info, row_bytes
from .threads import get_threads

_JIT = dict(cache=True, nogil=True)

# Which types the dispatching functions below (_dot_rows, _quartered_rows, _deq_row) and
# the kernels calling them handle: every one in these definitions; `kernels_for` copies
# them with some of the flags False, and Numba prunes those branches before typing, so a
# model compiles only its own types' code (see "Kernels per type set" below).
_HAS_Q8_0 = _HAS_Q4_0 = _HAS_Q4_1 = _HAS_Q5_0 = _HAS_Q5_1 = _HAS_IQ4_NL = _HAS_MXFP4 = True
_HAS_Q2_K = _HAS_Q3_K = _HAS_Q4_K = _HAS_Q5_K = _HAS_Q6_K = _HAS_IQ4_XS = _HAS_Q4_K_X8 = True
_HAS_IQ2_XXS = _HAS_IQ2_XS = _HAS_IQ2_S = _HAS_IQ3_XXS = _HAS_IQ3_S = _HAS_IQ1_S = _HAS_IQ1_M = True
_TYPE_NAMES = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", IQ4_NL: "IQ4_NL", MXFP4: "MXFP4",
               Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", IQ4_XS: "IQ4_XS",
               Q4_K_X8: "Q4_K_X8", IQ2_XXS: "IQ2_XXS", IQ2_XS: "IQ2_XS", IQ2_S: "IQ2_S", IQ3_XXS: "IQ3_XXS",
               IQ3_S: "IQ3_S", IQ1_S: "IQ1_S", IQ1_M: "IQ1_M"}


@intrinsic
def _fetch_add(typingctx, counter, inc):
    """counter[0] += inc atomically; returns the old value (the work-claim counter)."""
    sig = types.int64(counter, inc)

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", builder.bitcast(arr.data, I64.as_pointer()), args[1], "monotonic")
    return sig, codegen


CHUNK = 16   # rows per work item: the type dispatch and call overhead, once per chunk
#              (a multiple of ROWS: a 4-row group never straddles two chunks)


@njit(inline="always", **_JIT)
def _put_quarters(out, i, q, vals):
    """The four rows of one quartered loop step: rows i, i + q, i + 2q, i + 3q."""
    out[i] = vals[0]
    out[i + q] = vals[1]
    out[i + 2 * q] = vals[2]
    out[i + 3 * q] = vals[3]


@njit(**_JIT)
def _quartered_rows(w, qt, r0, r1, xq, xd, xs, out):
    """Q8_0, Q6_K, Q5_K, Q4_K (rows % 8 == 0), Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 "rows"
    r0..r1 in a quartered order: with
    q = n_rows // 4, slot v < 4q is row v // 4 + (v % 4) * q, slots from 4q on are rows
    themselves. Four rows a quarter of the matrix apart run in one loop: four long
    sequential streams for the prefetchers (four adjacent short rows were slower from
    memory, and eight streams a thread slower than four), shared activation loads, and,
    for Q8_0, four independent fma chains (one row's chain sets the pace otherwise).
    Every row keeps its own order: Q8_0 and Q6_K ggml_vec_dot's, Q4_K llama.cpp's
    repacked gemv's, one row per lane (_q4_k_rows4_lanes).
    Measured with 2 threads, old and new loop alternating in one run: Gemma's Q8_0 head
    (262144 x 640) 6.3 -> 5.6 ms against one row a loop; Q6_K 4096 x 14336 16.9 -> 22.8
    GB/s against one row a loop (8 rows spilled: 15.0); Q4_K 4096 x 14336 20.5 -> 24.1
    GB/s against 8 rows an eighth apart in 8 lanes. On the AVX-512 VNNI Xeon the
    32-element types' quartered loop (vpdpbusd from a start the four rows share) beat their
    one-row loop at every shape: Q4_0 4096 x 14336 25.5 -> 32-34 GB/s, Q5_0 2048 x 640
    (Gemma 3 270M's gate) 0.048 -> 0.038 ms, Q4_1 4096 x 4096 16 -> 24 GB/s."""
    q = out.shape[0] // ROWS
    # the row groups r0 // ROWS .. i1 - 1 (r0 is a multiple of CHUNK, so of ROWS), in a loop
    # of each type's own: one loop around the dispatch kept every type's hoisted constants
    # in registers through every other type's loop (AVX2 build: Q4_K, Q6_K spilled)
    i0, i1 = r0 // ROWS, max(r0 // ROWS, min(r1, ROWS * q) // ROWS)
    if _HAS_Q8_0 and qt == Q8_0:
        for i in range(i0, i1):
            _put_quarters(out, i, q, rows_q8_0(w, i, xq, xd, xs, q))
    elif _HAS_Q6_K and qt == Q6_K:
        for i in range(i0, i1):
            _put_quarters(out, i, q, rows_q6_k(w, i, xq, xd, xs, q))
    elif _HAS_Q5_K and qt == Q5_K:
        for i in range(i0, i1):
            _put_quarters(out, i, q, rows_q5_k(w, i, xq, xd, xs, q))
    elif _HAS_Q4_0 and qt == Q4_0:
        for i in range(i0, i1):
            _put_quarters(out, i, q, rows_q4_0(w, i, xq, xd, xs, q))
    elif _HAS_Q4_1 and qt == Q4_1:
        for i in range(i0, i1):
            _put_quarters(out, i, q, rows_q4_1(w, i, xq, xd, xs, q))
    elif _HAS_Q5_0 and qt == Q5_0:
        for i in range(i0, i1):
            _put_quarters(out, i, q, rows_q5_0(w, i, xq, xd, xs, q))
    elif _HAS_Q5_1 and qt == Q5_1:
        for i in range(i0, i1):
            _put_quarters(out, i, q, rows_q5_1(w, i, xq, xd, xs, q))
    elif _HAS_MXFP4 and qt == MXFP4:
        for i in range(i0, i1):
            _put_quarters(out, i, q, rows_mxfp4(w, i, xq, xd, xs, q))
    elif _HAS_Q4_K:   # else not reached: the callers pass only the types above
        for i in range(i0, i1):
            _put_quarters(out, i, q, rows4_q4_k(w, i, xq, xd, xs, q))
    v = ROWS * i1
    for r in range(max(v, ROWS * q), r1):   # never for Q4_K (rows % 8 == 0)
        if _HAS_Q8_0 and qt == Q8_0:
            out[r] = row_q8_0(w, r, xq, xd, xs)
        elif _HAS_Q5_K and qt == Q5_K:
            out[r] = row_q5_k(w, r, xq, xd, xs)
        elif _HAS_Q6_K and qt == Q6_K:
            out[r] = row_q6_k(w, r, xq, xd, xs)
        elif _HAS_Q4_0 and qt == Q4_0:
            out[r] = row_q4_0(w, r, xq, xd, xs)
        elif _HAS_Q4_1 and qt == Q4_1:
            out[r] = row_q4_1(w, r, xq, xd, xs)
        elif _HAS_Q5_0 and qt == Q5_0:
            out[r] = row_q5_0(w, r, xq, xd, xs)
        elif _HAS_Q5_1 and qt == Q5_1:
            out[r] = row_q5_1(w, r, xq, xd, xs)
        elif _HAS_MXFP4 and qt == MXFP4:
            out[r] = row_mxfp4(w, r, xq, xd, xs)


@njit(**_JIT)
def _dot_rows(w, qt, r0, r1, xq, xd, xs, out):
    """out[r] = row r of w . 8-bit activations for r0 <= r < r1, dispatched on the GGML
    type id once (the row intrinsics inline into each branch's loop)."""
    if _HAS_Q4_K_X8 and qt == Q4_K_X8:   # r0 and r1 are multiples of 8 (CHUNK and the row count are)
        for g in range(r0 // X8_ROWS, r1 // X8_ROWS):
            vals = rows8_q4_k_x8(w, g, xq, xd, xs)
            for k in range(X8_ROWS):
                out[X8_ROWS * g + k] = vals[k]
    elif ((_HAS_Q6_K and qt == Q6_K) or (_HAS_Q8_0 and qt == Q8_0) or (_HAS_Q5_K and qt == Q5_K)
          or (_HAS_Q4_K and qt == Q4_K and w.shape[0] % 8 == 0)
          or (_HAS_Q4_0 and qt == Q4_0) or (_HAS_Q4_1 and qt == Q4_1) or (_HAS_Q5_0 and qt == Q5_0)
          or (_HAS_Q5_1 and qt == Q5_1) or (_HAS_MXFP4 and qt == MXFP4)):
        _quartered_rows(w, qt, r0, r1, xq, xd, xs, out)
    elif _HAS_Q4_K and qt == Q4_K:   # llama.cpp repacks only matrices with rows % 8 == 0
        for r in range(r0, r1):
            out[r] = row_q4_k(w, r, xq, xd, xs)
    elif _HAS_IQ4_NL and qt == IQ4_NL:
        for r in range(r0, r1):
            out[r] = row_iq4_nl(w, r, xq, xd, xs)
    elif _HAS_Q3_K and qt == Q3_K:
        for r in range(r0, r1):
            out[r] = row_q3_k(w, r, xq, xd, xs)
    elif _HAS_Q2_K and qt == Q2_K:
        for r in range(r0, r1):
            out[r] = row_q2_k(w, r, xq, xd, xs)
    elif _HAS_IQ4_XS and qt == IQ4_XS:
        for r in range(r0, r1):
            out[r] = row_iq4_xs(w, r, xq, xd, xs)
    elif _HAS_IQ2_XXS and qt == IQ2_XXS:
        for r in range(r0, r1):
            out[r] = row_iq2_xxs(w, r, xq, xd, xs)
    elif _HAS_IQ2_XS and qt == IQ2_XS:
        for r in range(r0, r1):
            out[r] = row_iq2_xs(w, r, xq, xd, xs)
    elif _HAS_IQ2_S and qt == IQ2_S:
        for r in range(r0, r1):
            out[r] = row_iq2_s(w, r, xq, xd, xs)
    elif _HAS_IQ3_XXS and qt == IQ3_XXS:
        for r in range(r0, r1):
            out[r] = row_iq3_xxs(w, r, xq, xd, xs)
    elif _HAS_IQ3_S and qt == IQ3_S:
        for r in range(r0, r1):
            out[r] = row_iq3_s(w, r, xq, xd, xs)
    elif _HAS_IQ1_S and qt == IQ1_S:
        for r in range(r0, r1):
            out[r] = row_iq1_s(w, r, xq, xd, xs)
    elif _HAS_IQ1_M and qt == IQ1_M:
        for r in range(r0, r1):
            out[r] = row_iq1_m(w, r, xq, xd, xs)


@njit(**_JIT)
def _has_tokens_rows(qt, n_rows):
    """Whether _dot_rows_tokens serves this matrix: its decode rows are the row_loop kernels'
    (Q4_K's only where llama.cpp does not repack it, rows % 8 != 0)."""
    return ((_HAS_Q8_0 and qt == Q8_0) or (_HAS_Q6_K and qt == Q6_K) or (_HAS_Q5_K and qt == Q5_K)
            or (_HAS_Q4_0 and qt == Q4_0) or (_HAS_Q4_1 and qt == Q4_1) or (_HAS_Q5_0 and qt == Q5_0)
            or (_HAS_Q5_1 and qt == Q5_1) or (_HAS_IQ4_NL and qt == IQ4_NL) or (_HAS_Q3_K and qt == Q3_K)
            or (_HAS_Q2_K and qt == Q2_K) or (_HAS_IQ4_XS and qt == IQ4_XS)
            or (_HAS_Q4_K and qt == Q4_K and n_rows % 8 != 0))


@njit(**_JIT)
def _tokens_a_row(qt):
    """The most tokens _dot_rows_tokens takes in one pass for this type."""
    return WIDE_TOKENS_A_ROW if qt in WIDE_TOKEN_TYPES else TOKENS_A_ROW


@njit(**_JIT)
def _dot_rows_tokens(w, qt, r0, r1, xq, xd, xs, t, m, out):
    """out[t + j, r] for r0 <= r < r1 and the m tokens from t (2 <= m <= _tokens_a_row(qt)):
    each row read and unpacked once for them, each (row, token) with matvec's bits
    (ir_helpers.token_row_loop). A loop over the rows in each type's branch, not one loop
    around the dispatch: LLVM hoists a loop's invariant constants to its preheader, and
    in one loop for all the types every type's constants stayed in registers through every
    other type's inner loop (the AVX2 build's Q8_0 four-token loop spilled 14 times)."""
    if _HAS_Q8_0 and qt == Q8_0:
        for r in range(r0, r1):
            tok_q8_0(w, r, xq, xd, xs, t, m, out)
    elif _HAS_Q6_K and qt == Q6_K:
        for r in range(r0, r1):
            tok_q6_k(w, r, xq, xd, xs, t, m, out)
    elif _HAS_Q5_K and qt == Q5_K:
        for r in range(r0, r1):
            tok_q5_k(w, r, xq, xd, xs, t, m, out)
    elif _HAS_Q4_0 and qt == Q4_0:
        for r in range(r0, r1):
            tok_q4_0(w, r, xq, xd, xs, t, m, out)
    elif _HAS_Q4_1 and qt == Q4_1:
        for r in range(r0, r1):
            tok_q4_1(w, r, xq, xd, xs, t, m, out)
    elif _HAS_Q5_0 and qt == Q5_0:
        for r in range(r0, r1):
            tok_q5_0(w, r, xq, xd, xs, t, m, out)
    elif _HAS_Q5_1 and qt == Q5_1:
        for r in range(r0, r1):
            tok_q5_1(w, r, xq, xd, xs, t, m, out)
    elif _HAS_IQ4_NL and qt == IQ4_NL:
        for r in range(r0, r1):
            tok_iq4_nl(w, r, xq, xd, xs, t, m, out)
    elif _HAS_Q3_K and qt == Q3_K:
        for r in range(r0, r1):
            tok_q3_k(w, r, xq, xd, xs, t, m, out)
    elif _HAS_Q2_K and qt == Q2_K:
        for r in range(r0, r1):
            tok_q2_k(w, r, xq, xd, xs, t, m, out)
    elif _HAS_IQ4_XS and qt == IQ4_XS:
        for r in range(r0, r1):
            tok_iq4_xs(w, r, xq, xd, xs, t, m, out)
    elif _HAS_Q4_K:   # else not reached: _has_tokens_rows names the types above
        for r in range(r0, r1):
            tok_q4_k(w, r, xq, xd, xs, t, m, out)


@njit(inline="always", **_JIT)
def _pair_dots(w, qt, r, xq2, dx2, c2, p, m):
    """Row r's sums with the tokens of pairs p..p + m - 1 (m = 1..4), then zeros: 8 values."""
    if _HAS_Q8_0 and qt == Q8_0:
        return pairs_q8_0(w, r, xq2, dx2, c2, p, m)
    if _HAS_Q5_0 and qt == Q5_0:
        return pairs_q5_0(w, r, xq2, dx2, c2, p, m)
    if _HAS_Q4_0 and qt == Q4_0:
        return pairs_q4_0(w, r, xq2, dx2, c2, p, m)
    return pairs_iq4_nl(w, r, xq2, dx2, c2, p, m)   # IQ4_NL: pair_tokens.PAIR_TYPES are these four


@njit(**_JIT)
def _dot_rows_pairs(w, qt, r0, r1, xq2, dx2, c2, out):
    """out[t, r] for r0 <= r < r1 and every token t (out.shape[0] of them) from the packed
    pairs of pair_tokens.pack: up to 4 pairs a row loop (3 when 3 are left, not 2 + 1: a
    row read once for them), each (row, token) with matvec's bits. Only the 32-element
    types of pair_tokens.PAIR_TYPES."""
    n_tok = out.shape[0]
    n_pairs = xq2.shape[0]
    for r in range(r0, r1):
        p = 0
        while p < n_pairs:
            m = min(4, n_pairs - p)
            v = _pair_dots(w, qt, r, xq2, dx2, c2, p, m)
            for j in range(min(2 * m, n_tok - 2 * p)):
                out[2 * p + j, r] = v[j]
            p += m


@njit(inline="always", **_JIT)
def _pair_claims(w, qt, c2, out, g0, g1, xq2, dx2):
    """_dot_rows_pairs on the rows of work items g0..g1 of one matrix (numbered from its first)."""
    a = max(g0, 0)
    b = min(g1, _n_items(out.shape[1]))
    if a < b:
        _dot_rows_pairs(w, qt, a * CHUNK, min(b * CHUNK, out.shape[1]), xq2, dx2, c2, out)


@njit(parallel=True, **_JIT)
def _pairs_kernel(w1, q1, c1, o1, w2, q2, c2, o2, w3, q3, c3, o3, xq2, dx2, nt):
    # a short batch of 1 to 3 matrices of the 32-element types on the same tokens (Q, K, V;
    # gate + up), two tokens a vector (pair_tokens.py), in one parallel region: rows claimed
    # CHUNK at a time as the matvec kernel's; o2 and o3 may have no columns. c1..c3: each
    # matrix's vpdpbusd starts (they depend on its type's code offset)
    claims = np.zeros(1, np.int64)
    for _ in prange(nt):   # one iteration per thread
        n1 = _n_items(o1.shape[1])
        n12 = n1 + _n_items(o2.shape[1])
        n = n12 + _n_items(o3.shape[1])
        step = max(1, n // (CLAIMS_PER_THREAD * nt))
        g0 = _fetch_add(claims, step)
        while g0 < n:
            g1 = min(g0 + step, n)
            _pair_claims(w1, q1, c1, o1, g0, g1, xq2, dx2)
            _pair_claims(w2, q2, c2, o2, g0 - n1, g1 - n1, xq2, dx2)
            _pair_claims(w3, q3, c3, o3, g0 - n12, g1 - n12, xq2, dx2)
            g0 = _fetch_add(claims, step)


@njit(**_JIT)
def _n_items(n_rows):
    return (n_rows + CHUNK - 1) // CHUNK


@njit(inline="always", **_JIT)
def _deq_row(w, qt, r, y, i):
    """y[i] = dequantized row r of w, dispatched on the GGML type id."""
    if _HAS_Q4_K and qt == Q4_K:
        deq_row_q4_k(w, r, y, i)
    elif _HAS_Q4_K_X8 and qt == Q4_K_X8:
        deq_row_q4_k_x8(w, r, y, i)
    elif _HAS_Q6_K and qt == Q6_K:
        deq_row_q6_k(w, r, y, i)
    elif _HAS_Q8_0 and qt == Q8_0:
        deq_row_q8_0(w, r, y, i)
    elif _HAS_Q5_0 and qt == Q5_0:
        deq_row_q5_0(w, r, y, i)
    elif _HAS_Q5_K and qt == Q5_K:
        deq_row_q5_k(w, r, y, i)
    elif _HAS_Q4_0 and qt == Q4_0:
        deq_row_q4_0(w, r, y, i)
    elif _HAS_Q4_1 and qt == Q4_1:
        deq_row_q4_1(w, r, y, i)
    elif _HAS_Q5_1 and qt == Q5_1:
        deq_row_q5_1(w, r, y, i)
    elif _HAS_IQ4_NL and qt == IQ4_NL:
        deq_row_iq4_nl(w, r, y, i)
    elif _HAS_MXFP4 and qt == MXFP4:
        deq_row_mxfp4(w, r, y, i)
    elif _HAS_Q3_K and qt == Q3_K:
        deq_row_q3_k(w, r, y, i)
    elif _HAS_Q2_K and qt == Q2_K:
        deq_row_q2_k(w, r, y, i)
    elif _HAS_IQ4_XS and qt == IQ4_XS:
        deq_row_iq4_xs(w, r, y, i)
    elif _HAS_IQ2_XXS and qt == IQ2_XXS:
        deq_row_iq2_xxs(w, r, y, i)
    elif _HAS_IQ2_XS and qt == IQ2_XS:
        deq_row_iq2_xs(w, r, y, i)
    elif _HAS_IQ2_S and qt == IQ2_S:
        deq_row_iq2_s(w, r, y, i)
    elif _HAS_IQ3_XXS and qt == IQ3_XXS:
        deq_row_iq3_xxs(w, r, y, i)
    elif _HAS_IQ3_S and qt == IQ3_S:
        deq_row_iq3_s(w, r, y, i)
    elif _HAS_IQ1_S and qt == IQ1_S:
        deq_row_iq1_s(w, r, y, i)
    elif _HAS_IQ1_M and qt == IQ1_M:
        deq_row_iq1_m(w, r, y, i)


# Decode matvecs share their work items out by claims on an atomic counter, not by a
# static split of the rows: a thread whose core is slowed (a busy SMT sibling, another
# process) takes fewer claims. On a shared 2-vCPU host whose cores' speeds drift apart
# by up to 25%, 2-thread matvecs measured 3-16% faster in medians than the static split,
# and more so in their slow tails. Each row is computed as before: the same bits.
CLAIMS_PER_THREAD = 8   # the last claim leaves at most ~1/8 of a share unbalanced


@njit(inline="always", **_JIT)
def _claimed_items(claims, n_threads, w1, q1, o1, w2, q2, o2, w3, q3, o3, xq, xd, xs):
    """On one thread: claim runs of work items from claims[0] until none are left. Items
    number o1's rows, then o2's, then o3's (all on the same activations, one row of xq/xd/xs
    and of each output per token; o2 and o3 may have no columns)."""
    n1 = _n_items(o1.shape[1])
    n12 = n1 + _n_items(o2.shape[1])
    n = n12 + _n_items(o3.shape[1])
    step = max(1, n // (CLAIMS_PER_THREAD * n_threads))
    g0 = _fetch_add(claims, step)
    while g0 < n:
        g1 = min(g0 + step, n)
        _claimed_rows(w1, q1, o1, g0, g1, xq, xd, xs)
        _claimed_rows(w2, q2, o2, g0 - n1, g1 - n1, xq, xd, xs)
        _claimed_rows(w3, q3, o3, g0 - n12, g1 - n12, xq, xd, xs)
        g0 = _fetch_add(claims, step)


@njit(**_JIT)
def _claimed_rows(w, qt, out, g0, g1, xq, xd, xs):
    """The rows of out's work items g0..g1 (numbered from this matrix's first; those
    outside it skipped), for every token (row of xq and out). One token (decode): one
    _dot_rows call, so one type dispatch a claim, not an item. More (a short prompt): item
    by item, all tokens on an item's rows while they are in L1, so each weight row is read
    from memory once for all of them."""
    n_rows = out.shape[1]
    a = max(g0, 0)
    b = min(g1, _n_items(n_rows))
    if a < b:
        if xq.shape[0] == 1:
            _dot_rows(w, qt, a * CHUNK, min(b * CHUNK, n_rows), xq[0], xd[0], xs[0], out[0])
        else:
            n_tok = xq.shape[0]
            by_tokens = _has_tokens_rows(qt, n_rows)
            most = _tokens_a_row(qt)
            for g in range(a, b):
                r0 = g * CHUNK
                r1 = min(r0 + CHUNK, n_rows)
                t = 0
                if by_tokens:   # up to `most` tokens a pass, each row unpacked once for them
                    left = (n_tok + most - 1) // most   # passes: as even as can be
                    while left > 0 and n_tok - t >= 2:
                        m = (n_tok - t + left - 1) // left
                        _dot_rows_tokens(w, qt, r0, r1, xq, xd, xs, t, m, out)
                        t += m
                        left -= 1
                for u in range(t, n_tok):
                    _dot_rows(w, qt, r0, r1, xq[u], xd[u], xs[u], out[u])


@njit(parallel=True, **_JIT)
def _matvec_kernel(w1, q1, w2, q2, w3, q3, xq, xd, xs, o1, o2, o3, nt):
    # up to three matrices on the same activations in one parallel region (Q, K, V;
    # gate + up): o2 and o3 may have no columns. One kernel for a decoded token (one row
    # in xq/xd/xs and the outputs) and for a short prompt (a row per token, up to
    # matvec._INT8_MATMUL_MAX_TOKENS): one parallel kernel fewer to compile on a first
    # start. nt: the thread count, passed in (numba's get_num_threads inside a kernel
    # would keep it out of the on-disk cache)
    claims = np.zeros(1, np.int64)
    for _ in prange(nt):   # one iteration per thread
        _claimed_items(claims, nt, w1, q1, o1, w2, q2, o2, w3, q3, o3, xq, xd, xs)


@njit(inline="always", **_JIT)
def _expert_items(claims, n_threads, w1, q1, o1, w2, q2, o2, experts, starts, rows_of, n_per, xq, xd, xs):
    """On one thread: claim runs of work items until none are left. Item g is a CHUNK of rows
    of active expert i = experts[i]'s rows (w[experts[i] * n_per:][:n_per]) in o1's tensor, then
    (numbered after those) in o2's, computed for each of its assignments a in
    starts[i]..starts[i + 1]: activations row rows_of[a] of xq/xd/xs, output row a. All of
    an expert's tokens run on an item's rows while they are in L1. o2 may have no columns."""
    m = experts.shape[0]
    per = _n_items(n_per)
    n1 = m * per
    n = n1 + (m * per if o2.shape[1] > 0 else 0)
    step = max(1, n // (CLAIMS_PER_THREAD * n_threads))
    g0 = _fetch_add(claims, step)
    while g0 < n:
        for g in range(g0, min(g0 + step, n)):
            second = g >= n1
            h = g - n1 if second else g
            i = h // per
            r0 = (h % per) * CHUNK
            r1 = min(r0 + CHUNK, n_per)
            e0 = experts[i] * n_per
            for a in range(starts[i], starts[i + 1]):
                t = rows_of[a]
                if second:
                    _dot_rows(w2[e0:e0 + n_per], q2, r0, r1, xq[t], xd[t], xs[t], o2[a])
                else:
                    _dot_rows(w1[e0:e0 + n_per], q1, r0, r1, xq[t], xd[t], xs[t], o1[a])
        g0 = _fetch_add(claims, step)


@njit(parallel=True, **_JIT)
def _expert_matvec_kernel(w1, q1, w2, q2, experts, starts, rows_of, n_per, xq, xd, xs, o1, o2, nt):
    # every active expert of one or two 3-D tensors (gate and up) with all its tokens, in one
    # parallel region: a layer's whole expert matmul, for a decoded token or a prompt chunk
    claims = np.zeros(1, np.int64)
    for _ in prange(nt):   # one iteration per thread
        _expert_items(claims, nt, w1, q1, o1, w2, q2, o2, experts, starts, rows_of, n_per, xq, xd, xs)


_NO_OUT = np.empty((1, 0), np.float32)   # "no second/third matrix"


@njit(parallel=True, **_JIT)
def _dequant_kernel(w, qt, start, y):
    for i in prange(y.shape[0]):
        _deq_row(w, qt, start + i, y, i)


@njit(**_JIT)
def _dequant_kernel_serial(w, qt, start, y):
    # for callers that run their own threads (the prefill GEMM splits rows across threads)
    for i in range(y.shape[0]):
        _deq_row(w, qt, start + i, y, i)


@njit(parallel=True, **_JIT)
def _dequant_rows_kernel(w, qt, rows, y):
    for i in prange(y.shape[0]):
        _deq_row(w, qt, rows[i], y, i)


# ----------------------------------------------------------------------------- kernels per type set
# A kernel dispatching on the type id at run time compiles every type's code: ~14 s of a
# first start for all of them, where a model uses 3-5. `kernels_for(types)` copies the
# dispatching functions and the kernels above with the flags of the other types False
# (Python function copies reading their own globals; each named after its types, so each
# has its own file in Numba's on-disk cache), made once per type set and process. The
# code of a type is the one definition above, whichever copies contain it: the same bits.

_SPECIALISED = ("_quartered_rows", "_dot_rows", "_has_tokens_rows", "_tokens_a_row", "_dot_rows_tokens", "_deq_row",
                "_claimed_rows", "_claimed_items", "_matvec_kernel", "_pair_dots", "_dot_rows_pairs", "_pair_claims",
                "_pairs_kernel", "_dequant_kernel", "_dequant_kernel_serial", "_dequant_rows_kernel",
                "_expert_items", "_expert_matvec_kernel")   # callees before callers
_SETS: dict = {}         # type set (sorted tuple) -> its kernels
_MODEL_SETS: list = []   # sets registered by use_types, the latest first
_FOR_CALL: dict = {}     # the types of one call -> the kernels that serve it


class KernelSet:
    """The kernels here for a set of type ids (attributes named as the generic ones, without
    the underscore: ks.matvec_kernel, ks.claimed_items, ...)."""

    def __init__(self, qts: tuple) -> None:
        self.types = qts
        g = dict(globals())
        g.update({f"_HAS_{name}": qt in qts for qt, name in _TYPE_NAMES.items()})
        self.suffix = suffix = "_" + "_".join(_TYPE_NAMES[qt] for qt in qts)
        for name in _SPECIALISED:
            generic = globals()[name]
            f = generic.py_func
            copy = FunctionType(f.__code__, g, name + suffix, f.__defaults__, f.__closure__)
            copy.__qualname__, copy.__module__, copy.__doc__ = name + suffix, f.__module__, f.__doc__
            opts = {k: v for k, v in generic.targetoptions.items() if k in ("parallel", "nogil", "inline")}
            g[name] = njit(cache=True, **opts)(copy)
            setattr(self, name[1:], g[name])   # ks.dot_rows, ks.matvec_kernel, ...

    def forward_kernels(self) -> list:
        """The kernels a short prompt and a decoded token compile (the 8-bit matvec /
        short matmul, the row lookup), for compile_progress.warm_up's check. (Not the pairs
        kernel: the two-token warm-up pass compiles it where a matrix takes it, and a model
        whose pair type is only an embedding table never would.)"""
        return [self.matvec_kernel, self.dequant_rows_kernel]


def kernel_set(qts) -> KernelSet:
    """The kernels for exactly these type ids (made on first use)."""
    key = tuple(sorted({int(t) for t in qts}))
    if not all(has_fast_path(t) for t in key):
        raise ValueError(f"no fast path for type ids {key}")
    got = _SETS.get(key)
    if got is None:
        got = _SETS[key] = KernelSet(key)
    return got


def use_types(qts) -> KernelSet | None:
    """Register the fast-path types of a model (as the kernels see them: repacked ids):
    calls on these types use one kernel set for all of them. Returns it (None when the
    model has no fast-path type)."""
    key = tuple(sorted({int(t) for t in qts if has_fast_path(int(t))}))
    if not key:
        return None
    if key in _MODEL_SETS:
        _MODEL_SETS.remove(key)
    _MODEL_SETS.insert(0, key)
    _FOR_CALL.clear()
    ks = kernel_set(key)
    # a cold start compiles the decode matvec first: the forward pass needs it only at
    # its end, when this process would otherwise wait for the second one
    compile_progress.compile_before(
        ks.matvec_kernel, f"from edgeinfer.kernels_cpu import dispatch; dispatch.compile_here({key!r})")
    return ks


def compile_here(qts: tuple) -> None:
    """Compile (or load) the decode matvec of the kernel set for these type ids, with the
    signature the decode path calls it with (read-only weights; int8, float32 and int32
    activation arrays as quantize_act makes them), on one row group of zeros."""
    use_types(qts)
    qt = int(qts[0])
    info = quant_info(qt)
    n_cols = 256
    w = zero_weights(qt, CHUNK, n_cols)
    xq = np.zeros((2, n_cols), np.int8)
    xd = np.zeros((2, n_cols // info.act_block), np.float32)
    xs = np.zeros((2, n_cols // (32 if info.act_block == 32 else 16)), np.int32)
    matmul_int(w, qt, xq, xd, xs, np.empty((2, CHUNK), np.float32))


def zero_weights(qt: int, n_rows: int, n_cols: int) -> np.ndarray:
    """A matrix of zero blocks of type qt, read-only as the model's mapped weights are (the
    signature a compile_here job must give its kernel)."""
    w = np.zeros((n_rows, row_bytes(qt, n_cols)), np.uint8)
    w.flags.writeable = False
    return w


def model_set() -> KernelSet | None:
    """The kernel set of the latest model registered with use_types (None before any)."""
    return kernel_set(_MODEL_SETS[0]) if _MODEL_SETS else None


def kernels_for(*qts: int) -> KernelSet:
    """The kernel set serving a call on these types: the latest registered model set that
    holds them all, else the set of exactly these types."""
    got = _FOR_CALL.get(qts)
    if got is None:
        need = set(qts)
        key = next((s for s in _MODEL_SETS if need <= set(s)), tuple(sorted(need)))
        got = _FOR_CALL[qts] = kernel_set(key)
    return got


def has_fast_path(qt: int) -> bool:
    """Whether the kernels here take this type id (the registry's `fast` types, quant_types)."""
    return qt in FAST_IDS


def matvec_fast(w_raw: np.ndarray, qt: int, xq, xd, xs, out) -> None:
    """out[r] = row r . activations (quantized by matvec.quantize_activations) for a fast-path type."""
    if compile_progress._pending:
        compile_progress.wait_for(kernels_for(qt).matvec_kernel)
    kernels_for(qt).matvec_kernel(w_raw, qt, w_raw, qt, w_raw, qt, xq[None], xd[None], xs[None], out[None],
                                   _NO_OUT, _NO_OUT, get_threads())


def matmul_int(w_raw: np.ndarray, qt: int, xq, xd, xs, out) -> None:
    """out[t, r] = row r . token t's 8-bit activations (xq/xd/xs with one row per token):
    each the same bits as matvec_fast on token t alone."""
    matmul_int_many([w_raw], [qt], xq, xd, xs, [out])


def matmul_int_many(ws: list, qts: list, xq, xd, xs, outs: list) -> None:
    """matmul_int for 1 to 3 matrices sharing the activations (Q, K, V; gate and up), in one
    parallel region: one launch, and a thread done with one matrix's rows takes the next's."""
    qts = [int(q) for q in qts]
    ks = kernels_for(*qts)
    if compile_progress._pending:
        compile_progress.wait_for(ks.matvec_kernel)
    n = len(ws)
    w, q, o = list(ws) + [ws[0]] * (3 - n), qts + [qts[0]] * (3 - n), list(outs) + [_NO_OUT] * (3 - n)
    ks.matvec_kernel(w[0], q[0], w[1], q[1], w[2], q[2], xq, xd, xs, o[0], o[1], o[2], get_threads())


def matmul_pairs(ws: list, qts: list, xq, xd, outs: list) -> None:
    """matmul_int for 2 or more tokens of 1 to 3 matrices of pair_tokens.PAIR_TYPES on the
    same activations, on a host with 512-bit VNNI (pair_tokens.host_has_pairs): two tokens a
    vector, the same bits, in one parallel region."""
    qts = [int(q) for q in qts]
    xq2, dx2, starts = pair_tokens.packed(xq, xd, qts)
    ks = kernels_for(*qts)
    if compile_progress._pending:
        compile_progress.wait_for(ks.pairs_kernel)
    args = []
    for k in range(3):
        if k < len(ws):
            args += [ws[k], qts[k], starts[k], outs[k]]
        else:
            args += [ws[0], qts[0], starts[0], np.empty((outs[0].shape[0], 0), np.float32)]
    ks.pairs_kernel(*args, xq2, dx2, get_threads())


def dequantize_fast(w_raw: np.ndarray, qt: int, start: int, y: np.ndarray) -> None:
    """y[i] = dequantized row start + i of w, for a fast-path type; y float32 (n, n_cols) C-contiguous."""
    kernels_for(qt).dequant_kernel(w_raw, qt, start, y)


def dequantize_fast_serial(w_raw: np.ndarray, qt: int, start: int, y: np.ndarray) -> None:
    """dequantize_fast on the calling thread only (no parallel region; releases the GIL)."""
    kernels_for(qt).dequant_kernel_serial(w_raw, qt, start, y)


def dequantize_rows_fast(w_raw: np.ndarray, qt: int, rows: np.ndarray, y: np.ndarray) -> None:
    """y[i] = dequantized row rows[i] of w (int64 ids, validated by the caller)."""
    kernels_for(qt).dequant_rows_kernel(w_raw, qt, rows, y)


def expert_matvec_fast(ws: list, qts: list, experts, starts, rows_of, n_per: int, xq, xd, xs, outs: list) -> None:
    """outs[i][a] = rows of expert experts[e] in the 3-D tensor ws[i] (as (n_expert * n_per,
    row_bytes)) . activations row rows_of[a], for the assignments a of each active expert e
    (starts[e]..starts[e + 1]); one or two tensors."""
    qts = [int(q) for q in qts]
    ks = kernels_for(*qts)
    if compile_progress._pending:
        compile_progress.wait_for(ks.expert_matvec_kernel)
    w2, q2, o2 = (ws[1], qts[1], outs[1]) if len(ws) == 2 else (ws[0], qts[0], _NO_OUT)
    ks.expert_matvec_kernel(ws[0], qts[0], w2, q2, experts, starts, rows_of, n_per, xq, xd, xs, outs[0], o2,
                            get_threads())


def matvec_fast_many(ws: list, qts: list, xq, xd, xs, outs: list) -> None:
    """matvec_fast for 2 or 3 matrices sharing the quantized activations, in one call."""
    if len(ws) > 3:
        for w, qt, out in zip(ws, qts, outs):
            matvec_fast(w, qt, xq, xd, xs, out)
        return
    matmul_int_many(ws, qts, xq[None], xd[None], xs[None], [out[None] for out in outs])
