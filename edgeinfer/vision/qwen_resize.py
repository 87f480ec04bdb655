"""Qwen-VL's smart resize: the image size on the patch x merge grid, with libmtmd's float32 arithmetic."""
from __future__ import annotations

import math

import numpy as np

from edgeinfer.errors import EdgeInferError

_F = np.float32


def _round_half_away(x: np.float32) -> int:
    """C's std::round on a float: halves go away from zero (numpy's round goes to even)."""
    r = math.floor(abs(float(x)) + 0.5)   # exact: a float32 plus 0.5 fits a double
    return r if x >= 0 else -r


def smart_size(width: int, height: int, align: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) after libmtmd's calc_size_preserved_ratio: each side rounded to a
    multiple of `align`, then scaled down into max_pixels or up to min_pixels (0: no bound),
    keeping the aspect ratio. Computed in float32 as the C++ does, so the sides agree exactly."""
    if align <= 0 or width <= 0 or height <= 0:
        raise EdgeInferError(f"smart resize of a {width}x{height} image on a grid of {align} is undefined")
    f = _F(align)

    def round_by(x) -> int:
        return _round_half_away(_F(x) / f) * align

    def ceil_by(x) -> int:
        return math.ceil(_F(x) / f) * align

    def floor_by(x) -> int:
        return math.floor(_F(x) / f) * align

    w_bar = max(align, round_by(width))
    h_bar = max(align, round_by(height))
    if max_pixels > 0 and h_bar * w_bar > max_pixels:
        beta = np.sqrt(_F(height) * _F(width) / _F(max_pixels), dtype=_F)
        h_bar = max(align, floor_by(_F(height) / beta))
        w_bar = max(align, floor_by(_F(width) / beta))
    elif min_pixels > 0 and h_bar * w_bar < min_pixels:
        beta = np.sqrt(_F(min_pixels) / (_F(height) * _F(width)), dtype=_F)
        h_bar = ceil_by(_F(height) * beta)
        w_bar = ceil_by(_F(width) * beta)
    return w_bar, h_bar
