"""The vision encoders' rotary embeddings and position-table resize as libmtmd's graphs
compute them, bit for bit: ggml's float32 angle recurrence from each position, the C
library's cosf/sinf, and the products fused as ggml's compiled code fuses them (an fma where
gcc contracts one). A last-bit difference here once reached the embeddings of a Q8_0 mmproj
as a whole quantum: the next product's 8-bit activation rounded the other way.
tests/test_vision_position_ops.py holds each to ggml's own op, run through the oracle's library.

- qwen3vl: ggml_rope_multi(n_dims = d/2, sections d/4 x 4, GGML_ROPE_TYPE_VISION): dims k and
  k + d/2 turned together, the first d/4 pairs by the patch's row, the rest by its column.
- gemma4v: two NeoX ggml_rope_ext of n_dims = d/2, the first half of each head by the
  column, the second by the row.
- qwen3vl's learned position table resized to the patch grid: ggml_interpolate, bilinear
  with aligned corners.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from edgeinfer.kernels_cpu import ops
from edgeinfer.kernels_cpu.ggml_math import fma_f32


def mrope_vision_angles(rows: np.ndarray, cols: np.ndarray, d_head: int, base: float) -> tuple:
    """qwen3vl's (cos, sin) for patches at rows, cols: (n, d_head / 2) each."""
    return ops.rope_cache_vision(rows, cols, d_head // 2, base)


def rotate_mrope_vision(x: np.ndarray, angles: tuple) -> np.ndarray:
    """x (n, heads, d) rotated as qwen3vl's graph does, into a new array."""
    out = np.array(x, np.float32, order="C")
    return ops.rope_rotate(out, angles, x.shape[-1], True)


def neox_2d_angles(cols: np.ndarray, rows: np.ndarray, d_head: int, base: float) -> tuple:
    """gemma4v's angles: (cos, sin) of each half of a head, by the column and by the row."""
    return ops.rope_cache(cols, d_head // 2, base), ops.rope_cache(rows, d_head // 2, base)


def rotate_2d_neox(x: np.ndarray, angles: tuple) -> np.ndarray:
    """x (n, heads, d) rotated as gemma4v's graph does, into a new array: each half of a head
    a NeoX rotation of d/2 dims by its own angles."""
    half = x.shape[-1] // 2
    out = np.empty(x.shape, np.float32)
    for k, part_angles in enumerate(angles):
        part = np.ascontiguousarray(x[..., k * half:(k + 1) * half], np.float32)
        out[..., k * half:(k + 1) * half] = ops.rope_rotate(part, part_angles, half, True)
    return out


@njit(cache=True, nogil=True)
def _bilinear(t, y0, y1, dy, x0, x1, dx, out):
    # ggml: a*(1 - dx)*(1 - dy) + b*dx*(1 - dy) + c*(1 - dx)*dy + d*dx*dy, compiled with the
    # first and the last two products fused into the sum
    one = np.float32(1.0)
    for i in range(out.shape[0]):
        fy = dy[i]
        for j in range(out.shape[1]):
            fx = dx[j]
            for c in range(out.shape[2]):
                acc = np.float32(np.float32(t[y0[i], x1[j], c] * fx) * np.float32(one - fy))
                acc = fma_f32(np.float32(t[y0[i], x0[j], c] * np.float32(one - fx)), np.float32(one - fy), acc)
                acc = fma_f32(np.float32(t[y1[i], x0[j], c] * np.float32(one - fx)), fy, acc)
                out[i, j, c] = fma_f32(np.float32(t[y1[i], x1[j], c] * fx), fy, acc)


def resize_align_corners(table: np.ndarray, n_rows: int, n_cols: int) -> np.ndarray:
    """table (rows, cols, c) float32 resized to (n_rows, n_cols, c): ggml_interpolate,
    GGML_SCALE_MODE_BILINEAR | GGML_SCALE_FLAG_ALIGN_CORNERS."""
    (y0, y1), dy = _align_corners(n_rows, table.shape[0])
    (x0, x1), dx = _align_corners(n_cols, table.shape[1])
    out = np.empty((n_rows, n_cols, table.shape[2]), np.float32)
    _bilinear(np.ascontiguousarray(table, np.float32), y0, y1, dy, x0, x1, dx, out)
    return out


def _align_corners(n_out: int, n_in: int) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """Source indices (i0, i1) and weights of ggml's bilinear upscale with align corners, in float32."""
    f32 = np.float32
    sf = f32(n_out - 1) / f32(n_in - 1) if n_out > 1 and n_in > 1 else f32(n_out) / f32(n_in)
    pos = np.arange(n_out, dtype=f32) / sf
    i0 = np.floor(pos).astype(np.int64)
    i0c, i1c = np.clip(i0, 0, n_in - 1), np.clip(i0 + 1, 0, n_in - 1)
    frac = np.clip(pos - i0c.astype(f32), f32(0.0), f32(1.0)).astype(f32)
    return (i0c, i1c), frac
