"""The CUDA side of an offloaded model: tensors in VRAM and the Backend ops on them.

- `DeviceTensor`: a float32 activation in VRAM with the numpy surface the model files use;
  arithmetic and host conversions go through its owner (edgeinfer.backend_hybrid).
- `CudaBackend`: the weights of the planned layers (and the output head) uploaded once at
  load as raw GGUF blocks, and the quantized matmul on them.

Where each layer runs is edgeinfer.backend_hybrid's; the VRAM K/V are edgeinfer.kv.
device_storage's. pycuda is imported inside the functions (an optional dependency).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeinfer.backend import Backend
from edgeinfer.kernels_cuda import launch, runtime

if TYPE_CHECKING:
    from edgeinfer.backend_hybrid import HybridBackend
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.offload import OffloadPlan

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
HEAD_NAMES = ("output.weight", "output_norm.weight")


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


class DeviceTensor:
    """A float32 tensor in VRAM with just the numpy surface the model files use."""

    __array_ufunc__ = None  # makes `ndarray + DeviceTensor` call our __radd__

    def __init__(self, array: Any, owner: "HybridBackend") -> None:
        self.array = array  # pycuda GPUArray
        self.owner = owner

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def reshape(self, *shape: int) -> "DeviceTensor":
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1]))
            shape = tuple(self.array.size // known if s == -1 else s for s in shape)
        return DeviceTensor(self.array.reshape(shape), self.owner)

    def __add__(self, other: Any) -> Any:
        return self.owner.add(self, other)

    __radd__ = __add__

    def __iadd__(self, other: Any) -> Any:
        if isinstance(other, np.ndarray) and other.ndim == 1:  # a bias row (qwen2 q/k/v)
            launch.add_rows(self.array, self.owner.cuda.upload_vector_array(other))
            return self
        return self.owner.add(self, other)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Host code that needs numpy (a plain KVCache.store) gets a download."""
        host = self.owner.to_host(self)
        return host if dtype is None else host.astype(dtype)

    def __getitem__(self, index: Any) -> np.ndarray:
        """Row selection (`x[logits_for]`) happens on the host: the boundary after the last layer."""
        return self.owner.to_host(self)[index]


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
            if on_gpu and len(info.shape) > 1:
                self._upload_matrix(name)
        for name in ("rope_freqs.weight",):
            if name in gguf.tensors and plan.gpu_layers:
                self.vector_gpu(name)

    def _upload_matrix(self, name: str) -> None:
        from pycuda import gpuarray

        self._mats[name] = gpuarray.to_gpu(np.ascontiguousarray(self.gguf.raw(name)))

    def has_matrix(self, name: str) -> bool:
        info = self.gguf.tensors[name]
        return name in self._mats and launch.supports(info.qtype, info.n_cols)

    def vector_gpu(self, name: str) -> Any:
        vec = self._vecs.get(name)
        if vec is None:
            from pycuda import gpuarray

            vec = self._vecs[name] = gpuarray.to_gpu(self.vector(name))
        return vec

    def upload_vector_array(self, host: np.ndarray) -> Any:
        """A host vector from Backend.vector (stable object) -> its VRAM copy, cached by identity."""
        hit = self._vec_by_id.get(id(host))
        if hit is None or hit[0] is not host:
            from pycuda import gpuarray

            hit = self._vec_by_id[id(host)] = (host, gpuarray.to_gpu(np.ascontiguousarray(host, np.float32)))
        return hit[1]

    # ops on GPUArrays (the hybrid wraps and unwraps DeviceTensors)
    def linear_gpu(self, name: str, x: Any, residual: Any = None) -> Any:
        info = self.gguf.tensors[name]
        return launch.linear(self._mats[name], info.qtype, info.n_rows, info.n_cols, x, residual)
