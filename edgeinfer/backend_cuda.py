"""Running the offloaded layers on the GPU.

- `CudaBackend`: the Backend ops on `DeviceTensor`s, weights of the planned layers (and
  the output head) uploaded once at load as raw GGUF blocks.
- `HybridBackend`: what a model actually talks to. Named ops (`linear`, `rms_norm`,
  `attention`) go to the side the plan puts their layer on; unnamed ops follow their
  input. The hidden state moves only when the layer side changes (one upload before the
  first GPU layer, one download after the last), through pinned host buffers.
- `CudaKVCache`: a KVCache whose GPU layers keep K/V in VRAM (f16, read by the paged
  attention kernels with a one-block table); CPU layers keep the host arrays.

The engine wires it with `make_backend(gguf, config, plan, cpu_backend)` and
`backend.new_cache(config, n_ctx)`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeinfer.backend import Backend
from edgeinfer.kv_cache import KVCache
from edgeinfer.models.base import ROPE_NEOX, ModelConfig

if TYPE_CHECKING:
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
            from edgeinfer.kernels_cuda import launch

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
        from edgeinfer.kernels_cuda import runtime

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
        from edgeinfer.kernels_cuda.launch import supports

        return name in self._mats and supports(info.qtype, info.n_cols)

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
        from edgeinfer.kernels_cuda import launch

        info = self.gguf.tensors[name]
        return launch.linear(self._mats[name], info.qtype, info.n_rows, info.n_cols, x, residual)


class CudaKVCache(KVCache):
    """K/V of GPU layers live in VRAM (n_ctx, n_kv, hd) f16; the rest as in KVCache."""

    def __init__(self, config: ModelConfig, n_ctx: int, gpu_layers: list[int]) -> None:
        super().__init__(config, n_ctx)
        from pycuda import gpuarray

        self.gpu_layers = set(gpu_layers)
        kv_heads, hd, hd_v = config.n_head_kv, config.head_dim, config.head_dim_v
        self.k_dev = {i: gpuarray.zeros((n_ctx, kv_heads, hd), np.float16) for i in self.gpu_layers}
        self.v_dev = {i: gpuarray.zeros((n_ctx, kv_heads, hd_v), np.float16) for i in self.gpu_layers}
        for i in self.gpu_layers:  # their host copies are filled on demand only (layer_view)
            self.k[i] = np.zeros((0, kv_heads, hd), np.float16)
            self.v[i] = np.zeros((0, kv_heads, hd_v), np.float16)
        self.block_table = gpuarray.to_gpu(np.zeros(1, np.int32))  # one block of n_ctx slots
        self.pos_dev = gpuarray.zeros(n_ctx, np.int32)

    def append(self, positions: np.ndarray) -> np.ndarray:
        slots = super().append(positions)
        if len(slots):
            lo = int(slots[0])
            self.pos_dev[lo:lo + len(slots)].set(np.asarray(positions, np.int32))
        return slots

    def store(self, layer: int, slots: np.ndarray, k: Any, v: Any) -> None:
        if layer not in self.gpu_layers:
            super().store(layer, slots, _host(k), _host(v))
            return
        from pycuda import gpuarray

        from edgeinfer.kernels_cuda import launch

        kd = k.array if isinstance(k, DeviceTensor) else gpuarray.to_gpu(np.ascontiguousarray(k, np.float32))
        vd = v.array if isinstance(v, DeviceTensor) else gpuarray.to_gpu(np.ascontiguousarray(v, np.float32))
        launch.kv_store(kd, vd, self.k_dev[layer], self.v_dev[layer], self.block_table,
                        gpuarray.to_gpu(np.asarray(slots, np.int32)), self.n_ctx)

    def layer_view(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if layer not in self.gpu_layers:
            return super().layer_view(layer)
        n = self.n_used
        return self.k_dev[layer][:n].get(), self.v_dev[layer][:n].get(), self.pos[:n]


def _host(a: Any) -> np.ndarray:
    return a.owner.to_host(a) if isinstance(a, DeviceTensor) else a


class HybridBackend(Backend):
    """Layers in plan.gpu_layers (and the head when plan.output_on_gpu) on the GPU, the rest on `cpu`."""

    name = "hybrid"

    def __init__(self, gguf: "GGUFFile", plan: "OffloadPlan", cpu: Backend, cuda: CudaBackend | None = None) -> None:
        super().__init__(gguf)
        self.plan, self.cpu = plan, cpu
        self.cuda = cuda or CudaBackend(gguf, plan)
        self._on_gpu = False  # side of the op being run now (decides mixed host/device adds)
        self._up: tuple[np.ndarray, DeviceTensor] | None = None  # last upload, by identity
        self._down: tuple[DeviceTensor, np.ndarray] | None = None  # last download, by identity
        self._pinned: np.ndarray | None = None
        self._int_cache: tuple[np.ndarray, Any] | None = None

    def new_cache(self, config: ModelConfig, n_ctx: int) -> CudaKVCache:
        return CudaKVCache(config, n_ctx, self.plan.gpu_layers)

    def vector(self, name: str) -> np.ndarray:
        return self.cpu.vector(name)

    # -- placement and transfers ------------------------------------------------------------
    def _gpu_for(self, name: str) -> bool:
        layer = layer_of(name)
        if layer is not None:
            on = self.plan.layer_on_gpu(layer)
        else:
            on = self.plan.output_on_gpu and name in HEAD_NAMES + ("token_embd.weight",)
        self._on_gpu = on
        return on

    def _pinned_view(self, shape: tuple[int, ...]) -> np.ndarray:
        import pycuda.driver as drv

        size = int(np.prod(shape))
        if self._pinned is None or self._pinned.size < size:
            self._pinned = drv.pagelocked_empty(max(size, 1 << 16), np.float32)
        return self._pinned[:size].reshape(shape)

    def to_device(self, x: Any) -> DeviceTensor:
        if isinstance(x, DeviceTensor):
            return x
        if self._up is not None and self._up[0] is x:
            return self._up[1]
        from pycuda import gpuarray

        staged = self._pinned_view(x.shape)
        staged[...] = x
        dev = DeviceTensor(gpuarray.to_gpu(staged), self)
        self._up = (x, dev)
        return dev

    def to_host(self, x: Any) -> np.ndarray:
        if not isinstance(x, DeviceTensor):
            return x
        if self._down is not None and self._down[0] is x:
            return self._down[1]
        host = x.array.get(ary=self._pinned_view(x.shape)).copy()
        self._down = (x, host)
        return host

    def _ints(self, values: np.ndarray) -> Any:
        """positions as int32 in VRAM, reused across the layers of one step."""
        if self._int_cache is not None and self._int_cache[0] is values:
            return self._int_cache[1]
        from pycuda import gpuarray

        dev = gpuarray.to_gpu(np.asarray(values, np.int32))
        self._int_cache = (values, dev)
        return dev

    def add(self, a: Any, b: Any) -> Any:
        if self._on_gpu:
            from edgeinfer.kernels_cuda import launch

            return DeviceTensor(launch.add(self.to_device(a).array, self.to_device(b).array), self)
        return self.to_host(a) + self.to_host(b)

    # -- ops ----------------------------------------------------------------------------------
    def linear(self, name: str, x: Any) -> Any:
        on_gpu, is_head = self._gpu_for(name), layer_of(name) is None
        if on_gpu and self.cuda.has_matrix(name):
            y = self.cuda.linear_gpu(name, self.to_device(x).array)
            return y.get() if is_head else DeviceTensor(y, self)  # logits always end on the host
        # a type the CUDA kernels lack: this one matrix runs on the CPU, the layer stays on the GPU
        y = self.cpu.linear(name, self.to_host(x))
        return self.to_device(y) if on_gpu and not is_head else y

    def get_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self.cpu.get_rows(name, ids)

    def rms_norm(self, x: Any, weight: str, eps: float) -> Any:
        if self._gpu_for(weight):
            from edgeinfer.kernels_cuda import launch

            return DeviceTensor(launch.rms_norm(self.to_device(x).array, self.cuda.vector_gpu(weight), eps), self)
        return self.cpu.rms_norm(self.to_host(x), weight, eps)

    def silu_mul(self, gate: Any, up: Any) -> Any:
        if isinstance(gate, DeviceTensor):
            from edgeinfer.kernels_cuda import launch

            return DeviceTensor(launch.silu_mul(gate.array, self.to_device(up).array), self)
        return self.cpu.silu_mul(gate, self.to_host(up))

    def gelu_mul(self, gate: Any, up: Any) -> Any:
        if isinstance(gate, DeviceTensor):
            from edgeinfer.kernels_cuda import launch

            return DeviceTensor(launch.gelu_mul(gate.array, self.to_device(up).array), self)
        return self.cpu.gelu_mul(gate, self.to_host(up))

    def rope(self, x: Any, positions: np.ndarray, n_dims: int, base: float, freq_scale: float, mode: str,
             freq_factors: str | None) -> Any:
        if isinstance(x, DeviceTensor):
            from edgeinfer.kernels_cuda import launch

            ff = self.cuda.vector_gpu(freq_factors) if freq_factors else None
            out = launch.rope(x.array, self._ints(positions), n_dims, base, freq_scale, mode == ROPE_NEOX, ff)
            return DeviceTensor(out, self)
        return self.cpu.rope(x, positions, n_dims, base, freq_scale, mode, freq_factors)

    def attention(self, q: Any, kv: KVCache, layer: int, positions: np.ndarray, scale: float,
                  window: int, q_scale: float = 1.0) -> Any:
        from edgeinfer.kernels_cuda import launch

        self._on_gpu = self.plan.layer_on_gpu(layer)
        k = kv.k_dev.get(layer) if isinstance(kv, CudaKVCache) else None
        if self._on_gpu and k is not None and launch.attention_supports(k.shape[2], kv.v_dev[layer].shape[2]):
            out = launch.attention(self.to_device(q).array, k, kv.v_dev[layer], kv.block_table, kv.pos_dev,
                                   self._ints(positions), kv.n_used, kv.n_ctx, k.shape[1], kv.v_dev[layer].shape[2],
                                   scale * q_scale, window)
            return DeviceTensor(out, self)
        out = self.cpu.attention(self.to_host(q), kv, layer, positions, scale, window, q_scale=q_scale)
        return self.to_device(out) if self._on_gpu else out


def make_backend(gguf: "GGUFFile", plan: "OffloadPlan", cpu: Backend) -> Backend:
    """The hybrid backend when the plan puts anything on the GPU, else `cpu` unchanged."""
    return HybridBackend(gguf, plan, cpu) if plan.on_gpu else cpu
