"""The vision encoders' heavy operations behind one object, so that the same projector code runs
on the CPU or with its matrices and attention in VRAM (edgeinfer.vision.gpu_encoder).

The projectors call `mm.ops` (the MmprojFile's, set when the file is loaded) for the matrix
products, the norms, the activations, the residual adds and the patch attention; their
activations are whatever the ops hand back, and `host(x)` makes one a numpy array where a
projector computes on the host itself (RoPE, pooling, clamps). `CpuOps` is the CPU encoder:
numpy arrays throughout, each op today's CPU code.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from edgeinfer.kernels_cpu import attention_f32_ggml
from edgeinfer.vision.activation import activation
from edgeinfer.vision.float_order import FloatOrder
from edgeinfer.vision.patch_attention import attend


class CpuOps:
    """The encoder on the host: every op is the layer object's own CPU code."""

    where = "CPU"

    def __init__(self, why: str = "") -> None:
        self.why = why   # why the encoder is here though the text model has GPU layers (describe)
        self.float_order = FloatOrder(False, 0)

    def use_float_order(self, order: FloatOrder) -> None:
        """The file's rule for ggml's float order (vision.float_order): the attention follows
        it (kernels_cpu.attention_f32_ggml) where it applies, else BLAS."""
        self.float_order = order

    def load_linear(self, lin: Any) -> None:
        """A matrix the encoder will multiply by (vit.Linear), offered at load: the CPU keeps the file's."""

    def load_vector(self, values: np.ndarray | None) -> None:
        """A norm weight or bias offered at load (kept on the host)."""

    def host(self, x: Any) -> np.ndarray:
        """x as a numpy array, for a projector's own arithmetic."""
        return x

    def device(self, x: Any) -> Any:
        """x where the ops compute (moved once, before several ops read it)."""
        return x

    def linear(self, lin: Any, x: Any) -> Any:
        """x W^T + b of a vit.Linear."""
        return lin(x)

    def linears(self, lins: tuple, x: Any) -> list:
        """[lin(x) for lin in lins], x prepared once for matrices of one type (Q, K and V)."""
        prepared: dict = {}
        out = []
        for lin in lins:
            if lin.qtype not in prepared:
                prepared[lin.qtype] = lin.prepare(x)
            out.append(lin.apply(prepared[lin.qtype]))
        return out

    def layer_norm(self, ln: Any, x: Any) -> Any:
        """A vit.LayerNorm (ggml_norm, weight, bias)."""
        return ln(x)

    def activation(self, x: Any, op: str) -> Any:
        """The MLP's activation; x is the up product, which nothing else reads: GELU
        overwrites it."""
        return activation(x, op, in_place=True)

    def glu(self, gate: Any, up: Any, op: str) -> Any:
        """act(gate) * up (ggml's *glu_split)."""
        return activation(gate, op) * up

    def add(self, a: Any, b: Any) -> Any:
        return a + b

    def attention(self, q: Any, k: Any, v: Any, scale: float, query_rows: int | None = None) -> Any:
        """Non-causal attention, every patch seeing every patch: q k v (n, heads, d) -> (n, heads * d);
        query_rows bounds the CPU's score slices (patch_attention.QUERY_ROWS by default)."""
        if self.float_order.ggml_for(q.shape[0]):
            return attention_f32_ggml.attention(q, k, v, scale)
        return attend(q, k, v, scale, query_rows)

    def describe(self) -> str:
        return "vision encoder on the CPU" + (f" ({self.why})" if self.why else "")
