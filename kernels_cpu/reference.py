"""Plain numpy references for the kernels (tests and debugging only; slow)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .quant_types import reference_dequantize

__all__ = ["reference_dequantize"]   # the registry's (quant_types), with the other references here


def reference_matvec(w_raw: np.ndarray, qtype: T, x: np.ndarray) -> np.ndarray:
    """dequantize(w) @ x accumulated in float64."""
    return (reference_dequantize(w_raw, qtype).astype(np.float64) @ np.asarray(x, np.float64)).astype(np.float32)


def reference_matmul(w_raw: np.ndarray, qtype: T, X: np.ndarray) -> np.ndarray:
    """X @ dequantize(w).T accumulated in float64: (n_tokens, n_rows)."""
    return (np.asarray(X, np.float64) @ reference_dequantize(w_raw, qtype).astype(np.float64).T).astype(np.float32)


# E2M1 values doubled, as ggml's kvalues_mxfp4 (ggml-common.h); the scale is halved to match
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def e8m0_to_fp32_half(e) -> np.ndarray:
    """ggml_e8m0_to_fp32_half (ggml-impl.h), bit for bit: E8M0 bytes -> 2^(e-128) as float32,
    the two denormals e < 2 included (0x00200000 << e), no NaN for 0xFF."""
    e = np.asarray(e, np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def reference_dequantize_mxfp4(w_raw: np.ndarray) -> np.ndarray:
    """(n_rows, row_bytes) MXFP4 blocks (E8M0 byte, 16 bytes of 4-bit codes) -> float32
    (n_rows, n_cols) as ggml's dequantize_row_mxfp4: low nibbles are elements 0..15, high
    ones 16..31, each kvalue * scale rounded once."""
    blocks = np.asarray(w_raw, np.uint8).reshape(w_raw.shape[0], -1, 17)
    d = e8m0_to_fp32_half(blocks[..., 0])
    qs = blocks[..., 1:]
    q = KVALUES_MXFP4[np.concatenate([qs & 15, qs >> 4], axis=-1)].astype(np.float32)
    return (q * d[..., None]).reshape(w_raw.shape[0], -1)


def reference_quantize_act(x: np.ndarray, block: int) -> np.ndarray:
    """x rounded the way matvec quantizes activations, back in float64 (for tight checks).

    block 32: Q8_0 (d = amax/127 rounded to fp16); block 256: Q8_K (d = -max/127, float32).
    """
    x = np.asarray(x, np.float32).reshape(-1, block)
    if block == 32:
        amax = np.abs(x).max(axis=1, keepdims=True)
        inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        q = np.rint(x * inv)
        d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float64)
        return (q * d).ravel()
    idx = np.abs(x).argmax(axis=1)
    vmax = x[np.arange(x.shape[0]), idx][:, None]
    iscale = np.where(vmax != 0, np.float32(-127.0) / np.where(vmax != 0, vmax, 1), 0).astype(np.float32)
    q = np.minimum(np.rint(iscale * x), 127)
    d = np.where(iscale != 0, np.float32(1.0) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).ravel()


def reference_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = np.asarray(x, np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def reference_rope(x: np.ndarray, positions, freq_base: float, mode: str = "normal", n_dims: int | None = None,
                   freq_scale: float = 1.0, freq_factors=None) -> np.ndarray:
    """Rotary embedding in float64 (a copy); x (n_tok, n_heads, head_dim)."""
    x = np.asarray(x, np.float64)
    n_dims = x.shape[2] if n_dims is None else n_dims
    inv = freq_base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, np.float64)
    theta = np.asarray(positions, np.float64)[:, None] * (inv * freq_scale)[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.copy()
    if mode == "neox":
        half = n_dims // 2
        a, b = x[..., :half], x[..., half:n_dims]
        out[..., :half], out[..., half:n_dims] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        out[..., 0:n_dims:2], out[..., 1:n_dims:2] = a * cos - b * sin, a * sin + b * cos
    return out
