"""VRAM K/V: the paged pool's device blocks, and the contiguous cache with VRAM layers.

- `DeviceBlockStorage`: the VRAM side of the session manager's paged KV pool
  (edgeinfer.kv.paged.PagedKVCache): per GPU layer a pool of K/V blocks (f16, or the rows of
  a quantized cache type: edgeinfer.kv.cache_types) with the same
  block ids as the host pool, plus the position of every slot. The kv_store kernel writes
  a sequence's new tokens through its block table, the paged attention kernels read them
  through it; copy-on-write copies device blocks too. Shared prefix blocks are shared in
  VRAM exactly as in the host pool (one ref count, one copy).
- `CudaKVCache`: one contiguous sequence (bench, direct Engine use): GPU layers keep K/V
  in VRAM (f16, read by the paged attention kernels with a one-block table); CPU layers
  keep the host arrays. A KVView, as KVCache.
- `device_kv(kv, layer)`: a layer's VRAM K/V as the attention kernels read them, or None.

pycuda is imported inside the functions (an optional dependency): importing this module
never needs it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeinfer.backends.device_tensor import DeviceTensor
from edgeinfer.kernels_cuda import graph, launch
from edgeinfer.kv import device_step
from edgeinfer.kv.cache_types import F16
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.kv.device_step import DeviceStep, step_ints

if TYPE_CHECKING:
    from edgeinfer.kv.cache_types import CacheTypes
    from edgeinfer.kv.sequence import SequenceKV
    from edgeinfer.models.config import ModelConfig


class CudaKVCache(KVCache):
    """K/V of GPU layers live in VRAM (n_ctx, the layer's n_kv, hd) f16; the rest as in KVCache."""

    def __init__(self, config: "ModelConfig", n_ctx: int, gpu_layers: list[int],
                 cache_types: "CacheTypes | None" = None) -> None:
        super().__init__(config, n_ctx, cache_types=cache_types)
        from pycuda import gpuarray

        self.gpu_layers = set(gpu_layers)
        self.hd_v = {i: config.head_dim_v_of(i) for i in self.gpu_layers}
        t = self.cache_types
        self.k_dev = {i: launch.zeros((n_ctx, *_row_shape(config, t, "k", i)), t.dtype("k")) for i in self.gpu_layers}
        self.v_dev = {i: launch.zeros((n_ctx, *_row_shape(config, t, "v", i)), t.dtype("v")) for i in self.gpu_layers}
        for i in self.gpu_layers:  # their host copies are filled on demand only (layer_view)
            self.k[i] = np.zeros((0, *_row_shape(config, t, "k", i)), t.dtype("k"))
            self.v[i] = np.zeros((0, *_row_shape(config, t, "v", i)), t.dtype("v"))
        self.block_table = gpuarray.to_gpu(np.zeros(1, np.int32))  # one block of n_ctx slots
        self.pos_dev = launch.zeros(n_ctx, np.int32)
        self._new: tuple[np.ndarray, np.ndarray] | None = None  # the latest append: (slots, positions)
        self._step: DeviceStep | None = None  # its ints in VRAM (edgeinfer.kv.device_step)
        self._graph: tuple[tuple, DeviceStep] | None = None  # (for which step and inputs, the ints as their field)
        self._appends = 0  # appends so far: which step the cached step ints belong to

    def append(self, positions: np.ndarray) -> np.ndarray:
        slots = super().append(positions)
        positions = np.asarray(positions, np.int32)
        self._new, self._step = (slots, positions), None
        self._appends += 1
        if device_step.graph_mode():  # the step's inputs, and the positions by a kernel of the step
            self._graph_step()
        elif len(slots):
            lo = int(slots[0])
            self.pos_dev[lo:lo + len(slots)].set(positions)
        return slots

    def truncate(self, n: int) -> None:
        super().truncate(n)
        self._new, self._step = None, None

    def _step_ints(self) -> np.ndarray:
        slots, positions = self._new if self._new is not None else (np.zeros(0, np.int64), np.zeros(0, np.int32))
        return step_ints(self.n_used, slots, positions)

    def _device_step(self, slots: np.ndarray | None = None) -> DeviceStep:
        """This step's ints in VRAM: the latest append's (uploaded once), or other `slots`'."""
        if slots is not None and (self._new is None or slots is not self._new[0]):
            graph.forbid("K/V stored into slots of an earlier append")
            return device_step.upload_step(step_ints(self.n_used, slots, self.pos[np.asarray(slots)]))
        if device_step.graph_mode():
            return self._graph_step()
        if self._step is None:
            self._step = device_step.upload_step(self._step_ints())
        return self._step

    def _graph_step(self) -> DeviceStep:
        """The step ints as a field of the step's inputs, written once for this step and these
        inputs (see DeviceBlockStorage._graph_fields)."""
        key = (id(graph.current_inputs()), self.n_used, self._appends)
        if self._graph is None or self._graph[0] != key:
            step = device_step.upload_step(self._step_ints())
            device_step.write_positions(self.pos_dev, self.block_table, step, self.n_ctx)
            self._graph = (key, step)
        return self._graph[1]

    def prepare_graph_step(self) -> None:
        """A replay's K/V fields, for a step whose append already ran."""
        self._graph_step()

    def store(self, layer: int, slots: np.ndarray, k: Any, v: Any) -> None:
        if layer not in self.gpu_layers:
            graph.forbid("K/V of a host layer")
            super().store(layer, slots, _host(k), _host(v))
            return
        store_rows(self.cache_types, k, v, self.k_dev[layer], self.v_dev[layer], self.block_table,
                   self._device_step(slots).slots, self.n_ctx)

    def f16_store_target(self, layer: int, slots: np.ndarray) -> "F16StoreTarget | None":
        """Where store(layer, slots, ...) writes f16 rows straight into VRAM (None: elsewhere)."""
        if layer not in self.gpu_layers or self.cache_types.quantized:
            return None
        return F16StoreTarget(self.k_dev[layer], self.v_dev[layer], self.block_table, self._device_step(slots).slots,
                              self.n_ctx)

    def layer_view(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if layer not in self.gpu_layers:
            return super().layer_view(layer)
        n = self.n_used
        return self.k_dev[layer][:n].get(), self.v_dev[layer][:n].get(), self.pos[:n]

    def device_view(self, layer: int) -> "DevicePagedKV | None":
        if layer not in self.gpu_layers:
            return None
        return DevicePagedKV(self.k_dev[layer], self.v_dev[layer], self.block_table, self.pos_dev,
                             self._device_step().n_keys, self.n_ctx, self.hd_v[layer], self.cache_types)


def _row_shape(config: "ModelConfig", types: "CacheTypes", which: str, layer: int) -> tuple[int, int]:
    """(K/V heads, row width) of `layer`'s stored K or V rows: values (f16) or bytes (quantized)."""
    size = config.head_dim_of(layer) if which == "k" else config.head_dim_v_of(layer)
    return config.n_head_kv_of(layer), types.width(which, size)


def store_rows(types: "CacheTypes", k: Any, v: Any, k_cache: Any, v_cache: Any, block_table: Any, slots: Any,
               block_size: int) -> None:
    """New tokens' K/V (float32 rows) into their logical `slots` of a paged device cache: f16 by
    kv_store, a quantized side by kv_store_quant (rotated, then quantized as the CPU does)."""
    if not types.quantized:
        launch.kv_store(_device_f32(k), _device_f32(v), k_cache, v_cache, block_table, slots, block_size)
        return
    for which, rows, cache in (("k", k, k_cache), ("v", v, v_cache)):
        launch.kv_store_quant(_device_f32(rows), cache, block_table, slots, block_size, types.of(which),
                              types.rotation(which))


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
        self.new_positions = np.zeros(0, np.int32)  # their positions
        self.step: DeviceStep | None = None  # this step's ints in VRAM (edgeinfer.kv.device_step)
        self.step_key: tuple | None = None  # (n_held, n_dropped, appends) it was made for
        self.graph_fields: tuple[Any, DeviceStep] | None = None  # (table, step) as a graph's step inputs
        self.graph_key: tuple | None = None  # (inputs, n_held, n_dropped, appends) they were written for
        self.appends = 0  # appends so far: which step the cached step ints belong to


@dataclass(frozen=True)
class F16StoreTarget:
    """Where a store of new K/V rows lands as f16 in VRAM, as kv_store takes it: the cache rows,
    the block table and the rows' logical slots (int32, VRAM)."""

    k: Any
    v: Any
    block_table: Any
    slots: Any
    block_size: int


@dataclass(frozen=True)
class DevicePagedKV:
    """One layer's K/V as the CUDA attention kernels read them: pools of rows (f16 values, or
    a quantized type's raw blocks), a block table, positions per physical slot; the first
    n_keys logical slots are the keys."""

    k: Any  # (n_phys_slots, n_kv, hd) f16, or (..., row bytes) uint8
    v: Any  # (n_phys_slots, n_kv, hd_v) f16, or (..., row bytes) uint8
    block_table: Any  # int32 (>= ceil(n_keys / block_size),)
    kpos: Any  # int32 (n_phys_slots,)
    n_keys: Any  # int32 (1,) in VRAM: a step's input (edgeinfer.kv.device_step)
    block_size: int
    hd_v: int  # V's head size (a quantized row's width is bytes)
    types: "CacheTypes" = F16  # what the rows are (edgeinfer.kv.cache_types), their rotations


class DeviceBlockStorage:
    """VRAM K/V of `layers` for a PagedKVCache, block for block (see edgeinfer.kv.paged).

    k[layer]: (num_blocks, block_size, the layer's K/V heads and head_dim) f16, v[layer]: (..., head_dim_v);
    pos: (num_blocks * block_size,) int32, the position of the token in each slot (shared by
    the layers, stored with its block). Per sequence: its kept block ids as int32 in VRAM,
    re-uploaded only when they change, and the logical slots of its latest append, uploaded
    once and used by every layer's kv_store.
    """

    def __init__(self, config: "ModelConfig", num_blocks: int, block_size: int, layers: list[int],
                 types: "CacheTypes | None" = None) -> None:
        from pycuda import gpuarray

        self.layers = frozenset(layers)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.types = t = types or F16
        self.hd_v = {i: config.head_dim_v_of(i) for i in self.layers}
        n_slots = num_blocks * block_size
        self.k = {i: launch.zeros((num_blocks, block_size, *_row_shape(config, t, "k", i)), t.dtype("k"))
                  for i in sorted(self.layers)}
        self.v = {i: launch.zeros((num_blocks, block_size, *_row_shape(config, t, "v", i)), t.dtype("v"))
                  for i in sorted(self.layers)}
        # flat views (num_blocks * block_size, n_kv of the layer, hd): what the kernels index by physical slot
        self.k_flat = {i: a.reshape(n_slots, *a.shape[2:]) for i, a in self.k.items()}
        self.v_flat = {i: a.reshape(n_slots, *a.shape[2:]) for i, a in self.v.items()}
        self.pos = launch.zeros(num_blocks * block_size, np.int32)
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
        st = self._state(seq)
        st.new_slots, st.new_first, st.new_positions = slots, seq.n_used - len(slots), positions
        st.appends += 1
        st.step = None
        if device_step.graph_mode():  # the step's inputs, and the positions by a kernel of the step
            self._graph_fields(seq)
            return
        start = 0
        for lo, hi in _runs(np.asarray(slots)):  # one copy per run of consecutive slots
            self.pos[lo:hi].set(positions[start:start + hi - lo])
            start += hi - lo

    def store(self, seq: "SequenceKV", layer: int, slots: np.ndarray, k: Any, v: Any) -> None:
        """K/V rows (n, n_kv, hd) of the tokens in `slots` -> this layer's device blocks."""
        store_rows(self.types, k, v, self.k[layer], self.v[layer], self.block_table(seq),
                   self._logical_slots(seq, slots), self.block_size)

    def store_encoded(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Rows already as the blocks hold them (saved K/V: f16 values or raw blocks) -> this
        layer's device blocks at the global `slots` (a block's id is the same on both sides, so
        a global slot is the physical one): one copy per run of consecutive slots."""
        start = 0
        for lo, hi in _runs(np.asarray(slots)):
            for flat, rows in ((self.k_flat[layer], k), (self.v_flat[layer], v)):
                flat[lo:hi].set(np.ascontiguousarray(rows[start:start + hi - lo], flat.dtype))
            start += hi - lo

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """The first n rows of block src -> block dst, every layer and the positions (copy-on-write)."""
        bs = self.block_size
        for flat in (*self.k_flat.values(), *self.v_flat.values(), self.pos):
            launch.copy_rows(flat, src * bs, dst * bs, n)

    def f16_store_target(self, seq: "SequenceKV", layer: int, slots: np.ndarray) -> F16StoreTarget | None:
        """Where store(seq, layer, slots, ...) writes f16 rows (None: a quantized type, or no VRAM)."""
        if layer not in self.layers or self.types.quantized:
            return None
        return F16StoreTarget(self.k[layer], self.v[layer], self.block_table(seq), self._logical_slots(seq, slots),
                              self.block_size)

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
    def table_capacity(self, seq: "SequenceKV") -> int:
        """Blocks a sequence's table has room for."""
        return max(1, -(-seq.n_ctx // self.block_size))

    def block_table(self, seq: "SequenceKV") -> Any:
        """The sequence's kept block ids as int32 in VRAM; uploaded only when they changed (in
        graph mode, the graph's step input written at the append)."""
        if device_step.graph_mode():
            return self._graph_fields(seq)[0]
        st = self._state(seq)
        kept = seq.kept_blocks()
        if kept is st.kept:  # the same cached array: the table has not changed
            return st.table
        graph.forbid("a block table outside the step's inputs")
        if st.table is None:
            st.table = launch.zeros(self.table_capacity(seq), np.int32)
        if not np.array_equal(kept, st.table_host):
            st.table[:len(kept)].set(kept.astype(np.int32))
            st.table_host = np.array(kept)
        st.kept = kept
        return st.table

    def _step_ints(self, seq: "SequenceKV") -> np.ndarray:
        """[n_keys, logical slots, positions] of the latest append (edgeinfer.kv.device_step)."""
        st = self._state(seq)
        n_new = 0 if st.new_slots is None else len(st.new_slots)
        first = st.new_first - seq.n_dropped * self.block_size  # logical = token index less the dropped blocks
        return step_ints(seq.n_held, np.arange(first, first + n_new), st.new_positions)

    def _step(self, seq: "SequenceKV") -> DeviceStep:
        """The latest append's step ints in VRAM: uploaded once a step (graph mode: a field of
        the step's inputs)."""
        if device_step.graph_mode():
            return self._graph_fields(seq)[1]
        st = self._state(seq)
        key = (seq.n_held, seq.n_dropped, st.appends)
        if st.step is None or st.step_key != key:
            st.step, st.step_key = device_step.upload_step(self._step_ints(seq)), key
        return st.step

    def _graph_fields(self, seq: "SequenceKV") -> tuple[Any, DeviceStep]:
        """(block table, step ints) as fields of the step's inputs, written once for this step and
        these inputs: at the append, or when a graph of some layers starts after it (a partial
        offload's span); while recording, the positions reach the pool by a kernel of the step."""
        st = self._state(seq)
        inputs = graph.current_inputs()
        key = (id(inputs), seq.n_held, seq.n_dropped, st.appends)
        if st.graph_key != key:
            table = device_step.graph_table(seq.kept_blocks(), self.table_capacity(seq))
            step = device_step.upload_step(self._step_ints(seq))
            device_step.write_positions(self.pos, table, step, self.block_size)
            st.graph_fields, st.graph_key = (table, step), key
        return st.graph_fields

    def prepare_graph_step(self, seq: "SequenceKV") -> None:
        """A replay's K/V fields, for a step whose append already ran."""
        self._graph_fields(seq)

    def _logical_slots(self, seq: "SequenceKV", slots: np.ndarray) -> Any:
        """Logical indices (int32, VRAM) of global `slots`: the kv_store kernel maps them back
        through the block table. The latest append's slots (every model store) are uploaded once."""
        from pycuda import gpuarray

        st = self._state(seq)
        bs = self.block_size
        if slots is st.new_slots:
            return self._step(seq).slots
        graph.forbid("K/V stored into slots of an earlier append")
        index = {int(b): i for i, b in enumerate(seq.kept_blocks())}
        slots = np.asarray(slots, np.int64)
        logical = [index[int(s) // bs] * bs + int(s) % bs for s in slots]
        return gpuarray.to_gpu(np.asarray(logical, np.int32))

    def view(self, seq: "SequenceKV", layer: int) -> DevicePagedKV:
        return DevicePagedKV(self.k_flat[layer], self.v_flat[layer], self.block_table(seq), self.pos,
                             self._step(seq).n_keys, self.block_size, self.hd_v[layer], self.types)


def paged_device(kv: Any) -> DeviceBlockStorage | None:
    """The VRAM blocks of the paged pool `kv` is a sequence of, or None."""
    device = getattr(getattr(kv, "cache", None), "device", None)
    return device if isinstance(device, DeviceBlockStorage) else None


def prepare_graph_step(kv: Any) -> None:
    """Write the K/V fields of the step `kv` last appended into the graph inputs being prepared
    (edgeinfer.kernels_cuda.graph.preparing); nothing where the K/V are not in VRAM."""
    if isinstance(kv, CudaKVCache):
        kv.prepare_graph_step()
    elif (device := paged_device(kv)) is not None:
        device.prepare_graph_step(kv)


def f16_store_target(kv: Any, layer: int, slots: np.ndarray) -> F16StoreTarget | None:
    """Where kv.store(layer, slots, k, v) would write f16 rows straight into VRAM with no host
    work between (a kernel may then write them itself: rope_qk_store); None otherwise."""
    if isinstance(kv, CudaKVCache):
        return kv.f16_store_target(layer, slots)
    device = paged_device(kv)
    device_slots = kv.direct_device_slots(layer, slots) if device is not None else None
    return None if device_slots is None else device.f16_store_target(kv, layer, device_slots)


def device_kv(kv: Any, layer: int) -> DevicePagedKV | None:
    """`layer`'s K/V in VRAM for the attention kernels, or None where they are on the host."""
    if isinstance(kv, CudaKVCache):
        return kv.device_view(layer)
    device = paged_device(kv)
    return device.view(kv, layer) if device is not None and layer in device.layers else None
