"""Q4_K_X8: a copy of a Q4_K matrix with its rows interleaved in groups of 8.

Why: a decoded token reads every weight once, so decode runs at the speed the kernel
streams weights from memory. With the GGUF layout, the Q4_K kernel works on 4 rows at
a time, each its own stream, with the per-row work (scale decode, sums across lanes)
repeated per row. Interleaved, one 64-byte load holds the same 16 bytes of 4 rows (row
k in 128-bit lane k), one load brings 4 rows' block heads, and each thread reads one
sequential stream. llama.cpp's CPU backend makes the same kind of copy at load for the
same reason ("CPU_REPACK"). Measured on a 4096 x 14336 matrix, 2 threads, interleaved
A/B: 22.5-23.6 -> 26.8-28.2 GB/s from memory (80-92% of the read bandwidth), 36-39 ->
50-54 GB/s L2-resident.

The layout (ir_helpers.X8_BLOCK bytes a block, the array keeps the (n_rows, row_bytes)
shape): for each group of 8 rows and each block, the 8 rows' 16-byte heads (d, dmin, 12
scale bytes), then 8 pieces of 128 bytes, piece t holding qs bytes 16t..16t+16 of each of
the 8 rows. Every kernel that reads Q4_K reads Q4_K_X8 too (decode, the <= 64-token row
path, the prefill tiles, dequantization) and gives the same bits.

Only hosts whose kernels take the 512-bit path (AVX512-BW) repack. On AVX2 the layout's
loop (two rows a vector) computes faster than the plain layout's, but reads slower from
memory, one stream a thread against four: 4096 x 14336, 2 threads, Zen 3: 20.8 against
26.0 GB/s.
"""
from __future__ import annotations

import os

import numpy as np
from numba.core.registry import cpu_target

from .ir_helpers import X8_ROWS, target_features
from .quant_kernels import Q4_K, Q4_K_X8

# EDGEINFER_NO_REPACK=1 keeps every weight in the file's layout (A/B benchmarks, debugging).
_ENABLED = not os.environ.get("EDGEINFER_NO_REPACK") and not os.environ.get("EDGEINFER_PLAIN_KERNELS")
_PIECE = 16          # bytes of a row moved together
_PIECES = 144 // _PIECE   # a Q4_K block: its head, then 8 pieces of qs


def host_repacks() -> bool:
    """Whether the CPU the kernels are compiled for runs Q4_K_X8 faster than Q4_K."""
    feats = target_features(cpu_target.target_context)
    return _ENABLED and {"+avx512bw", "+f16c"} <= feats


def repacks(qtype, n_rows: int) -> bool:
    """Whether `repack` turns a matrix of this type and row count into Q4_K_X8 on this host."""
    return int(qtype) == Q4_K and n_rows % X8_ROWS == 0 and host_repacks()


def interleave_q4_k(w_raw: np.ndarray, empty=np.empty) -> np.ndarray:
    """The Q4_K_X8 copy of a Q4_K matrix (n_rows % 8 == 0), same shape, C-contiguous, in
    memory from empty(shape, dtype)."""
    n_rows, row_bytes = w_raw.shape
    if n_rows % X8_ROWS or row_bytes % 144:
        raise ValueError(f"Q4_K_X8 needs whole blocks and rows in eights, got {w_raw.shape}")
    nb = row_bytes // 144
    out = empty(w_raw.shape, w_raw.dtype)
    # rows as (group, row, block, piece) of 16 bytes (two u64) -> (group, block, piece, row)
    src = np.ascontiguousarray(w_raw).view(np.uint64).reshape(n_rows // X8_ROWS, X8_ROWS, nb, _PIECES, 2)
    out.view(np.uint64).reshape(n_rows // X8_ROWS, nb, _PIECES, X8_ROWS, 2)[...] = src.transpose(0, 2, 3, 1, 4)
    return out


def deinterleave_q4_k(w_x8: np.ndarray) -> np.ndarray:
    """The Q4_K matrix a Q4_K_X8 copy was made from (interleave_q4_k's inverse)."""
    n_rows, row_bytes = w_x8.shape
    nb = row_bytes // 144
    out = np.empty_like(w_x8)
    src = np.ascontiguousarray(w_x8).view(np.uint64).reshape(n_rows // X8_ROWS, nb, _PIECES, X8_ROWS, 2)
    out.view(np.uint64).reshape(n_rows // X8_ROWS, X8_ROWS, nb, _PIECES, 2)[...] = src.transpose(0, 3, 1, 2, 4)
    return out


def repack(w_raw: np.ndarray, qtype, empty=np.empty) -> tuple[np.ndarray, int]:
    """(weights, type id) the CPU kernels read fastest: a read-only Q4_K_X8 copy (in
    memory from empty(shape, dtype)) where `repacks` says so, else the input itself."""
    if not repacks(qtype, w_raw.shape[0]):
        return w_raw, int(qtype)
    out = interleave_q4_k(w_raw, empty)
    out.flags.writeable = False
    return out, Q4_K_X8
