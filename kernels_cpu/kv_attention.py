"""Causal GQA attention over an F16 KV cache, in llama.cpp's exact floating-point order.

Why the exact order: small models such as Gemma 3 270M turn a last-bit difference in one
attention output into a different greedy token a few steps later, so matching llama.cpp
token for token needs the same roundings in the same order, not just "close" math.
llama.cpp's CPU decode path (no flash attention) computes, per query row and head:

1. KQ = K (F16) . Q rounded to F16, one `ggml_vec_dot_f16` per key: 32 float32 slots, slot
   e % 32 accumulates element e in order (the F16 x F16 products are exact in float32),
   then the fixed AVX reduction of the 32 slots (`reduce32`) into a double; elements past
   the last multiple of 32 are added in double.
2. Softmax over the keys: w = KQ * kq_scale, masked keys -inf, minus the row max,
   exp by `ggml_v_expf` (a polynomial, not libm's expf) 8 keys at a time; each group of 8
   is summed in float32 (`hsum8`) and the group sums in double; the weights are scaled
   by float32(1 / sum).
3. Out = V^T (F16) . weights rounded to F16, again `ggml_vec_dot_f16` over the keys: key
   j goes to slot j % 32, where j is the key's slot in the cache (its position in a fresh
   sequence; llama.cpp pads the key count to 256, so there are no leftovers).

On AVX-512 CPUs the order is that of llama.cpp's AVX-512 build (ggml_math.AVX512): 64 slots
of 16 lanes (SLOTS) ending in _mm512_reduce_add_ps, the exp of ggml_math.expf512_any, and
the softmax groups of 16 keys (LANES), each summed by that reduction.

A masked key contributes exactly zero everywhere, so the kernels skip it. The numpy
reference of the same math is `edgeinfer.backends.base.Backend.attention`; the tests require
the two to agree bit for bit.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import compile_progress
from .f16 import f16_round, f16_to_f32, has_f16c, round_f16
from .f16 import f16_value as _f16
from .ggml_math import AVX512, LANES, expf512_any, expf_parts, hsum_vec, pow2_f64
from .kv_attention_ir import (KEYS, KQ_HEAD_SIZES, SLOTS, dot_f16_32, kq_dots_32, kq_dots_64, kq_dots_128, kq_dots_256,
                              via_f16, wslots_2, wslots_4, wslots_8, wslots_16)
from .blas_sgemm import sgemm_address
from .prompt_attention import attention_team, softmax_rows_f16
from .threads import apply_threads, get_threads, on_a_worker, worker_pool

_JIT = dict(cache=True, nogil=True)  # no fastmath: the order of every float op matters here


_VECTOR_F16 = has_f16c()


@njit(**_JIT)
def dot_f16_scalar(k_row, q16, n_vec, acc, n_slots):
    """dot_f16_32 without F16C: the same order, element by element."""
    acc[:] = 0.0
    for c in range(0, n_vec, n_slots):
        for lane in range(n_slots):
            acc[lane] += _f16(k_row[c + lane]) * q16[c + lane]
    return reduce_slots(acc)


@njit(**_JIT)
def dot_f16_vector(k_row, q16, n_vec):
    return dot_f16_32(k_row, q16, n_vec)


@njit(inline="always", **_JIT)
def reduce_slots(acc):
    """ggml_vec_dot_f16's reduction of its SLOTS float32 slots on this CPU's llama.cpp build."""
    if AVX512:
        x = np.empty(16, np.float32)
        for i in range(16):
            x[i] = np.float32(np.float32(acc[i] + acc[32 + i]) + np.float32(acc[16 + i] + acc[48 + i]))
        return hsum_vec(x, 0)
    return reduce32(acc)


@njit(inline="always", **_JIT)
def reduce32(acc):
    """GGML_F32x8_REDUCE of 4 x <8 x float>: (s0+s2) + (s1+s3), then the 128-bit halves,
    then two horizontal adds."""
    x = np.empty(8, np.float32)
    for i in range(8):
        x[i] = np.float32(np.float32(acc[i] + acc[16 + i]) + np.float32(acc[8 + i] + acc[24 + i]))
    t0 = np.float32(x[0] + x[4])
    t1 = np.float32(x[1] + x[5])
    t2 = np.float32(x[2] + x[6])
    t3 = np.float32(x[3] + x[7])
    return np.float32(np.float32(t0 + t1) + np.float32(t2 + t3))


@njit(inline="always", **_JIT)
def _round_f16(x):
    """The float32 value of x rounded to the nearest float16 (ties to even)."""
    a = abs(np.float64(x))
    if a >= 65520.0:
        r = np.inf
    else:
        if a < 6.103515625e-05:  # F16 subnormal range: a fixed quantum of 2^-24
            quantum = 5.9604644775390625e-08
        else:
            m, e = math.frexp(a)
            quantum = 2.0 ** (e - 11)
        magic = 1.5 * quantum * 4503599627370496.0  # adding it rounds to a multiple of quantum
        r = (a + magic) - magic
    return np.float32(-r if x < 0 else r)


@njit(**_JIT)
def _allowed(kp, qp, window):
    return kp <= qp and (window <= 0 or qp - kp < window)


@njit(**_JIT)
def _scores_and_weights(q16, k_bits, g, kpos, qp, window, kq_scale, w, sink, n_slots=SLOTS):
    """Fill w[:S] with the F16-rounded softmax weights of one query row (q16: F16 values),
    a key at a time (CPUs without F16C, head sizes without the 16-key kernels)."""
    hd = q16.shape[0]
    n_vec = hd - hd % SLOTS
    acc = np.zeros(SLOTS, np.float32)
    for j in range(k_bits.shape[0]):
        if not _allowed(kpos[j], qp, window):
            continue   # _softmax_f16 gives it weight 0 whatever w[j] holds
        if _VECTOR_F16:
            dot = np.float64(dot_f16_32(k_bits[j, g], q16, n_vec))
        else:
            dot = np.float64(dot_f16_scalar(k_bits[j, g], q16, n_vec, acc, n_slots))
        for d in range(n_vec, hd):  # leftovers, in double
            dot += np.float64(_f16(k_bits[j, g, d])) * np.float64(q16[d])
        w[j] = np.float32(dot)
    _softmax_f16(w, kpos, qp, window, kq_scale, sink)


@njit(**_JIT)
def _weighted_values(w, v_bits, g, out):
    """out[d] = sum_j w[j] * V[j, d] as ggml_vec_dot_f16 over the keys (key j in slot j % SLOTS).
    Keys outer, dims inner (vectorized): each (slot, dim) still sums its keys in order."""
    n_keys, hdv = v_bits.shape[0], v_bits.shape[2]
    acc = np.zeros((SLOTS, hdv), np.float32)
    for j in range(n_keys):
        wj = w[j]
        if wj != 0.0:  # a zero weight adds exactly +0
            row = acc[j & (SLOTS - 1)]
            for d in range(hdv):
                row[d] += _f16(v_bits[j, g, d]) * wj
    _reduce_slots(acc, out)


@njit(inline="always", **_JIT)
def _slot_pair_sums(acc, i, d):
    """reduce32's first step for slot group i of dim d: (s_i + s_16+i) + (s_8+i + s_24+i)."""
    return np.float32(np.float32(acc[i, d] + acc[16 + i, d]) + np.float32(acc[8 + i, d] + acc[24 + i, d]))


@njit(inline="always", **_JIT)
def _slot_sums512(acc, i, d):
    """GGML_F32x16_REDUCE's first steps for lane i of dim d: (s_i + s_32+i) + (s_16+i + s_48+i)."""
    return np.float32(np.float32(acc[i, d] + acc[32 + i, d]) + np.float32(acc[16 + i, d] + acc[48 + i, d]))


@njit(inline="always", **_JIT)
def _lane_sums512(acc, k, d):
    """_mm512_reduce_add_ps's first two steps for lane k < 4 (x_k + x_8+k) + (x_4+k + x_12+k)."""
    return np.float32(np.float32(_slot_sums512(acc, k, d) + _slot_sums512(acc, k + 8, d))
                      + np.float32(_slot_sums512(acc, k + 4, d) + _slot_sums512(acc, k + 12, d)))


@njit(**_JIT)
def _reduce_slots(acc, out):
    """reduce_slots of the SLOTS slot rows for every dim at once (lane-wise over the dims):
    one loop over the dims with the whole reduction inside (eight loops over the dims, one
    per slot group, made LLVM emit eight vectorized copies: a quarter of the kernel's IR)."""
    if AVX512:
        for d in range(out.shape[0]):
            out[d] = np.float32(np.float32(_lane_sums512(acc, 0, d) + _lane_sums512(acc, 2, d))
                                + np.float32(_lane_sums512(acc, 1, d) + _lane_sums512(acc, 3, d)))
        return
    for d in range(out.shape[0]):
        t0 = np.float32(_slot_pair_sums(acc, 0, d) + _slot_pair_sums(acc, 4, d))
        t1 = np.float32(_slot_pair_sums(acc, 1, d) + _slot_pair_sums(acc, 5, d))
        t2 = np.float32(_slot_pair_sums(acc, 2, d) + _slot_pair_sums(acc, 6, d))
        t3 = np.float32(_slot_pair_sums(acc, 3, d) + _slot_pair_sums(acc, 7, d))
        out[d] = np.float32(np.float32(t0 + t1) + np.float32(t2 + t3))


@njit(inline="always", **_JIT)
def _kq_blocks(q16, k_bits, g, n_blocks, w, hd):
    """_make_kq_dots' kernel for head size hd (a constant where inlined: one branch stays)."""
    if hd == 64:
        kq_dots_64(q16, k_bits, g, n_blocks, w)
    elif hd == 128:
        kq_dots_128(q16, k_bits, g, n_blocks, w)
    elif hd == 256:
        kq_dots_256(q16, k_bits, g, n_blocks, w)
    else:
        kq_dots_32(q16, k_bits, g, n_blocks, w)


@njit(inline="always", **_JIT)
def _weighted_blocks(w, lo, hi, v_bits, g, acc, hdv):
    """_make_weighted_slots' kernel for value size hdv (a constant where inlined)."""
    if hdv == 64:
        wslots_4(w, lo, hi, v_bits, g, acc)
    elif hdv == 128:
        wslots_8(w, lo, hi, v_bits, g, acc)
    elif hdv == 256:
        wslots_16(w, lo, hi, v_bits, g, acc)
    else:
        wslots_2(w, lo, hi, v_bits, g, acc)


@njit(**_JIT)
def _seen_slots(kpos, qpos, window):
    """(n_tok, 2): for each query, the slots from the first to the last key it sees, lo..hi
    (a sliding window sees a short run of a long cache); lo = hi where it sees none. lo is
    rounded down to a multiple of LANES: the softmax sums its weights in groups of LANES
    slots counted from slot 0, and groups counted from elsewhere round differently."""
    seen = np.zeros((qpos.shape[0], 2), np.int64)
    for t in range(qpos.shape[0]):
        lo, hi = kpos.shape[0], 0
        for j in range(kpos.shape[0]):
            if _allowed(kpos[j], qpos[t], window):
                lo = min(lo, j)
                hi = j + 1
        lo = min(lo, hi)
        seen[t, 0], seen[t, 1] = lo - lo % LANES, hi
    return seen


@njit(inline="always", **_JIT)
def _attend_one(q16, k_bits, v_bits, g, kpos, qp, window, kq_scale, lo, hi, w, out, hd, hdv, sink):
    """out = attention of one query row and head, the numbers of _scores_and_weights and
    _weighted_values, computing only the slots lo..hi (_seen_slots): the others have weight
    0. w: scratch for a weight per slot. hd, hdv: the head sizes, constants of the kernel
    it is inlined into (only their 16-key kernels are compiled)."""
    if hi <= lo:
        out[:] = 0.0
        return
    nb = (hi - lo) // KEYS
    _kq_blocks(q16, k_bits[lo:], g, nb, w[lo:], hd)
    for j in range(lo + nb * KEYS, hi):
        w[j] = dot_f16_32(k_bits[j, g], q16, q16.shape[0])
    _softmax_f16(w[lo:hi], kpos[lo:hi], qp, window, kq_scale, sink)
    acc = np.zeros((SLOTS, v_bits.shape[2]), np.float32)
    _weighted_blocks(w, lo, hi, v_bits, g, acc, hdv)
    _reduce_slots(acc, out)


@njit(**_JIT)
def _softmax_f16(w, kpos, qp, window, kq_scale, sink):
    """In place: w[j] = key j's dot (float32) -> its softmax weight rounded to F16, steps
    2 and 3a of the module docstring, in passes that vectorize (the exp branch-free:
    below 2^-126 it is 0, as ggml's). Masked keys get 0 whatever w[j] held. `sink`: the
    head's attention sink (-inf: none), a logit with no value that takes part in the max
    and, through libm's expf, in the sum after the keys (ggml's soft_max sinks)."""
    n = w.shape[0]
    neg_inf = np.float32(-np.inf)
    mx = sink
    for j in range(n):
        if _allowed(kpos[j], qp, window):
            s = np.float32(w[j] * kq_scale)
            w[j] = s
            if s > mx:
                mx = s
        else:
            w[j] = neg_inf
    for j in range(n):
        if AVX512:
            w[j] = expf512_any(np.float32(w[j] - mx))
        else:
            nn, jj = expf_parts(np.float32(w[j] - mx))
            k = pow2_f64(np.int64(max(nn, np.float32(-127.0))))
            e = np.float32(np.float64(np.float32(jj + np.float32(1.0))) * k)
            w[j] = np.float32(0.0) if nn < -126.0 else e
    total = 0.0
    n8 = n - n % LANES
    for c in range(0, n8, LANES):
        total += np.float64(hsum_vec(w, c))
    if n8 < n:
        e = np.zeros(LANES, np.float32)
        for lane in range(n - n8):
            e[lane] = w[n8 + lane]
        total += np.float64(hsum_vec(e, 0))
    if sink > neg_inf:
        total += np.float64(math.exp(np.float32(sink - mx)))
    inv = np.float32(1.0 / total)
    for j in range(n):
        if _VECTOR_F16:
            w[j] = via_f16(np.float32(w[j] * inv))
        else:
            w[j] = f16_round(np.float32(w[j] * inv))


def _make_attention_rows(hd: int, hdv: int):
    """The attention kernel for heads of hd (K) and hdv (V) elements: the 16-key kernels
    for those sizes where they exist (32, 64, 128, 256; with F16C), else the per-key loops
    (hd = hdv = 0). One kernel per head size, compiled on first use: a model compiles only
    its own (hd, hdv are closure constants, so the other sizes' branches are pruned before
    typing; Numba's cache keys a closure by their values)."""
    HD, HDV = hd, hdv

    @njit(parallel=True, **_JIT)
    def attention_rows(q16, k_bits, v_bits, kpos, qpos, window, kq_scale, sinks, out, n_slots):
        """One job per (query row, head): many queries (prefill) keep every thread busy."""
        n_tok, n_head, _ = q16.shape
        group = n_head // k_bits.shape[1]
        seen = _seen_slots(kpos, qpos, window)
        for job in prange(n_tok * n_head):
            t = job // n_head
            h = job % n_head
            w = np.empty(k_bits.shape[0], np.float32)
            if HD > 0:
                _attend_one(q16[t, h], k_bits, v_bits, h // group, kpos, qpos[t], window, kq_scale,
                            seen[t, 0], seen[t, 1], w, out[t, h], HD, HDV, sinks[h])
            else:
                _scores_and_weights(q16[t, h], k_bits, h // group, kpos, qpos[t], window, kq_scale, w, sinks[h],
                                    n_slots)
                _weighted_values(w, v_bits, h // group, out[t, h])
    return attention_rows


_ROWS_KERNELS: dict = {}
_FAST_HEAD_SIZES = (32, 64, 128, 256)


def attention_kernel(hd: int, hdv: int):
    """The compiled attention kernel for these head sizes (made on first use)."""
    key = (hd, hdv) if _VECTOR_F16 and hd in KQ_HEAD_SIZES and hdv in _FAST_HEAD_SIZES else (0, 0)
    kernel = _ROWS_KERNELS.get(key)
    if kernel is None:
        kernel = _ROWS_KERNELS[key] = _make_attention_rows(*key)
        # the second process's second job (after the row quantizer): a prompt's first layer needs it
        compile_progress.compile_elsewhere(
            kernel, f"from edgeinfer.kernels_cpu import kv_attention; kv_attention.compile_here({int(hd)}, {int(hdv)})", 1)
    return kernel


def compile_here(hd: int, hdv: int) -> None:
    """Compile (or load) the attention kernel for these head sizes with the signature
    `attention` calls it with, on a few dummy rows."""
    n_slots = SLOTS
    q = np.ones((2, 2, hd), np.float32)
    k, v = np.ones((n_slots, 1, hd), np.float16), np.ones((n_slots, 1, hdv), np.float16)
    attention(q, k, v, np.arange(n_slots), np.array([n_slots - 2, n_slots - 1]), 1.0, 0)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, kpos: np.ndarray, qpos: np.ndarray,
              kq_scale: float, window: int = 0, sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal GQA attention -> (n_tok, n_head, hd_v) float32.

    q (n_tok, n_head, hd) float32; k (S, n_kv_head, hd) and v (S, n_kv_head, hd_v) float16
    (the cache's layer view, slot order); kpos (S,) the keys' positions, qpos (n_tok,) the
    queries'. A query at p sees keys with kpos <= p and, with window > 0, p - kpos < window.
    sinks: (n_head,) float32 attention sinks, or None.
    """
    if k.dtype != np.float16 or v.dtype != np.float16:
        raise TypeError(f"attention reads an F16 cache, got K {k.dtype} and V {v.dtype}")
    apply_threads()
    q16 = round_f16(q)
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), np.float32)
    kernel = attention_kernel(q.shape[2], v.shape[2])
    if compile_progress._pending:
        compile_progress.wait_for(kernel)
    kernel(q16, np.ascontiguousarray(k).view(np.uint16), np.ascontiguousarray(v).view(np.uint16),
           np.ascontiguousarray(kpos, dtype=np.int64), np.ascontiguousarray(qpos, dtype=np.int64), int(window),
           np.float32(kq_scale), head_sinks(sinks, q.shape[1]), out, SLOTS)
    return out


def head_sinks(sinks: np.ndarray | None, n_head: int) -> np.ndarray:
    """The kernels' per-head sink vector: -inf for every head when the model has none (a
    sink of -inf changes no bit of the softmax)."""
    if sinks is None:
        return np.full(n_head, -np.inf, np.float32)
    sinks = np.ascontiguousarray(sinks, np.float32).reshape(-1)
    if sinks.shape[0] != n_head:
        raise ValueError(f"{sinks.shape[0]} attention sinks for {n_head} heads")
    return sinks


# Above this many query rows (long prefill chunks) the exact per-key loops cost more than
# they are worth: llama.cpp itself switches to other kernels for batches, so there is no
# bit-exact target there. `attention_blas` does the same math with matrix products.
EXACT_MAX_QUERIES = 64


_BLAS_QUERY_BLOCK = 64  # query rows per block: each block multiplies only the keys it sees


def attention_blas(q: np.ndarray, k: np.ndarray, v: np.ndarray, kpos: np.ndarray, qpos: np.ndarray,
                   kq_scale: float, window: int = 0, sinks: np.ndarray | None = None) -> np.ndarray:
    """`attention` through BLAS matrix products: same roundings at the boundaries (Q and
    the weights in F16, sums in double), float order of the BLAS library inside.

    The queries go in blocks of _BLAS_QUERY_BLOCK rows, each against only the keys it can
    see (causal and window bounds of its positions): a prefill chunk does about half the
    products of the full square. Where numpy's sgemm can be called from Numba and every
    block's keys are a run of slots, the (KV head, block) pieces run in one parallel region
    (prompt_attention.attention_team); else, with -t > 1, the blocks are shared out across
    the worker threads by their cost (BLAS itself runs single-threaded beside Numba; numpy
    releases the GIL in every large op here)."""
    qpos = np.asarray(qpos)
    kpos = np.asarray(kpos)
    if window:  # a sliding-window layer never looks further back than its window
        keep = kpos > np.min(qpos) - window
        if not keep.all():
            k, v, kpos = k[keep], v[keep], kpos[keep]
    q = round_f16(q)
    n = q.shape[0]
    sinks = head_sinks(sinks, q.shape[1])
    out = np.empty((n, q.shape[1], v.shape[2]), np.float32)
    blocks = []  # (first row, end row, the keys' slots: a slice or an index array)
    for a in range(0, n, _BLAS_QUERY_BLOCK):
        b = min(a + _BLAS_QUERY_BLOCK, n)
        seen = kpos <= qpos[a:b].max()
        if window:
            seen &= kpos > qpos[a:b].min() - window
        blocks.append((a, b, _as_slice(np.flatnonzero(seen))))
    fn = sgemm_address()
    if fn and not on_a_worker() and all(isinstance(keys, slice) for _, _, keys in blocks):
        # every block's keys a run of slots (slots in position order): one parallel region
        pieces = np.array(sorted(((h, a, b, keys.start, keys.stop) for h in range(k.shape[1])
                                  for a, b, keys in blocks), key=lambda p: -(p[2] - p[1]) * (p[4] - p[3])),
                          np.int64).reshape(-1, 5)
        apply_threads()
        attention_team(fn, q, f16_to_f32(k), f16_to_f32(v), np.ascontiguousarray(kpos, dtype=np.int64),
                       np.ascontiguousarray(qpos, dtype=np.int64), np.float32(kq_scale), int(window), sinks,
                       pieces, out, get_threads())
        return out
    # on the worker pool: (n_kv, hd, S) and (n_kv, S, hd_v) float32, once for all threads
    k = f16_to_f32(k).transpose(1, 2, 0)
    v = f16_to_f32(v).transpose(1, 0, 2)

    def run(mine):
        for a, b, keys in mine:
            out[a:b] = _attention_blas_rows(q[a:b], k[:, :, keys], v[:, keys], kpos[keys], qpos[a:b],
                                            kq_scale, window, sinks)

    n_threads = get_threads()
    if n_threads > 1 and len(blocks) > 1:
        list(worker_pool(n_threads).map(run, _share_out(blocks, n_threads)))
    else:
        run(blocks)
    return out


def _as_slice(idx: np.ndarray):
    """A run of consecutive slots as a slice (a view, no copy); else the index array."""
    if idx.size and idx[-1] - idx[0] + 1 == idx.size:
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _share_out(blocks: list, n_parts: int) -> list[list]:
    """Blocks into n_parts lists of about equal cost (rows x keys), largest first to the
    least loaded."""
    def cost(blk):
        keys = blk[2]
        return (blk[1] - blk[0]) * (keys.stop - keys.start if isinstance(keys, slice) else len(keys))
    parts: list[list] = [[] for _ in range(n_parts)]
    load = [0] * n_parts
    for blk in sorted(blocks, key=cost, reverse=True):
        i = load.index(min(load))
        parts[i].append(blk)
        load[i] += cost(blk)
    return [p for p in parts if p]


def _attention_blas_rows(q, k, v, kpos, qpos, kq_scale, window, sinks):
    # q (n, n_head, hd) already F16-rounded; k (n_kv, hd, S), v (n_kv, S, hd_v) float32
    n, n_head, hd = q.shape
    n_kv = k.shape[0]
    group = n_head // n_kv
    # one GEMM per KV head for its whole group of query heads: rows (head in group, query)
    qg = np.ascontiguousarray(q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3)).reshape(n_kv, group * n, hd)
    scores = qg @ k  # (n_kv, group * n, S)
    row_sinks = np.repeat(sinks, n)  # rows (KV head, head in group, query) = head * n + query
    softmax_rows_f16(scores.reshape(-1, scores.shape[-1]), np.float32(kq_scale),
                     np.ascontiguousarray(kpos, dtype=np.int64),
                     np.ascontiguousarray(qpos, dtype=np.int64), int(window), row_sinks)
    out = (scores @ v).reshape(n_head, n, -1)  # rows were (KV head, head in group, query)
    return np.ascontiguousarray(out.transpose(1, 0, 2), dtype=np.float32)

