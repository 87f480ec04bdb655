"""Resize, pad and normalize RGB pixels with libmtmd's arithmetic (its Pillow-style resampler)."""
from __future__ import annotations

import math

import numpy as np

# libmtmd's resampler keeps weights as fixed-point integers with 22 fractional bits (Pillow's
# choice: 32-bit sums of 8-bit pixels times weights, 2 bits of headroom), so its output pixels
# are exact integers that any implementation doing the same sums reproduces bit for bit.
_PRECISION_BITS = 22
_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0}


def _filter(kind: str, x: np.ndarray) -> np.ndarray:
    """The resampling kernel at distance x (float64): a triangle, or Pillow's cubic (a = -0.5)."""
    x = np.abs(x)
    if kind == "bilinear":
        return np.where(x < 1.0, 1.0 - x, 0.0)
    a = -0.5
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _weights(kind: str, n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """For each output pixel along one axis: the input indices it reads (n_out, ksize) and their
    fixed-point weights (zero past the pixels in its window), computed in float64 as libmtmd does."""
    scale = n_in / n_out
    filterscale = max(scale, 1.0)  # downscaling widens the kernel (anti-aliasing)
    support = _SUPPORT[kind] * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    center = (np.arange(n_out, dtype=np.float64) + 0.5) * scale
    # C's int() truncates toward zero; negative starts are clamped to 0 either way
    lo = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    hi = np.minimum(np.trunc(center + support + 0.5), n_in).astype(np.int64)
    count = hi - lo
    k = np.arange(ksize)
    inside = k[None, :] < count[:, None]
    w = np.where(inside, _filter(kind, (k[None, :] + lo[:, None] - center[:, None] + 0.5) * (1.0 / filterscale)), 0.0)
    total = np.zeros(n_out)
    for j in range(ksize):  # summed in order, as the C loop does: the last bit decides rounding
        total += w[:, j]
    w = np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)
    fixed = w * float(1 << _PRECISION_BITS)
    fixed = np.trunc(fixed + np.where(w < 0, -0.5, 0.5)).astype(np.int64)  # Pillow's rounding
    index = np.minimum(lo[:, None] + k[None, :], n_in - 1)  # padded slots have weight 0
    return index, fixed


def _resample_axis(pixels: np.ndarray, axis: int, n_out: int, kind: str) -> np.ndarray:
    """One separable pass along `axis` (1: width, 0: height) of a (h, w, 3) uint8 array, in
    slices across the other axis (int64 sums of a 50-megapixel image would take gigabytes)."""
    index, fixed = _weights(kind, pixels.shape[axis], n_out)
    shape = [1, 1, 1]
    shape[axis] = n_out
    weights = [fixed[:, j].reshape(shape) for j in range(index.shape[1])]
    other = 1 - axis
    out_shape = list(pixels.shape)
    out_shape[axis] = n_out
    out = np.empty(out_shape, np.uint8)
    step = max(1, (1 << 20) // (3 * max(n_out, pixels.shape[axis])))
    for start in range(0, pixels.shape[other], step):
        part = [slice(None)] * 3
        part[other] = slice(start, start + step)
        src = pixels[tuple(part)].astype(np.int64)
        acc = np.full(src.shape[:axis] + (n_out,) + src.shape[axis + 1:], 1 << (_PRECISION_BITS - 1), np.int64)
        for j, w in enumerate(weights):
            acc += np.take(src, index[:, j], axis=axis) * w
        out[tuple(part)] = np.clip(acc >> _PRECISION_BITS, 0, 255)
    return out


def resize(pixels: np.ndarray, width: int, height: int, kind: str = "bilinear") -> np.ndarray:
    """(h, w, 3) uint8 to (height, width, 3): horizontal pass first, then vertical, each only
    where that side changes (libmtmd's order: it rounds to uint8 between the passes)."""
    if kind not in _SUPPORT:
        raise ValueError(f"unknown resize kind {kind!r}")
    if not (0 < width <= 65536 and 0 < height <= 65536):
        raise ValueError(f"resize target {width}x{height} is out of range")
    out = pixels
    if width != pixels.shape[1]:
        out = _resample_axis(out, 1, width, kind)
    if height != pixels.shape[0]:
        out = _resample_axis(out, 0, height, kind)
    return np.ascontiguousarray(out)


def fit_and_pad(pixels: np.ndarray, width: int, height: int, kind: str = "bilinear",
                pad_color: tuple[int, int, int] = (0, 0, 0)) -> np.ndarray:
    """Keep the aspect ratio: scale to fit inside width x height (sides rounded up), centre it
    on a pad_color canvas. libmtmd's PAD_CEIL, with its float32 scale arithmetic."""
    h, w = pixels.shape[:2]
    if (w, h) == (width, height):
        return pixels.copy()
    scale = min(np.float32(width) / np.float32(w), np.float32(height) / np.float32(h))
    new_w = min(int(math.ceil(np.float32(w) * scale)), width)
    new_h = min(int(math.ceil(np.float32(h) * scale)), height)
    inner = resize(pixels, new_w, new_h, kind)
    canvas = np.empty((height, width, 3), np.uint8)
    canvas[:] = np.asarray(pad_color, np.uint8)
    x0, y0 = (width - new_w) // 2, (height - new_h) // 2
    canvas[y0:y0 + new_h, x0:x0 + new_w] = inner
    return canvas


def normalize(pixels: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """uint8 (h, w, 3) to float32 (x / 255 - mean) / std per channel, in float32 as libmtmd."""
    x = pixels.astype(np.float32) / np.float32(255.0)
    return ((x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)).astype(np.float32)
