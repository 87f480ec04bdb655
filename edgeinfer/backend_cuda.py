"""Running the offloaded layers on the GPU.

- `CudaBackend`: the Backend ops on `DeviceTensor`s, weights of the planned layers (and
  the output head) uploaded once at load as raw GGUF blocks.
- `HybridBackend`: what a model actually talks to. Named ops (`linear`, `rms_norm`,
  `attention`) go to the side the plan puts their layer on; unnamed ops follow their
  input. The hidden state moves only when the layer side changes (one upload before the
  first GPU layer, one download after the last), through pinned host buffers.
- `DeviceBlockStorage`: the VRAM side of the session manager's paged KV pool
  (edgeinfer.paged_kv.PagedKVCache): per GPU layer a pool of f16 K/V blocks with the same
  block ids as the host pool, plus the position of every slot. The kv_store kernel writes a
  sequence's new tokens through its block table, the paged attention kernels read them
  through it; copy-on-write copies device blocks too. Shared prefix blocks are shared in
  VRAM exactly as in the host pool (one ref count, one copy).
- `CudaKVCache`: one contiguous sequence (bench, direct Engine use): GPU layers keep K/V
  in VRAM (f16, read by the paged attention kernels with a one-block table); CPU layers
  keep the host arrays.

The engine wires it with `make_backend(gguf, config, plan, cpu_backend)`; the session
manager asks `backend.new_block_storage(config, num_blocks, block_size)`, direct users
`backend.new_cache(config, n_ctx)`.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeinfer.backend import Backend
from edgeinfer.kv_cache import KVCache
from edgeinfer.models.base import ROPE_NEOX, ModelConfig

if TYPE_CHECKING:
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.offload import OffloadPlan
    from edgeinfer.paged_kv import SequenceKV

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

        launch.kv_store(_device_f32(k), _device_f32(v), self.k_dev[layer], self.v_dev[layer], self.block_table,
                        gpuarray.to_gpu(np.asarray(slots, np.int32)), self.n_ctx)

    def layer_view(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if layer not in self.gpu_layers:
            return super().layer_view(layer)
        n = self.n_used
        return self.k_dev[layer][:n].get(), self.v_dev[layer][:n].get(), self.pos[:n]

    def device_view(self, layer: int) -> "DevicePagedKV | None":
        if layer not in self.gpu_layers:
            return None
        return DevicePagedKV(self.k_dev[layer], self.v_dev[layer], self.block_table, self.pos_dev, self.n_used,
                             self.n_ctx)


def _host(a: Any) -> np.ndarray:
    return a.owner.to_host(a) if isinstance(a, DeviceTensor) else a


def _device_f32(a: Any) -> Any:
    """K or V rows for kv_store: a DeviceTensor's GPUArray, or a host array uploaded as f32."""
    if isinstance(a, DeviceTensor):
        return a.array
    from pycuda import gpuarray

    return gpuarray.to_gpu(np.ascontiguousarray(a, np.float32))


def _runs(values: np.ndarray) -> list[tuple[int, int]]:
    """[(first, last + 1)] of the runs of consecutive integers in `values` (block ids or slots),
    in order: one device copy per run instead of one per element."""
    if not len(values):
        return []
    cuts = np.flatnonzero(np.diff(values) != 1) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(values)]])
    return [(int(values[a]), int(values[b - 1]) + 1) for a, b in zip(starts, ends)]


class _SeqState:
    """What DeviceBlockStorage keeps per sequence."""

    def __init__(self) -> None:
        self.table = None  # GPUArray int32 (capacity,): the kept block ids
        self.kept = None  # the seq.kept_blocks() array the table was checked against (identity)
        self.table_host = np.zeros(0, np.int64)  # what the device table holds
        self.new_slots: np.ndarray | None = None  # global slots returned by the latest append
        self.new_first = 0  # token index (0 = the sequence's first token) of the first of them
        self.new_dev = None  # their logical indices as int32 in VRAM (uploaded at the first store)
        self.new_dev_first = -1  # the logical index new_dev starts at


@dataclass(frozen=True)
class DevicePagedKV:
    """One layer's K/V as the CUDA attention kernels read them: f16 pools, a block table,
    positions per physical slot; the first n_keys logical slots are the keys."""

    k: Any  # (n_phys_slots, n_kv, hd) f16
    v: Any  # (n_phys_slots, n_kv, hd_v) f16
    block_table: Any  # int32 (>= ceil(n_keys / block_size),)
    kpos: Any  # int32 (n_phys_slots,)
    n_keys: int
    block_size: int


class DeviceBlockStorage:
    """VRAM K/V of `layers` for a PagedKVCache, block for block (see paged_kv's docstring).

    k[layer]: (num_blocks, block_size, n_head_kv, head_dim) f16, v[layer]: (..., head_dim_v);
    pos: (num_blocks * block_size,) int32, the position of the token in each slot (shared by
    the layers, stored with its block). Per sequence: its kept block ids as int32 in VRAM,
    re-uploaded only when they change, and the logical slots of its latest append, uploaded
    once and used by every layer's kv_store.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, layers: list[int]) -> None:
        from pycuda import gpuarray

        self.layers = frozenset(layers)
        self.num_blocks, self.block_size = num_blocks, block_size
        kv_heads, hd, hd_v = config.n_head_kv, config.head_dim, config.head_dim_v
        self.k = {i: gpuarray.zeros((num_blocks, block_size, kv_heads, hd), np.float16) for i in sorted(self.layers)}
        self.v = {i: gpuarray.zeros((num_blocks, block_size, kv_heads, hd_v), np.float16) for i in sorted(self.layers)}
        # flat views (num_blocks * block_size, n_kv, hd): what the kernels index by physical slot
        self.k_flat = {i: a.reshape(num_blocks * block_size, kv_heads, hd) for i, a in self.k.items()}
        self.v_flat = {i: a.reshape(num_blocks * block_size, kv_heads, hd_v) for i, a in self.v.items()}
        self.pos = gpuarray.zeros(num_blocks * block_size, np.int32)
        self._seqs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k.values()) + sum(a.nbytes for a in self.v.values()) + self.pos.nbytes

    def _state(self, seq: "SequenceKV") -> _SeqState:
        st = self._seqs.get(seq)
        if st is None:
            st = self._seqs[seq] = _SeqState()
        return st

    # -- PagedKVCache notifications -----------------------------------------------------------
    def on_append(self, seq: "SequenceKV", slots: np.ndarray, positions: np.ndarray) -> None:
        """New tokens got `slots` (global): write their positions, note their logical indices."""
        positions = np.asarray(positions, np.int32)
        start = 0
        for lo, hi in _runs(np.asarray(slots)):  # one copy per run of consecutive slots
            self.pos[lo:hi].set(positions[start:start + hi - lo])
            start += hi - lo
        st = self._state(seq)
        st.new_slots, st.new_first, st.new_dev = slots, seq.n_used - len(slots), None

    def store(self, seq: "SequenceKV", layer: int, slots: np.ndarray, k: Any, v: Any) -> None:
        """K/V rows (n, n_kv, hd) of the tokens in `slots` -> this layer's device blocks."""
        from edgeinfer.kernels_cuda import launch

        launch.kv_store(_device_f32(k), _device_f32(v), self.k[layer], self.v[layer], self.block_table(seq),
                        self._logical_slots(seq, slots), self.block_size)

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """The first n rows of block src -> block dst, every layer and the positions (copy-on-write)."""
        from edgeinfer.kernels_cuda import launch

        bs = self.block_size
        for flat in (*self.k_flat.values(), *self.v_flat.values(), self.pos):
            launch.copy_rows(flat, src * bs, dst * bs, n)

    def layer_view(self, seq: "SequenceKV", layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies (n_held, n_kv, hd) / (..., hd_v) of the sequence's K/V, in token order."""
        bs, held = self.block_size, seq.n_held
        runs = _runs(seq.kept_blocks())
        k = [self.k_flat[layer][lo * bs:hi * bs].get() for lo, hi in runs]
        v = [self.v_flat[layer][lo * bs:hi * bs].get() for lo, hi in runs]
        if not runs:
            return self.k_flat[layer][:0].get(), self.v_flat[layer][:0].get()
        return np.concatenate(k)[:held], np.concatenate(v)[:held]

    # -- what the kernels read ----------------------------------------------------------------
    def block_table(self, seq: "SequenceKV") -> Any:
        """The sequence's kept block ids as int32 in VRAM; uploaded only when they changed."""
        st = self._state(seq)
        kept = seq.kept_blocks()
        if kept is st.kept:  # the same cached array: the table has not changed
            return st.table
        if st.table is None:
            from pycuda import gpuarray

            st.table = gpuarray.zeros(max(1, -(-seq.n_ctx // self.block_size)), np.int32)
        if not np.array_equal(kept, st.table_host):
            st.table[:len(kept)].set(kept.astype(np.int32))
            st.table_host = np.array(kept)
        st.kept = kept
        return st.table

    def _logical_slots(self, seq: "SequenceKV", slots: np.ndarray) -> Any:
        """Logical indices (int32, VRAM) of global `slots`: the kv_store kernel maps them back
        through the block table. The latest append's slots (every model store) are uploaded once."""
        from pycuda import gpuarray

        st = self._state(seq)
        bs = self.block_size
        if slots is st.new_slots:
            first = st.new_first - seq.n_dropped * bs  # logical = token index less the dropped blocks
            if st.new_dev is None or st.new_dev_first != first:
                st.new_dev = gpuarray.to_gpu(np.arange(first, first + len(slots), dtype=np.int32))
                st.new_dev_first = first
            return st.new_dev
        index = {int(b): i for i, b in enumerate(seq.kept_blocks())}
        slots = np.asarray(slots, np.int64)
        logical = [index[int(s) // bs] * bs + int(s) % bs for s in slots]
        return gpuarray.to_gpu(np.asarray(logical, np.int32))

    def view(self, seq: "SequenceKV", layer: int) -> DevicePagedKV:
        return DevicePagedKV(self.k_flat[layer], self.v_flat[layer], self.block_table(seq), self.pos,
                             seq.n_held, self.block_size)


def device_kv(kv: Any, layer: int) -> DevicePagedKV | None:
    """`layer`'s K/V in VRAM for the attention kernels, or None where they are on the host."""
    if isinstance(kv, CudaKVCache):
        return kv.device_view(layer)
    cache = getattr(kv, "cache", None)
    device = getattr(cache, "device", None)
    if isinstance(device, DeviceBlockStorage) and layer in device.layers:
        return device.view(kv, layer)
    return None


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

    def kv_layers(self, config: ModelConfig) -> list[int]:
        """GPU layers whose K/V live in VRAM: those the CUDA attention kernels can read (a head
        dim they lack keeps that layer's K/V on the host, where its CPU attention runs)."""
        from edgeinfer.kernels_cuda import launch

        if not launch.attention_supports(config.head_dim, config.head_dim_v):
            return []
        return [i for i in self.plan.gpu_layers if i < config.n_layer]

    def new_block_storage(self, config: ModelConfig, num_blocks: int, block_size: int) -> DeviceBlockStorage | None:
        """VRAM blocks for the session manager's paged pool (None when no layer keeps K/V there)."""
        layers = self.kv_layers(config)
        return DeviceBlockStorage(config, num_blocks, block_size, layers) if layers else None

    def max_kv_blocks(self, config: ModelConfig, block_size: int) -> int | None:
        """Blocks of the paged pool the plan reserved VRAM for (its KV bytes for n_ctx tokens),
        or None when the plan gives no KV budget (a hand-made plan)."""
        layers = self.kv_layers(config)
        per_block = len(layers) * block_size * config.n_head_kv * (config.head_dim + config.head_dim_v) * 2
        if not self.plan.vram_kv or not per_block:
            return None
        return self.plan.vram_kv // per_block

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
        d = device_kv(kv, layer) if self._on_gpu else None
        if d is not None and launch.attention_supports(d.k.shape[2], d.v.shape[2]):
            out = launch.attention(self.to_device(q).array, d.k, d.v, d.block_table, d.kpos, self._ints(positions),
                                   d.n_keys, d.block_size, d.k.shape[1], d.v.shape[2], scale * q_scale, window)
            return DeviceTensor(out, self)
        out = self.cpu.attention(self.to_host(q), kv, layer, positions, scale, window, q_scale=q_scale)
        return self.to_device(out) if self._on_gpu else out


def make_backend(gguf: "GGUFFile", plan: "OffloadPlan", cpu: Backend) -> Backend:
    """The hybrid backend when the plan puts anything on the GPU, else `cpu` unchanged."""
    return HybridBackend(gguf, plan, cpu) if plan.on_gpu else cpu
