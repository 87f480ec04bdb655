"""The float reference as a GPU prompt computes it: a quantized matrix's product over more than
a few rows takes its activations rounded to 8 bits, each 32 values with their own scale, as
ggml's q8_1 (kernels_cuda/quant.cu's 8-bit GEMM, llama.cpp's MMQ). Everything else is the
ReferenceBackend's float64 math.

llama.cpp's own CPU path rounds activations to 8 bits as well (Q8_0 / Q8_K), and on Gemma 3
270M its logits differ from the float reference's by up to ~6 where they reach 54: a GPU
prompt is held to this reference, whose rounding it shares, instead of to the float one.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from edgeinfer.backends.base import ReferenceBackend
from edgeinfer.backends.cuda import layer_of
from edgeinfer.kernels_cuda.launch import MATVEC_MAX_TOKENS

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


def q8_1_roundtrip(x: np.ndarray) -> np.ndarray:
    """x with each row's 32-value blocks rounded as ggml's quantize_q8_1: d = max|x| / 127,
    q = round(x / d) half away from zero, back to q * d (float32)."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = blocks / d
    q = np.where(amax == 0, 0, np.sign(r) * np.floor(np.abs(r) + np.float32(0.5)))
    return (q * d).astype(np.float32).reshape(x.shape)


class Q8PromptReference(ReferenceBackend):
    """ReferenceBackend with a GPU prompt's 8-bit activations (see the module docstring) in the
    first `gpu_layers` blocks (and the output head with `head`): the layers a hybrid backend
    under test runs on the GPU; the rest as the float reference, as its CPU side."""

    def __init__(self, gguf, gpu_layers: int, head: bool = False) -> None:
        super().__init__(gguf)
        self.gpu_layers, self.head = gpu_layers, head

    def _rounds(self, name: str, rows: int) -> bool:
        if rows <= MATVEC_MAX_TOKENS or self.gguf.tensors[name].qtype in FLOAT_TYPES:
            return False
        layer = layer_of(name)
        return layer < self.gpu_layers if layer is not None else self.head

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        return super().linear(name, q8_1_roundtrip(x) if self._rounds(name, x.shape[0]) else x)

    def expert_batch(self, names, experts, starts, rows_of, x):
        largest = int(np.diff(starts).max()) if len(starts) > 1 else 0
        if self._rounds(names[0], largest):  # the GPU's grouped GEMM takes every group then
            x = q8_1_roundtrip(x)
        return super().expert_batch(names, experts, starts, rows_of, x)
