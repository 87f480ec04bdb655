"""gemm_kquant's activations: Q8_K rows packed block-major, tokens padded to the GEMM's step.

One block of every token side by side, so the token loop reads each block's activations
as one sequential stream, with the per-32 sums (Q4_K's min terms) and per-16 sums (the
per-16 types' offsets) beside them as i16 pairs; `pack_segments` packs a mixture of
experts' token segments one after the other in one buffer.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import gemm_parallel

TOKENS = gemm_parallel.TOKENS_PAD   # the GEMM's token step: packed segments pad to it
_JIT = dict(cache=True, nogil=True)


def pack_activations(xq: np.ndarray, xd: np.ndarray, xs: np.ndarray):
    """Q8_K rows (quantize_activation_rows: xq (n, K) int8, xd (n, K/256), xs (n, K/16)
    sums of 16) -> the kernel's inputs, block-major (one block of every token side by
    side: the token loop reads each block's activations as one sequential stream), tokens
    padded to a multiple of TOKENS with zeros: xq (K/256, n_pad, 256), xd (K/256, n_pad),
    and xb (K/256, n_pad, 12) holding per block the per-32 sums (Q4_K's min terms), then
    the per-16 sums (Q6_K's offset), as i16 pairs (2i, 2i + 1) in one int32 each."""
    n, k = xq.shape
    nb, n_pad = k // 256, -(-n // TOKENS) * TOKENS
    # block bi of token t at row bi * n_pad + t (pack_segments' layout for one segment,
    # without its bookkeeping: ~15 us of numpy a call)
    pq, pd, pb = _pack(xq, xd, xs, np.arange(n), np.full(n, n_pad), nb * n_pad, zeroed=False)
    pq, pd, pb = pq.reshape(nb, n_pad, 256), pd.reshape(nb, n_pad), pb.reshape(nb, n_pad, 12)
    for a in (pq, pd, pb):   # only the padding tokens need zeros: every other row is written
        a[:, n:] = 0
    return pq, pd, pb


def pack_segments(xq: np.ndarray, xd: np.ndarray, xs: np.ndarray, counts):
    """Q8_K rows in consecutive segments (counts[j] rows each: an expert's tokens) packed as
    `pack_activations` packs each segment, one after the other: returns ((xq, xd, xb), seg)
    with segment j in packed rows seg[j]..seg[j + 1] of xq (P, K), xd (P, K/256) and xb
    (P, K/256 * 12), which `_segment` views in the kernel's layout."""
    n, k = xq.shape
    nb = k // 256
    seg, which, pos = gemm_parallel.segment_layout(counts)
    # block bi of row i goes to 256-byte row seg * nb + bi * n_pad + pos of the packed buffer
    xq_p, xd_p, xb = _pack(xq, xd, xs, seg[which] * nb + pos, np.diff(seg)[which], int(seg[-1]) * nb)
    p = int(seg[-1])
    return (xq_p.reshape(p, k), xd_p.reshape(p, nb), xb.reshape(p, nb * 12)), seg


def _pack(xq, xd, xs, first, stride, total, zeroed=True):
    """Packed buffers of `total` block rows (xq (total, 256), xd (total,), xb (total, 12))
    with block bi of input row i at row first[i] + bi * stride[i], the rows no input row
    fills zeroed (zeroed=False: left to the caller). Compiled: numpy's gather and scatter
    steps cost ~50 us a call, as much as a short prompt's product on a small matrix."""
    new = np.zeros if zeroed else np.empty
    xq_p = new((total, 256), np.int8)
    xd_p = new(total, np.float32)
    xb = new((total, 12), np.int32)
    pack = _pack_rows_parallel if xq.shape[0] >= PARALLEL_PACK_ROWS else _pack_rows
    pack(np.ascontiguousarray(xq, np.int8), np.ascontiguousarray(xd, np.float32),
         np.ascontiguousarray(xs, np.int32), first, stride, xq_p, xd_p, xb.view(np.int16))
    return xq_p, xd_p, xb


@njit(inline="always", **_JIT)
def _pack_row(xq, xd, xs, first, stride, pq, pd, pb16, i):
    """Block bi of input row i into packed row first[i] + bi * stride[i] of zeroed outputs:
    its bytes, its scale, its per-32 sums then its per-16 sums as i16 (|s| <= 32 * 128)."""
    for bi in range(xd.shape[1]):
        r = first[i] + bi * stride[i]
        pq[r, :] = xq[i, 256 * bi:256 * bi + 256]
        pd[r] = xd[i, bi]
        g = 16 * bi
        for j in range(8):
            pb16[r, j] = xs[i, g + 2 * j] + xs[i, g + 2 * j + 1]
        for j in range(16):
            pb16[r, 8 + j] = xs[i, g + j]


@njit(**_JIT)
def _pack_rows(xq, xd, xs, first, stride, pq, pd, pb16):
    for i in range(xq.shape[0]):
        _pack_row(xq, xd, xs, first, stride, pq, pd, pb16, i)


@njit(parallel=True, **_JIT)
def _pack_rows_parallel(xq, xd, xs, first, stride, pq, pd, pb16):
    for i in prange(xq.shape[0]):   # rows go to distinct packed rows
        _pack_row(xq, xd, xs, first, stride, pq, pd, pb16, i)


PARALLEL_PACK_ROWS = 32   # from here the rows pack on every thread (512 x 2048, 2 threads: 0.44 -> 0.09 ms)


def warm_pack() -> None:
    """Compile (or load) the parallel packer too: the warm-up's short prompt takes the serial one."""
    n = PARALLEL_PACK_ROWS
    _pack(np.zeros((n, 256), np.int8), np.zeros((n, 1), np.float32), np.zeros((n, 16), np.int32),
          np.arange(n), np.full(n, n), n)
