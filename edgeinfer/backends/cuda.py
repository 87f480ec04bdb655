"""The CUDA side of an offloaded model: the weights of the planned layers (and the output
head) uploaded once at load as raw GGUF blocks, and the Backend ops on them (`CudaBackend`).
Activations in VRAM are edgeinfer.backends.device_tensor's `DeviceTensor`s.

Where each layer runs is edgeinfer.backends.hybrid's; the VRAM K/V are edgeinfer.kv.
device_storage's. pycuda is imported inside the functions (an optional dependency).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeinfer.backends.base import Backend
from edgeinfer.backends.offload import is_expert_tensor
from edgeinfer.kernels_cuda import graph, launch, runtime

if TYPE_CHECKING:
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.backends.offload import OffloadPlan

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
HEAD_NAMES = ("output.weight", "output_norm.weight")


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


class CudaBackend(Backend):
    """Backend ops on DeviceTensors; only tensors of GPU-placed layers are uploaded."""

    name = "cuda"

    def __init__(self, gguf: "GGUFFile", plan: "OffloadPlan") -> None:
        super().__init__(gguf)
        runtime.context()
        self.plan = plan
        self._mats: dict[str, Any] = {}  # name -> raw GGUF rows (n_rows, row_bytes) uint8 in VRAM
        self._vecs: dict[str, Any] = {}  # name -> float32 vector in VRAM
        self._vec_by_id: dict[int, tuple[np.ndarray, Any]] = {}
        for name, info in gguf.tensors.items():
            layer = layer_of(name)
            on_gpu = (layer is not None and plan.layer_on_gpu(layer)) or (
                plan.output_on_gpu and (name in HEAD_NAMES or (name == "token_embd.weight"
                                                               and "output.weight" not in gguf.tensors)))
            if on_gpu and len(info.shape) > 1 and (not is_expert_tensor(name, info.shape)
                                                    or (plan.experts_on_gpu(layer) and len(info.shape) == 3)):
                self._upload_matrix(name)  # a layer's experts only where the plan puts them
        for name in ("rope_freqs.weight",):
            if name in gguf.tensors and plan.gpu_layers:
                self.vector_gpu(name)

    def _upload_matrix(self, name: str) -> None:
        from pycuda import gpuarray

        self._mats[name] = gpuarray.to_gpu(np.ascontiguousarray(self.gguf.raw(name)))

    def has_matrix(self, name: str) -> bool:
        info = self.gguf.tensors[name]
        return name in self._mats and launch.supports(info.qtype, info.n_cols)

    def matrix(self, name: str) -> tuple[Any, Any, int]:
        """(raw rows in VRAM, GGUF type, rows) of an uploaded matrix: what the fused launchers take."""
        info = self.gguf.tensors[name]
        return self._mats[name], info.qtype, info.n_rows

    def vector_gpu(self, name: str) -> Any:
        vec = self._vecs.get(name)
        if vec is None:
            from pycuda import gpuarray

            with graph.outside_step():  # cached for good: not part of a step a graph records
                vec = self._vecs[name] = gpuarray.to_gpu(self.vector(name))
        return vec

    def upload_vector_array(self, host: np.ndarray) -> Any:
        """A host vector from Backend.vector (stable object) -> its VRAM copy, cached by identity."""
        hit = self._vec_by_id.get(id(host))
        if hit is None or hit[0] is not host:
            from pycuda import gpuarray

            with graph.outside_step():
                hit = self._vec_by_id[id(host)] = (host, gpuarray.to_gpu(np.ascontiguousarray(host, np.float32)))
        return hit[1]

    # ops on GPUArrays (the hybrid wraps and unwraps DeviceTensors)
    def linear_gpu(self, name: str, x: Any, residual: Any = None) -> Any:
        info = self.gguf.tensors[name]
        return launch.linear(self._mats[name], info.qtype, info.n_rows, info.n_cols, x, residual)

    def expert_linear_gpu(self, name: str, x: Any, route: "launch.ExpertRoute") -> Any:
        """The expert matmul of a 3-D tensor in VRAM (GGML shape (n_cols, rows, n_expert))."""
        info = self.gguf.tensors[name]
        return launch.expert_linear(self._mats[name], info.qtype, info.shape[1], info.n_cols, x, route)
