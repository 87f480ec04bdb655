"""The offload plan: which layers (and whether the output head) run on the GPU.

Like llama.cpp's `-ngl`, the first k transformer blocks go to the GPU and the rest stay
on the CPU, so one step crosses the CPU/GPU boundary at most twice (hidden state down
after block k-1, and up again for the output head when that sits on the GPU).

What a GPU block costs in VRAM: its weight bytes (raw GGUF blocks, uploaded as they
are) + its K/V for the whole context + a share-free scratch area for the activations of
one prefill chunk (allocated once when anything is offloaded). The budget is the free
VRAM minus a safety margin of 5% + 300 MiB (fragmentation, the module image, the
driver's own allocations after we measured).

A mixture of experts' expert tensors (3-D, most of such a model's bytes, each token using
only a few experts' rows) are placed apart, after everything else, as llama.cpp's
--n-cpu-moe split: the blocks' shared tensors (attention, norms, router) and the output
head first, then whole layers' experts from the last GPU layer down as far as the budget
goes, so that the experts of the first N layers stay on the CPU. `n_cpu_moe` fixes N
(--cpu-moe: all of them); left None, the plan picks the smallest N that fits.

`--gpu-layers`:
- "auto": as many leading blocks as fit, then the output head if it still fits.
- 0: CPU only.
- N: exactly min(N, n_layer) blocks (N >= n_layer also asks for the output head when it
  fits, as `-ngl 99` does). If those N blocks do not fit, the plan raises
  `OffloadError` naming how many would fit — an explicit request is never silently
  shrunk (an out-of-memory halfway through loading would be worse, and "auto" is the
  way to say "as many as fit").
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgeinfer.errors import EdgeInferError
from edgeinfer.kernels_cuda.runtime import DeviceInfo  # what the device probe reports
from edgeinfer.kv.pool_sizing import KV_BYTES_PER_VALUE, context_kv_bytes, kv_values_per_token, layer_block_bytes

if TYPE_CHECKING:
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.kv.cache_types import CacheTypes
    from edgeinfer.models.config import ModelConfig

CPU_MOE_ALL = 1 << 30  # an n_cpu_moe past every layer: --cpu-moe, all experts on the CPU
GiB = 1 << 30
MiB = 1 << 20
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 300 * MiB
DEFAULT_PREFILL_ROWS = 512  # activation rows the scratch area is sized for (one prefill chunk)

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


class OffloadError(EdgeInferError):
    """A --gpu-layers request that cannot be honoured (does not fit, bad value)."""


@dataclass(frozen=True)
class ModelSizes:
    """Byte counts the plan needs, from a GGUF file or estimated from a config."""

    layer_weights: tuple[int, ...]  # bytes of the blk.i.* tensors a GPU block uploads, per block
    output_weights: int  # output head (+ output_norm) bytes
    kv_values_per_token: tuple[int, ...]  # K + V values one token adds, per block
    scratch_values_per_row: int  # float32 activations one prefill row needs at once
    n_vocab: int
    expert_weights: tuple[int, ...] = ()  # bytes of each block's expert tensors (placed apart)
    expert_scratch_values_per_row: int = 0  # float32 activations of one row's expert matmuls

    @property
    def n_layer(self) -> int:
        return len(self.layer_weights)


@dataclass(frozen=True)
class OffloadPlan:
    gpu_layers: list[int]
    output_on_gpu: bool
    vram_weights: int
    vram_kv: int
    vram_scratch: int
    reason: str  # why this split (or why CPU only)
    n_layer: int = 0
    device: DeviceInfo | None = None
    cpu_expert_weights: int = 0  # bytes of expert tensors kept on the CPU beside GPU layers
    gpu_expert_layers: tuple[int, ...] = ()  # GPU layers whose experts are in VRAM too
    vram_experts: int = 0  # their bytes (part of vram_weights)
    vram_reserved: int = 0  # bytes the plan left free for the vision encoder

    @property
    def vram_total(self) -> int:
        return self.vram_weights + self.vram_kv + self.vram_scratch

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpu_layers) or self.output_on_gpu

    def layer_on_gpu(self, layer: int) -> bool:
        return layer in self.gpu_layers

    def experts_on_gpu(self, layer: int) -> bool:
        return layer in self.gpu_expert_layers

    @property
    def placement(self) -> tuple[str, ...]:
        """Where each block runs, "cuda" or "cpu", block 0 first (the hybrid backend's table)."""
        on = set(self.gpu_layers)
        return tuple("cuda" if i in on else "cpu" for i in range(max(self.n_layer, max(on, default=-1) + 1)))

    def describe(self) -> str:
        """One line for `edgeinfer show` / `--verbose`."""
        if not self.on_gpu or self.device is None:
            return self.reason if "running on the CPU" in self.reason else f"running on the CPU: {self.reason}"
        dev = self.device
        head = ", output head on GPU" if self.output_on_gpu else ""
        experts = ""
        if self.gpu_expert_layers:
            a, b = self.gpu_expert_layers[0], self.gpu_expert_layers[-1]
            experts += f", experts of layers {a}-{b} on GPU ({_gib(self.vram_experts)})"
        if self.cpu_expert_weights:
            experts += f", experts {_gib(self.cpu_expert_weights)} on the CPU"
        return (f"offloading {len(self.gpu_layers)}/{self.n_layer} layers to GPU "
                f"({dev.name}, {_gib(dev.free_vram)} free): weights {_gib(self.vram_weights)}, "
                f"KV {_gib(self.vram_kv)}, scratch {_gib(self.vram_scratch)}{head}{experts}"
                + (f", {_gib(self.vram_reserved)} kept for the vision encoder" if self.vram_reserved else ""))


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def vram_budget(device: DeviceInfo) -> int:
    """Bytes the plan may use on `device`: free VRAM minus 5% and 300 MiB."""
    return max(0, int(device.free_vram * (1.0 - MARGIN_FRACTION)) - MARGIN_BYTES)


# -- model sizes --------------------------------------------------------------------------

def _scratch_values_per_row(cfg: "ModelConfig") -> int:
    """float32 values live at once for one token of a prefill chunk (x, h, q, k, v, attn, gate, up);
    k and v of the layer with the most K/V heads."""
    kv = max(cfg.n_head_kv_of(i) * (2 * cfg.head_dim + cfg.head_dim_v) for i in range(cfg.n_layer))
    return 3 * cfg.n_embd + 2 * cfg.q_dim + kv + 2 * cfg.n_ff


def model_sizes_from_gguf(gguf: "GGUFFile", cfg: "ModelConfig") -> ModelSizes:
    """Exact byte counts from the file's tensor table (token_embd stays on the CPU: get_rows)."""
    layers = [0] * cfg.n_layer
    experts = [0] * cfg.n_layer
    for name, info in gguf.tensors.items():
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) < cfg.n_layer:
            if is_expert_tensor(name, info.shape):
                experts[int(m.group(1))] += info.n_bytes
            else:
                layers[int(m.group(1))] += info.n_bytes
    for i in range(cfg.n_layer):  # an offloaded DeltaNet layer keeps its state in VRAM
        layers[i] += recurrent_state_bytes(cfg, i)
    head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    output = gguf.tensors[head].n_bytes
    if "output_norm.weight" in gguf.tensors:
        output += gguf.tensors["output_norm.weight"].n_bytes
    expert_rows = cfg.n_expert_used * (3 * cfg.n_ff_exp + cfg.n_embd) if cfg.n_expert else 0
    return ModelSizes(tuple(layers), output, _kv_values_per_layer(cfg),
                      _scratch_values_per_row(cfg), cfg.n_vocab, tuple(experts), expert_rows)


def is_expert_tensor(name: str, shape: tuple[int, ...]) -> bool:
    """A mixture of experts' stacked expert matrices (GGML shape (n_cols, rows, n_expert)),
    or their per-expert biases (gpt-oss: `ffn_*_exps.bias`, (rows, n_expert)): they live
    and are used where the experts run."""
    return len(shape) == 3 or "_exps." in name


def estimate_model_sizes(cfg: "ModelConfig", bits_per_weight: float = 4.85) -> ModelSizes:
    """Config-only estimate: every matrix at `bits_per_weight` (Q4_K_M ~ 4.85), norms in F32."""
    def layer_bytes(i: int) -> int:
        params = (cfg.n_embd * cfg.q_dim + 2 * cfg.n_embd * cfg.n_head_kv_of(i) * cfg.head_dim
                  + cfg.n_head * cfg.head_dim_v * cfg.n_embd + 3 * cfg.n_embd * cfg.n_ff)
        return int(params * bits_per_weight / 8) + 2 * cfg.n_embd * 4 + recurrent_state_bytes(cfg, i)

    output = int(cfg.n_vocab * cfg.n_embd * bits_per_weight / 8) + cfg.n_embd * 4
    return ModelSizes(tuple(layer_bytes(i) for i in range(cfg.n_layer)), output,
                      _kv_values_per_layer(cfg),
                      _scratch_values_per_row(cfg), cfg.n_vocab)


def _kv_values_per_layer(cfg: "ModelConfig") -> tuple[int, ...]:
    """K + V values each layer adds per token: its own head sizes, and 0 for a layer that
    reads an earlier layer's K/V (gemma4's shared K/V is counted once, at its owner) or keeps
    a recurrent state instead (counted with the layer's weights: recurrent_state_bytes)."""
    return tuple(0 if cfg.is_recurrent(i) else kv_values_per_token(cfg, i) for i in range(cfg.n_layer))


STATE_COPIES = 2  # a DeltaNet layer's live state and one snapshot a pass takes, in VRAM


def recurrent_state_bytes(cfg: "ModelConfig", layer: int) -> int:
    """VRAM an offloaded DeltaNet layer's state takes (float32 conv window and delta-rule
    state, STATE_COPIES of them); 0 for other layers. A speculative verify pass keeps one
    more copy per drafted token while it runs."""
    if not cfg.is_recurrent(layer):
        return 0
    dn = cfg.delta_net
    return STATE_COPIES * 4 * (math.prod(dn.conv_state_shape) + math.prod(dn.ssm_state_shape))


# -- the plan -----------------------------------------------------------------------------

def parse_gpu_layers(value: str | int) -> int | str:
    """`--gpu-layers` text -> "auto" or a non-negative int."""
    if isinstance(value, int):
        n = value
    elif str(value).strip().lower() == "auto":
        return "auto"
    else:
        try:
            n = int(str(value).strip())
        except ValueError:
            raise OffloadError(f"--gpu-layers must be a number or 'auto', got {value!r}") from None
    if n < 0:
        raise OffloadError(f"--gpu-layers must be 0 or more, got {n}")
    return n


def plan_offload(sizes: ModelSizes, device: DeviceInfo | None, n_ctx: int, *,
                 kv_dtype: str = "f16", gpu_layers: int | str = "auto",
                 prefill_rows: int = DEFAULT_PREFILL_ROWS, no_device_reason: str = "no GPU",
                 n_cpu_moe: int | None = None, kv_token_bytes: Sequence[int] | None = None,
                 reserve_bytes: int = 0) -> OffloadPlan:
    """Place the first k blocks (and the head when it fits) on `device`, then the experts of
    the GPU blocks from n_cpu_moe on (None: as many as fit); see the module doc.
    `reserve_bytes` stay free for something else in VRAM (the vision encoder)."""
    if reserve_bytes < 0:
        raise OffloadError(f"a VRAM reserve must not be negative, got {reserve_bytes}")
    if kv_dtype not in KV_BYTES_PER_VALUE:
        raise OffloadError(f"unknown KV cache type {kv_dtype!r} (choose from {', '.join(KV_BYTES_PER_VALUE)})")
    if n_cpu_moe is not None and n_cpu_moe < 0:
        raise OffloadError(f"--n-cpu-moe must be 0 or more, got {n_cpu_moe}")
    request = parse_gpu_layers(gpu_layers)
    n_layer = sizes.n_layer

    def cpu(reason: str) -> OffloadPlan:
        return OffloadPlan([], False, 0, 0, 0, reason, n_layer, device)
    kept = f" ({_gib(reserve_bytes)} kept for the vision encoder)" if reserve_bytes else ""

    if device is None:
        return cpu(no_device_reason)
    if request == 0:
        return cpu("--gpu-layers 0")

    if kv_token_bytes is not None:  # each layer's own bytes a token (quantized cache types)
        kv_per_layer = [int(b) * n_ctx for b in kv_token_bytes]
    else:
        kv_per_layer = [context_kv_bytes(v, n_ctx, kv_dtype) for v in sizes.kv_values_per_token]
    rows = max(1, min(prefill_rows, n_ctx))
    scratch_layers = rows * sizes.scratch_values_per_row * 4
    scratch_head = rows * sizes.n_vocab * 4  # logits of a whole chunk (perplexity-style requests)
    scratch_experts = rows * sizes.expert_scratch_values_per_row * 4
    expert_bytes = list(sizes.expert_weights) or [0] * n_layer
    budget = max(0, vram_budget(device) - reserve_bytes)

    def cost(k: int, head: bool, expert_layers: range = range(0)) -> tuple[int, int, int]:
        weights = (sum(sizes.layer_weights[:k]) + (sizes.output_weights if head else 0)
                   + sum(expert_bytes[i] for i in expert_layers))
        kv = sum(kv_per_layer[:k])
        scratch = ((scratch_layers if k or head else 0) + (scratch_head if head else 0)
                   + (scratch_experts if len(expert_layers) else 0))
        return weights, kv, scratch

    def fits(k: int, head: bool, expert_layers: range = range(0)) -> bool:
        return sum(cost(k, head, expert_layers)) <= budget

    fit_k = 0
    while fit_k < n_layer and fits(fit_k + 1, False):
        fit_k += 1
    if request == "auto":
        k, want_head = fit_k, True  # the head goes up whenever it still fits
    else:
        k = min(int(request), n_layer)
        want_head = int(request) >= n_layer
        if k > fit_k:
            need = sum(cost(k, False))
            raise OffloadError(
                f"--gpu-layers {request} needs {_gib(need)} of VRAM but {device.name} has "
                f"{_gib(budget)} usable ({_gib(device.free_vram)} free{kept}); {fit_k} layers fit, "
                f"use --gpu-layers {fit_k} or auto" + (", or --no-mmproj-offload" if reserve_bytes else ""))
    head = want_head and fits(k, True)
    if k == 0 and not head:
        return cpu(f"{device.name} has {_gib(device.free_vram)} free{kept}, not enough for one layer")
    experts = _expert_layers(k, n_cpu_moe, [e > 0 for e in expert_bytes], lambda r: fits(k, head, r))
    weights, kv, scratch = cost(k, head, experts)
    cpu_experts = sum(expert_bytes[:experts.start if experts else k])  # GPU layers' experts left on the CPU
    why = "all layers fit" if k == n_layer else (
        f"--gpu-layers {request}" if request != "auto" else f"{k} of {n_layer} layers fit in {_gib(budget)}")
    return OffloadPlan(list(range(k)), head, weights, kv, scratch, why, n_layer, device, cpu_experts,
                       tuple(experts), sum(expert_bytes[i] for i in experts), reserve_bytes)


def _expert_layers(k: int, n_cpu_moe: int | None, has_experts: list[bool], fits) -> range:
    """The GPU layers (of 0..k-1) whose experts go to VRAM too: from n_cpu_moe on, or (None)
    from the smallest first layer that still fits. An explicit n_cpu_moe that does not fit
    raises OffloadError naming the smallest that does."""
    if not any(has_experts[:k]):
        return range(0)
    lowest = k  # the experts of layers lowest..k-1 fit
    while lowest > 0 and fits(range(lowest - 1, k)):
        lowest -= 1
    if n_cpu_moe is None:
        return range(lowest, k)
    want = range(min(n_cpu_moe, k), k)
    if want.start < lowest:
        raise OffloadError(f"--n-cpu-moe {n_cpu_moe} puts the experts of layers {want.start}-{k - 1} on the GPU, "
                           f"which does not fit; --n-cpu-moe {lowest} does")
    return want


def hypothetical_card(vram_gib: float) -> DeviceInfo:
    """A GPU with `vram_gib` GiB free (compute capability 8.6): for planning on a card one does not have."""
    if not 0 < vram_gib <= 1024:
        raise OffloadError(f"--vram-gb must be a size from 0 to 1024 GiB, got {vram_gib:g}")
    size = int(vram_gib * GiB)
    return DeviceInfo(f"a card with {vram_gib:g} GiB", size, size, (8, 6))


def plan_for_model(gguf: "GGUFFile", cfg: "ModelConfig", n_ctx: int, *, gpu_layers: int | str = "auto",
                   kv_dtype: str = "f16", prefill_rows: int = DEFAULT_PREFILL_ROWS,
                   device: DeviceInfo | None = None, n_cpu_moe: int | None = None,
                   cache_types: "CacheTypes | None" = None, reserve_bytes: int = 0) -> OffloadPlan:
    """Plan for `gguf` on `device`, or on the real GPU probed now (a CPU plan with the reason
    when there is none); `cache_types` (edgeinfer.kv.cache_types) counts K/V in their real bytes."""
    sizes = model_sizes_from_gguf(gguf, cfg)
    token_bytes = None
    if cache_types is not None and cache_types.quantized:
        token_bytes = [layer_block_bytes(cfg, 1, layer=i, types=cache_types) if v else 0
                       for i, v in enumerate(sizes.kv_values_per_token)]
    if parse_gpu_layers(gpu_layers) == 0:
        return plan_offload(sizes, None, n_ctx, no_device_reason="--gpu-layers 0")
    reason = "no GPU"
    if device is None:
        from edgeinfer.kernels_cuda.runtime import cuda_available, device_info

        ok, reason = cuda_available()
        device = device_info() if ok else None
    return plan_offload(sizes, device, n_ctx, kv_dtype=kv_dtype, gpu_layers=gpu_layers,
                        prefill_rows=prefill_rows, no_device_reason=reason, n_cpu_moe=n_cpu_moe,
                        kv_token_bytes=token_bytes, reserve_bytes=reserve_bytes)
