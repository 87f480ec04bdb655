"""The narrow set of ops a model's forward pass is written against, and the numpy reference.

Models call ops by GGUF tensor name (`linear("blk.0.attn_q.weight", x)`), so a backend can
keep weights wherever it likes (raw blocks in an mmap, dequantized floats, VRAM). Every
faster backend (Numba CPU, CUDA) subclasses `Backend` and is tested against
`ReferenceBackend`, which dequantizes with `gguf.quants.dequantize` and does float math.

Shapes: activations are float32 (n_tokens, features); per-head tensors are
(n_tokens, n_heads, head_dim).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType, quants

from edgeinfer.models.base import ROPE_NEOX

if TYPE_CHECKING:
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.kv_cache import KVCache

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class Backend:
    """Ops shared by every backend; subclasses override the ones they accelerate."""

    name = "base"

    def __init__(self, gguf: "GGUFFile") -> None:
        self.gguf = gguf
        self._vectors: dict[str, np.ndarray] = {}

    # -- weights --------------------------------------------------------------------------
    def vector(self, name: str) -> np.ndarray:
        """A 1-D weight (norm, bias, rope factors) as float32, cached."""
        vec = self._vectors.get(name)
        if vec is None:
            info = self.gguf.tensors[name]
            vec = quants.dequantize(self.gguf.raw(name), info.qtype).astype(np.float32).ravel()
            self._vectors[name] = vec
        return vec

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        """x (n, n_cols) @ W^T -> (n, n_rows) for the GGUF matrix `name`."""
        raise NotImplementedError

    def get_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of matrix `name` as float32 (len(ids), n_cols): the embedding lookup."""
        info = self.gguf.tensors[name]
        raw = self.gguf.raw(name)[np.asarray(ids, dtype=np.int64)]
        return quants.dequantize(raw, info.qtype).astype(np.float32).reshape(len(ids), info.n_cols)

    # -- elementwise and normalisation ---------------------------------------------------
    def rms_norm(self, x: np.ndarray, weight: str, eps: float) -> np.ndarray:
        """RMSNorm over the last axis, times the weight vector (any leading shape)."""
        # ggml's order: sum of float32 squares in double, mean back to float32, then
        # x * (1 / sqrt(mean + eps)). This model family amplifies last-bit differences.
        sq = np.square(x, dtype=np.float32).astype(np.float64)
        mean = (sq.sum(axis=-1, keepdims=True) / x.shape[-1]).astype(np.float32)
        scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
        return (x * scale) * self.vector(weight)

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return gate / (1.0 + np.exp(-gate)) * up

    def gelu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """GELU (tanh approximation) of gate, times up, the way ggml's CPU geglu computes it:
        through a table indexed by the F16-rounded input, giving an F16-rounded GELU;
        identity above 10 and zero below -10."""
        x = gate.astype(np.float16).astype(np.float32)
        g = 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)))
        g = g.astype(np.float16).astype(np.float32)
        g = np.where(gate >= 10.0, gate, np.where(gate <= -10.0, 0.0, g))
        return (g * up).astype(np.float32)

    def rope(self, x: np.ndarray, positions: np.ndarray, n_dims: int, base: float,
             freq_scale: float, mode: str, freq_factors: str | None) -> np.ndarray:
        """Rotary embedding of the first n_dims of each head; x: (n, heads, head_dim)."""
        inv = base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)
        if freq_factors is not None:
            inv = inv / self.vector(freq_factors).astype(np.float64)
        theta = np.asarray(positions, dtype=np.float64)[:, None] * (inv * freq_scale)[None, :]
        cos = np.cos(theta).astype(np.float32)[:, None, :]
        sin = np.sin(theta).astype(np.float32)[:, None, :]
        out = x.copy()
        if mode == ROPE_NEOX:
            half = n_dims // 2
            a, b = x[..., :half], x[..., half:n_dims]
            out[..., :half] = a * cos - b * sin
            out[..., half:n_dims] = a * sin + b * cos
        else:
            a, b = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
            out[..., 0:n_dims:2] = a * cos - b * sin
            out[..., 1:n_dims:2] = a * sin + b * cos
        return out

    # -- attention ------------------------------------------------------------------------
    def attention(self, q: np.ndarray, kv: "KVCache", layer: int, positions: np.ndarray,
                  scale: float, window: int) -> np.ndarray:
        """Causal attention of q (n, n_head, hd) over the cached K/V of `layer`.

        A query at position p sees cached keys at positions <= p, and with a sliding
        window only those with p - key_pos < window (llama.cpp's standard SWA mask).
        Returns (n, n_head, hd_v).
        """
        k, v, kpos = kv.layer_view(layer)  # (S, n_kv, hd), (S, n_kv, hd_v), (S,)
        if window:  # a sliding-window layer never looks further back than its window
            keep = kpos > np.min(positions) - window
            if not keep.all():
                k, v, kpos = k[keep], v[keep], kpos[keep]
        n, n_head, _ = q.shape
        group = n_head // k.shape[1]
        # Per KV head, its group of query heads; matmul (BLAS), not einsum (a plain loop).
        k = k.astype(np.float32).transpose(1, 2, 0)[:, None]  # (n_kv, 1, hd, S)
        v = v.astype(np.float32).transpose(1, 0, 2)[:, None]  # (n_kv, 1, S, hd_v)
        # Like llama.cpp's F16 cache matmuls: Q and the softmax weights are rounded to F16
        # before their dot products with the F16 K and V.
        q = q.astype(np.float16).astype(np.float32)
        qg = q.reshape(n, k.shape[0], group, -1).transpose(1, 2, 0, 3)  # (n_kv, group, n, hd)
        scores = (qg @ k).reshape(n_head, n, -1) * np.float32(scale)  # (n_head, n, S)
        qpos = np.asarray(positions)[:, None]
        allowed = kpos[None, :] <= qpos
        if window:
            allowed &= (qpos - kpos[None, :]) < window
        scores = np.where(allowed[None, :, :], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        inv = (1.0 / probs.astype(np.float64).sum(axis=-1, keepdims=True)).astype(np.float32)
        probs *= inv  # ggml sums in double and scales by the reciprocal
        probs = probs.astype(np.float16).astype(np.float32)
        pg = probs.reshape(k.shape[0], group, n, -1)
        out = (pg @ v).reshape(n_head, n, -1)  # (n_head, n, hd_v)
        return np.ascontiguousarray(out.transpose(1, 0, 2), dtype=np.float32)


class ReferenceBackend(Backend):
    """Plain numpy: dequantize each matrix once to float32 and multiply. Slow, obviously right."""

    name = "reference"

    def __init__(self, gguf: "GGUFFile") -> None:
        super().__init__(gguf)
        self._dense: dict[str, np.ndarray] = {}

    def dense(self, name: str) -> np.ndarray:
        w = self._dense.get(name)
        if w is None:
            info = self.gguf.tensors[name]
            if info.qtype == GGMLQuantizationType.F32:
                w = np.asarray(self.gguf.array(name))
            else:
                w = quants.dequantize(self.gguf.raw(name), info.qtype).astype(np.float32)
            w = w.reshape(info.n_rows, info.n_cols)
            self._dense[name] = w
        return w

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        return (x @ self.dense(name).T).astype(np.float32)
