"""The hybrid CPU/GPU dispatcher: each layer's ops run where the offload plan's table puts it.

`HybridBackend` is what a model talks to when anything is offloaded. `placement` is the
explicit per-layer table from the OffloadPlan ("cuda" or "cpu" for every block, and
`head_placement` for the output head). Named ops (`linear`, `rms_norm`, `attention`) run
on their tensor's or layer's side; unnamed ones (`silu_mul`, `gelu_mul`, `rope`) follow
their input, and an `add` (the residual, `x + y` in the family files) runs on the side of
the layer being run, which the forward pass names with `at_layer`. The hidden state moves
only when the layer side changes (one upload before the first GPU layer, one download after
the last), through pinned host buffers.

The engine wires it with `make_backend(gguf, plan, cpu_backend)`; the session manager asks
`new_block_storage(config, num_blocks, block_size)` for VRAM blocks of the paged pool
(edgeinfer.kv.device_storage), direct users `new_cache(config, n_ctx)`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeinfer.backends.base import Backend
from edgeinfer.backends.cuda import HEAD_NAMES, CudaBackend, layer_of
from edgeinfer.backends.cuda_graph import StepGraphs
from edgeinfer.backends.device_tensor import DeviceTensor
from edgeinfer.kernels_cuda import graph, launch
from edgeinfer.kernels_cuda.graph import HIDDEN, POSITIONS
from edgeinfer.kv.device_storage import CudaKVCache, DeviceBlockStorage, device_kv, f16_store_target
from edgeinfer.kv.pool_sizing import vram_kv_blocks
from edgeinfer.kv.view import KVView
from edgeinfer.rope import ROPE_NEOX, RopeArgs, Yarn

if TYPE_CHECKING:
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.kv.cache_types import CacheTypes
    from edgeinfer.models.config import ModelConfig
    from edgeinfer.backends.offload import OffloadPlan

CUDA, CPU = "cuda", "cpu"


class HybridBackend(Backend):
    """Each block on the side `placement` names ("cuda" or "cpu"), the head on `head_placement`."""

    name = "hybrid"

    def __init__(self, gguf: "GGUFFile", plan: "OffloadPlan", cpu: Backend, cuda: CudaBackend | None = None) -> None:
        super().__init__(gguf)
        self.plan, self.cpu = plan, cpu
        self.cuda = cuda or CudaBackend(gguf, plan)
        self.placement: tuple[str, ...] = plan.placement  # per layer: CUDA or CPU
        self.head_placement = CUDA if plan.output_on_gpu else CPU
        self._side = CPU  # the side of the block being run (at_layer): where an add runs
        self._up: tuple[np.ndarray, DeviceTensor] | None = None  # last upload, by identity
        self._down: tuple[DeviceTensor, np.ndarray] | None = None  # last download, by identity
        self._pinned: np.ndarray | None = None
        self._int_cache: list[tuple[np.ndarray, Any]] = []  # the last few uploads
        self._recurrence = None  # edgeinfer.backends.cuda_recurrence, made on first use
        self.step_graphs = StepGraphs(self)  # CUDA graphs of steps and spans of GPU layers

    def decode_order(self):
        return self.cpu.decode_order()   # the GPU kernels have one order for any batch

    def new_cache(self, config: "ModelConfig", n_ctx: int, cache_types: "CacheTypes | None" = None) -> CudaKVCache:
        return CudaKVCache(config, n_ctx, self.kv_layers(config), cache_types)

    def kv_layers(self, config: "ModelConfig") -> list[int]:
        """GPU layers whose K/V live in VRAM: those the CUDA attention kernels can read (a head
        dim they lack keeps that layer's K/V on the host, where its CPU attention runs); a
        recurrent layer keeps none (its state is the sequence's, edgeinfer.kv.recurrent)."""
        return [i for i in range(config.n_layer) if self._layer_side(i) == CUDA and config.owns_kv(i)
                and launch.attention_supports(config.head_dim_of(i), config.head_dim_v_of(i))]

    def new_block_storage(self, config: "ModelConfig", num_blocks: int, block_size: int,
                          cache_types: "CacheTypes | None" = None) -> DeviceBlockStorage | None:
        """VRAM blocks for the session manager's paged pool (None when no layer keeps K/V there)."""
        layers = self.kv_layers(config)
        return DeviceBlockStorage(config, num_blocks, block_size, layers, cache_types) if layers else None

    def max_kv_blocks(self, config: "ModelConfig", block_size: int, cache_types: "CacheTypes | None" = None
                      ) -> int | None:
        """Blocks of the paged pool the plan reserved VRAM for (its KV bytes for n_ctx tokens),
        or None when the plan gives no KV budget (a hand-made plan)."""
        return vram_kv_blocks(self.plan.vram_kv, config, self.kv_layers(config), block_size, cache_types)

    def vector(self, name: str) -> np.ndarray:
        return self.cpu.vector(name)

    def recurrence(self, layer: int, head_dim: int):
        """An offloaded DeltaNet layer's recurrence runs in VRAM (None: on the host)."""
        if self._layer_side(layer) != CUDA or not launch.delta_net_supports(head_dim):
            return None
        if self._recurrence is None:
            from edgeinfer.backends.cuda_recurrence import CudaRecurrence

            self._recurrence = CudaRecurrence(self)
        return self._recurrence

    def run_layers(self, n_layer: int, x: Any, layer, positions: np.ndarray, kv: KVView) -> Any:
        """Each run of consecutive GPU layers through step_graphs.span (a graph at a partial offload)."""
        i = 0
        while i < n_layer:
            end = i + 1
            while end < n_layer and self._layer_side(end) == self._layer_side(i):
                end += 1
            run = functools.partial(self.run_layers_from, i, end, x, layer)
            x = self.step_graphs.span(i, end, x, positions, kv, run) if self._layer_side(i) == CUDA else run()
            i = end
        return x

    def wrap(self, array: Any) -> DeviceTensor:
        return DeviceTensor(array, self)

    # -- placement and transfers ------------------------------------------------------------
    def at_layer(self, layer: int | None) -> None:
        self._side = self.head_placement if layer is None else self._layer_side(layer)

    def _layer_side(self, layer: int) -> str:
        return self.placement[layer] if layer < len(self.placement) else CPU

    def _gpu_for(self, name: str) -> bool:
        """Whether the op on tensor `name` runs on the GPU: its layer's side, or the head's."""
        layer = layer_of(name)
        if layer is not None:
            return self._layer_side(layer) == CUDA
        return self.head_placement == CUDA and name in HEAD_NAMES + ("token_embd.weight",)

    def _vector_on_gpu(self, x: Any, weight: str) -> bool:
        """Where an op with the vector `weight` runs: a layer's or the head's vector on their
        side; another (a unit weight, a global norm) beside its input, within the block's side."""
        if layer_of(weight) is not None or weight in HEAD_NAMES:
            return self._gpu_for(weight)
        return isinstance(x, DeviceTensor) and self._side == CUDA

    def _pinned_view(self, shape: tuple[int, ...]) -> np.ndarray:
        import pycuda.driver as drv

        size = int(np.prod(shape))
        if self._pinned is None or self._pinned.size < size:
            self._pinned = drv.pagelocked_empty(max(size, 1 << 16), np.float32)
        return self._pinned[:size].reshape(shape)

    def to_device(self, x: Any) -> DeviceTensor:
        if isinstance(x, DeviceTensor):
            return x
        rec = graph.current_recorder()
        if rec is not None:
            return self._step_input(rec, x)
        if self._up is not None and self._up[0] is x:
            return self._up[1]
        from pycuda import gpuarray

        staged = self._pinned_view(x.shape)
        staged[...] = x
        dev = DeviceTensor(gpuarray.to_gpu(staged), self)
        self._up = (x, dev)
        return dev

    def _step_input(self, rec: "graph.Recorder", x: np.ndarray) -> DeviceTensor:
        """While a step records for a graph: the step's input rows (its embeddings) become the
        step's `hidden` field; any other host tensor makes the step eager."""
        first = rec.values.get("hidden rows")
        if first is not None and first[0] is x:  # the same rows again (the residual)
            return first[1]
        if first is None and tuple(x.shape) == rec.values.get(HIDDEN):
            field = rec.inputs.field(HIDDEN, np.asarray(x, np.float32).reshape(-1))
            dev = DeviceTensor(field.reshape(x.shape), self)
            rec.values["hidden rows"] = (x, dev)
            return dev
        rec.forbid(f"a host tensor {tuple(x.shape)} uploaded in the middle of the step (a layer on the CPU)")
        from pycuda import gpuarray

        with rec.allowed():
            return DeviceTensor(gpuarray.to_gpu(np.ascontiguousarray(x, np.float32)), self)

    def to_host(self, x: Any) -> np.ndarray:
        if not isinstance(x, DeviceTensor):
            return x
        graph.forbid("a tensor downloaded in the middle of the step")
        if self._down is not None and self._down[0] is x:
            return self._down[1]
        host = x.array.get(ary=self._pinned_view(x.shape)).copy()
        self._down = (x, host)
        return host

    def _ints(self, values: np.ndarray) -> Any:
        """Host ints (positions, experts of grouped rows) as int32 in VRAM, by identity: the
        positions are reused across the layers of one step."""
        rec = graph.current_recorder()
        if rec is not None and values is rec.values.get(POSITIONS):  # the step's positions: a field of its inputs
            return rec.inputs.field(POSITIONS, np.asarray(values, np.int32))
        for host, dev in self._int_cache:
            if host is values:
                return dev
        graph.forbid("host integers uploaded in the middle of the step")
        from pycuda import gpuarray

        dev = gpuarray.to_gpu(np.asarray(values, np.int32))
        self._int_cache = [(values, dev)] + self._int_cache[:3]
        return dev

    def add(self, a: Any, b: Any) -> Any:
        """`a + b` with a DeviceTensor among them, on the side of the block being run."""
        if self._side == CUDA:
            if isinstance(b, np.ndarray) and b.ndim == 1 and b.shape[0] == a.shape[-1]:  # a bias row
                out = launch.copy(self.to_device(a).array)
                launch.add_rows(out, self.cuda.upload_vector_array(b))
                return DeviceTensor(out, self)
            if tuple(a.shape) != tuple(b.shape):
                raise ValueError(f"device add of shapes {tuple(a.shape)} and {tuple(b.shape)}: only equal "
                                 f"shapes or a row to broadcast")
            return DeviceTensor(launch.add(self.to_device(a).array, self.to_device(b).array), self)
        return self.to_host(a) + self.to_host(b)

    def mul(self, a: Any, b: Any) -> Any:
        """`a * b` with a DeviceTensor among them, on the side of the block being run: b a
        scalar, a row to broadcast, or a tensor of a's shape."""
        if self._side != CUDA:
            return self.to_host(a) * (self.to_host(b) if isinstance(b, DeviceTensor) else b)
        x = self.to_device(a).array
        if np.ndim(b) == 0:
            return DeviceTensor(launch.scale(x, float(b)), self)
        if isinstance(b, np.ndarray) and b.ndim == 1 and a.ndim > 1 and b.shape[0] == a.shape[-1]:
            return DeviceTensor(launch.mul_rows(x, self.cuda.upload_vector_array(b)), self)
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"device mul of shapes {tuple(a.shape)} and {tuple(b.shape)}: only equal "
                             f"shapes, a row to broadcast or a scalar")
        other = b.array if isinstance(b, DeviceTensor) else self._upload(b)
        return DeviceTensor(launch.mul(x, other), self)

    def _upload(self, x: np.ndarray) -> Any:
        """A host operand (not the hidden state) as a float32 GPUArray."""
        graph.forbid("a host operand uploaded in the middle of the step")
        from pycuda import gpuarray

        return gpuarray.to_gpu(np.ascontiguousarray(x, np.float32))

    # -- ops ----------------------------------------------------------------------------------
    def linear(self, name: str, x: Any) -> Any:
        on_gpu, is_head = self._gpu_for(name), layer_of(name) is None
        if on_gpu and self.cuda.has_matrix(name):
            y = self.cuda.linear_gpu(name, self.to_device(x).array)
            if not is_head:
                return DeviceTensor(y, self)
            rec = graph.current_recorder()  # logits always end on the host: a graph's result
            if rec is None:
                return y.get()
            rec.output = y
            with rec.allowed():
                return y.get()
        # a type the CUDA kernels lack: this one matrix runs on the CPU, the layer stays on the GPU
        y = self.cpu.linear(name, self.to_host(x))
        return self.to_device(y) if on_gpu and not is_head else y

    # -- fused ops: one launch where the layer runs on the GPU and the step is a few tokens ---------
    def _fusable(self, names: list[str], x: Any) -> bool:
        n_cols = {self.gguf.tensors[name].n_cols for name in names}
        return (len(x.shape) == 2 and x.shape[0] <= launch.MATVEC_MAX_TOKENS and len(n_cols) == 1
                and all(layer_of(name) is not None and self._gpu_for(name) and self.cuda.has_matrix(name)
                        for name in names))

    def linear_many(self, names: list[str], x: Any) -> list[Any]:
        """Q, K and V (up to three matrices on one input) in one launch."""
        if not 1 < len(names) <= launch.MANY_MAX or not self._fusable(names, x):
            return super().linear_many(names, x)
        mats = [self.cuda.matrix(name) for name in names]
        ys = launch.linear_many(mats, self.gguf.tensors[names[0]].n_cols, self.to_device(x).array)
        return [DeviceTensor(y, self) for y in ys]

    def gated_linear(self, gate: str, up: str, x: Any, act: str) -> Any:
        """Gate, up and the activation in one launch."""
        if not self._fusable([gate, up], x) or self.gguf.tensors[gate].n_rows != self.gguf.tensors[up].n_rows:
            return super().gated_linear(gate, up, x, act)
        (wg, tg, rows), (wu, tu, _) = self.cuda.matrix(gate), self.cuda.matrix(up)
        y = launch.linear_glu((wg, tg), (wu, tu), rows, self.gguf.tensors[gate].n_cols, self.to_device(x).array, act)
        return DeviceTensor(y, self)

    def linear_residual(self, name: str, x: Any, residual: Any) -> Any:
        """The residual added as the matmul writes (the down and output projections)."""
        if layer_of(name) is None or not self._gpu_for(name) or not self.cuda.has_matrix(name) \
                or self._side != CUDA or tuple(residual.shape) != (x.shape[0], self.gguf.tensors[name].n_rows):
            return super().linear_residual(name, x, residual)
        y = self.cuda.linear_gpu(name, self.to_device(x).array, self.to_device(residual).array)
        return DeviceTensor(y, self)

    def residual_rms_norm(self, residual: Any, x: Any, weight: str, eps: float) -> Any:
        """The residual added as the norm writes (Gemma's post-norms)."""
        if self._side != CUDA or not self._vector_on_gpu(x, weight) or tuple(residual.shape) != tuple(x.shape):
            return super().residual_rms_norm(residual, x, weight, eps)
        out = launch.rms_norm(self.to_device(x).array, self.cuda.vector_gpu(weight), eps,
                              self.to_device(residual).array)
        return DeviceTensor(out, self)

    def expert_batch(self, names, experts, starts, rows_of, x):
        """On the GPU where the plan put this layer's experts in VRAM (and the CUDA kernels take
        their type), else on the CPU (llama.cpp's --n-cpu-moe split)."""
        if not all(self.cuda.has_matrix(name) for name in names):
            return self.cpu.expert_batch(names, experts, starts, rows_of, self.to_host(x))
        graph.forbid("experts routed on the host")
        route = launch.ExpertRoute(experts, starts, rows_of)
        xd = self.to_device(x).array
        return [DeviceTensor(self.cuda.expert_linear_gpu(name, xd, route), self) for name in names]

    def expert_bias(self, y, name, expert_of_row):
        if not isinstance(y, DeviceTensor):
            return self.cpu.expert_bias(y, name, expert_of_row)
        n_expert = self.gguf.tensors[name].shape[1]
        out = y.array.copy()
        launch.add_id(out, self.cuda.vector_gpu(name).reshape(n_expert, -1), self._ints(expert_of_row))
        return DeviceTensor(out, self)

    def scale_rows(self, x, factors):
        if not isinstance(x, DeviceTensor):
            return self.cpu.scale_rows(x, factors)
        return DeviceTensor(launch.scale_rows(x.array, self._upload(factors)), self)

    def expert_combine(self, y, order, weights):
        if not isinstance(y, DeviceTensor):
            return self.cpu.expert_combine(y, order, weights)
        from pycuda import gpuarray

        graph.forbid("experts combined with host weights")
        n, k = weights.shape
        slot = np.empty(len(order), np.int32)
        slot[order] = np.arange(len(order), dtype=np.int32)  # assignment t * k + j -> its grouped row
        w = gpuarray.to_gpu(np.ascontiguousarray(weights, np.float32).reshape(-1))
        return DeviceTensor(launch.moe_combine(y.array, gpuarray.to_gpu(slot), w, n, k), self)

    def get_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self.cpu.get_rows(name, ids)

    def rms_norm(self, x: Any, weight: str, eps: float) -> Any:
        if self._vector_on_gpu(x, weight):
            return DeviceTensor(launch.rms_norm(self.to_device(x).array, self.cuda.vector_gpu(weight), eps), self)
        return self.cpu.rms_norm(self.to_host(x), weight, eps)

    def silu_mul(self, gate: Any, up: Any) -> Any:
        if isinstance(gate, DeviceTensor):
            return DeviceTensor(launch.silu_mul(gate.array, self.to_device(up).array), self)
        return self.cpu.silu_mul(gate, self.to_host(up))

    def gelu_mul(self, gate: Any, up: Any) -> Any:
        if isinstance(gate, DeviceTensor):
            return DeviceTensor(launch.gelu_mul(gate.array, self.to_device(up).array), self)
        return self.cpu.gelu_mul(gate, self.to_host(up))

    def gelu(self, x: Any) -> Any:
        if isinstance(x, DeviceTensor):
            return DeviceTensor(launch.gelu(x.array), self)
        return self.cpu.gelu(x)

    def swiglu_oai(self, gate: Any, up: Any) -> Any:
        if isinstance(gate, DeviceTensor):
            from edgeinfer.experts.activations import OAI_ALPHA, OAI_LIMIT

            return DeviceTensor(launch.swiglu_oai(gate.array, self.to_device(up).array, OAI_ALPHA, OAI_LIMIT), self)
        return self.cpu.swiglu_oai(gate, self.to_host(up))

    def rope(self, x: Any, positions: np.ndarray, n_dims: int, base: float, freq_scale: float, mode: str,
             freq_factors: str | None, yarn: Yarn | None = None) -> Any:
        if isinstance(x, DeviceTensor):
            ff = self._freq_factors(freq_factors)
            out = launch.rope(x.array, self._ints(positions), n_dims, base, freq_scale, mode == ROPE_NEOX, ff, yarn)
            return DeviceTensor(out, self)
        return self.cpu.rope(x, positions, n_dims, base, freq_scale, mode, freq_factors, yarn)

    def _freq_factors(self, name: str | None) -> Any:
        """RoPE's per-frequency divisors in VRAM (None: none)."""
        return self.cuda.vector_gpu(name) if name else None

    def rope_qk(self, q: Any, k: Any, positions: np.ndarray, n_dims: int, base: float, freq_scale: float, mode: str,
                freq_factors: str | None, yarn: Yarn | None = None) -> tuple[Any, Any]:
        """Q and K in one launch, where both are in VRAM with one head size."""
        if not (isinstance(q, DeviceTensor) and isinstance(k, DeviceTensor)) or q.shape[-1] != k.shape[-1]:
            return super().rope_qk(q, k, positions, n_dims, base, freq_scale, mode, freq_factors, yarn)
        ff = self._freq_factors(freq_factors)
        qo, ko = launch.rope_qk(q.array, k.array, self._ints(positions), n_dims, base, freq_scale, mode == ROPE_NEOX,
                                ff, yarn)
        return DeviceTensor(qo, self), DeviceTensor(ko, self)

    def rope_store(self, q: Any, k: Any, v: Any, positions: np.ndarray, rope: RopeArgs, kv: KVView, layer: int,
                   slots: np.ndarray) -> Any:
        """RoPE of Q and K and the K/V store in one launch, where K and V go straight into an f16
        VRAM cache."""
        fused = isinstance(q, DeviceTensor) and isinstance(k, DeviceTensor) and isinstance(v, DeviceTensor) \
            and q.shape[-1] == k.shape[-1] and v.ndim == 3
        target = f16_store_target(kv, layer, slots) if fused else None
        if target is None:
            return super().rope_store(q, k, v, positions, rope, kv, layer, slots)
        n_dims, base, freq_scale, mode, freq_factors, yarn = rope
        ff = self._freq_factors(freq_factors)
        qo = launch.rope_qk_store(q.array, k.array, v.array, self._ints(positions), target.k, target.v,
                                  target.block_table, target.slots, target.block_size, n_dims, base, freq_scale,
                                  mode == ROPE_NEOX, ff, yarn)
        return DeviceTensor(qo, self)

    def attention(self, q: Any, kv: KVView, layer: int, positions: np.ndarray, scale: float,
                  window: int, q_scale: float = 1.0, sinks: str | None = None) -> Any:
        """Over `layer`'s K/V (which a shared-K/V layer of another side may read): on the GPU
        where they are in VRAM, else on the host; the output on the side of the block being run."""
        d = device_kv(kv, layer)
        if d is not None:
            return self._device_attention(q, d, positions, None, scale * q_scale, window, sinks)
        out = self.cpu.attention(self.to_host(q), kv, layer, positions, scale, window, q_scale=q_scale, sinks=sinks)
        return self.to_device(out) if self._side == CUDA else out

    def image_attention(self, q: Any, kv: KVView, layer: int, positions: np.ndarray, firsts: np.ndarray,
                        limits: np.ndarray, scale: float, window: int, q_scale: float = 1.0,
                        sinks: str | None = None) -> Any:
        """K/V in VRAM: one launch, each query masked by its image's last position (launch.attention's
        qlim). K/V on the host: the CPU backend's views of the cache."""
        d = device_kv(kv, layer)
        if d is not None:
            return self._device_attention(q, d, positions, limits, scale * q_scale, window, sinks)
        out = self.cpu.image_attention(self.to_host(q), kv, layer, positions, firsts, limits, scale, window,
                                       q_scale=q_scale, sinks=sinks)
        return self.to_device(out) if self._side == CUDA else out

    def _device_attention(self, q: Any, d: Any, positions: np.ndarray, limits: np.ndarray | None, scale: float,
                          window: int, sinks: str | None) -> Any:
        """launch.attention over device K/V `d`; the output on the side of the block being run."""
        head_sinks = self.cuda.vector_gpu(sinks) if sinks else None
        t = d.types
        qd = self.to_device(q).array
        if t.rot_k:  # a quantized cache's rotations, as the CPU path's (edgeinfer.kv.cache_types)
            qd = launch.hadamard_rows(qd, t.rot_k)
        out = launch.attention(qd, d.k, d.v, d.block_table, d.kpos, self._ints(positions), d.n_keys,
                               d.block_size, d.k.shape[1], d.hd_v, scale, window, head_sinks,
                               k_type=t.k, v_type=t.v, qlim=None if limits is None else self._ints(limits))
        if t.rot_v:
            out = launch.hadamard_rows(out, t.rot_v)
        out = DeviceTensor(out, self)
        return out if self._side == CUDA else self.to_host(out)


def make_backend(gguf: "GGUFFile", plan: "OffloadPlan", cpu: Backend) -> Backend:
    """The hybrid backend when the plan puts anything on the GPU, else `cpu` unchanged."""
    return HybridBackend(gguf, plan, cpu) if plan.on_gpu else cpu

