"""How much K/V memory each cache gets: every block-count and byte computation in one place.

- `kv_values_per_token` / `layer_block_bytes`: K + V of one layer, per token and per block.
- `context_kv_bytes`: one layer's K/V for a whole context in VRAM (the offload plan's budget).
- `vram_kv_blocks`: how many paged blocks that budget holds (the backend's `max_kv_blocks`).
- `group_pool_blocks` / `plan_pools`: the session manager's pools, one per layer group.

Pool size, per layer group. Full-attention group: by default 2 x n_ctx tokens
(`pool_tokens` to change it), so one conversation can run at full context while another's
cached prefix survives beside it. A sliding-window group gives back what falls out of its
window, so one sequence needs only window + prefill chunk tokens there (plus the drop
alignment and a copy-on-write block): it gets twice that, never more than the full group.
`kv_pool_mb` caps the sum by memory, shrinking every group in proportion, but never below
what one full sequence needs (n_ctx + one block in the full group). Gemma 3 270M at n_ctx
4096 (3 global + 15 sliding-window-512 layers, 1 KiB of f16 K/V per layer and token):
8192 x 3 KiB + 1632 x 15 KiB = 48 MiB, where one pool for all layers took
2 x 4096 x 18 KiB = 144 MiB.

The group holding GPU-offloaded layers is capped at the blocks the offload plan reserved
VRAM for (n_ctx tokens, like llama.cpp's unified KV), again never below n_ctx + one block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgeinfer.kv.cache_types import CacheTypes
from edgeinfer.kv.groups import DROP_ALIGN, drop_quantum, layer_groups

if TYPE_CHECKING:
    from edgeinfer.models.config import ModelConfig

KV_BYTES_PER_VALUE = {"f16": 2.0, "f32": 4.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                      "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32}
F16_BYTES = 2  # the paged pools and VRAM blocks hold f16 K/V


def kv_values_per_token(config: "ModelConfig", layer: int | None = None) -> int:
    """K + V values one layer stores per token: `layer`'s (0 for a recurrent layer or one
    reading an earlier layer's K/V, whose K/V are counted once, at their owner), or without
    a layer n_head_kv heads (the most any layer has) of the global head sizes."""
    if layer is not None:
        return config.kv_values_of(layer)
    return config.n_head_kv * (config.head_dim + config.head_dim_v)


def layer_block_bytes(config: "ModelConfig", block_size: int, itemsize: int = F16_BYTES,
                      layer: int | None = None, types: CacheTypes | None = None) -> int:
    """Bytes of one layer's K + V in one block of `block_size` tokens (see kv_values_per_token);
    with quantized `types` (edgeinfer.kv.cache_types), the bytes of their blocks."""
    if types is None or not types.quantized:
        return block_size * kv_values_per_token(config, layer) * itemsize
    if layer is not None and kv_values_per_token(config, layer) == 0:
        return 0
    if layer is None:
        heads, hd, hd_v = config.n_head_kv, config.head_dim, config.head_dim_v
    else:
        heads, hd, hd_v = config.n_head_kv_of(layer), config.head_dim_of(layer), config.head_dim_v_of(layer)
    return int(block_size * types.token_bytes(heads * hd, heads * hd_v))


def model_kv_bytes_per_token(config: "ModelConfig", itemsize: int = F16_BYTES,
                             types: CacheTypes | None = None) -> int:
    """Bytes of K/V the whole model stores per token of context, each shared K/V once
    (sliding-window layers counted as if they kept every token); `types` as layer_block_bytes."""
    if types is None or not types.quantized:
        return config.kv_values_per_token * itemsize
    return sum(layer_block_bytes(config, 1, layer=i, types=types) for i in range(config.n_layer))


def context_kv_bytes(values_per_token: int, n_ctx: int, kv_dtype: str = "f16") -> int:
    """Bytes of one layer's K/V for `n_ctx` tokens stored as `kv_dtype`."""
    return int(values_per_token * KV_BYTES_PER_VALUE[kv_dtype] * n_ctx)


def vram_kv_blocks(vram_kv: int, config: "ModelConfig", layers: Sequence[int], block_size: int,
                   types: CacheTypes | None = None) -> int | None:
    """Blocks of `layers` (each with its own head sizes, stored as `types`) that `vram_kv`
    bytes hold, or None without a budget (a hand-made plan) or without layers."""
    per_block = sum(layer_block_bytes(config, block_size, layer=i, types=types) for i in layers)
    if not vram_kv or not per_block:
        return None
    return vram_kv // per_block


def group_pool_blocks(n_ctx: int, block_size: int, groups: Sequence[tuple[int, int]],
                      pool_tokens: int | None = None, kv_pool_mb: float | None = None,
                      prefill_chunk: int = 256, drop_align: int = DROP_ALIGN) -> list[int]:
    """Blocks for each layer group's pool; `groups`: (window, bytes per token) of each.

    Full-attention group (window 0): 2 x n_ctx tokens (or `pool_tokens`), at least one full
    sequence + a copy-on-write block (n_ctx / block_size + 1). Sliding-window group: one
    sequence needs the blocks spanning window - 1 + prefill_chunk tokens (+1 for their
    alignment to blocks, + the drop quantum - 1, +1 for a copy-on-write): it gets twice
    that, at most the full group's count. A `kv_pool_mb` budget shrinks every group in
    proportion, never below one sequence's need.
    """
    bs = block_size
    full_min = -(-n_ctx // bs) + 1
    full_want = max(full_min, -(-(2 * n_ctx if pool_tokens is None else pool_tokens) // bs))
    mins, wants = [], []
    for window, _ in groups:
        if window and window < n_ctx:
            need = -(-(window - 1 + prefill_chunk) // bs) + 1 + drop_quantum(bs, window, drop_align)
            mins.append(min(full_min, need))
            wants.append(max(mins[-1], min(full_want, 2 * need)))
        else:
            mins.append(full_min)
            wants.append(full_want)
    if kv_pool_mb is not None:
        budget = int(kv_pool_mb * 2**20)
        total = sum(w * max(1, per_token * bs) for w, (_, per_token) in zip(wants, groups))
        if total > budget:
            wants = [w * budget // total for w in wants]
    return [max(lo, w) for lo, w in zip(mins, wants)]


@dataclass(frozen=True)
class PoolPlan:
    """The session manager's pools: blocks per group window, and the device group's count."""

    blocks: dict[int, int]  # window (0 = full attention) -> blocks of that group's pool
    device_blocks: int | None  # blocks of the group holding the device layers (None: no such group)


def plan_pools(config: "ModelConfig", n_ctx: int, block_size: int, device_layers: Sequence[int] = (), *,
               pool_tokens: int | None = None, kv_pool_mb: float | None = None, prefill_chunk: int = 256,
               vram_blocks: int | None = None, types: CacheTypes | None = None) -> PoolPlan:
    """Blocks of every layer group's pool (`group_pool_blocks`, f16 K/V); the group holding
    `device_layers` is capped at `vram_blocks`, never below one sequence's need."""
    groups = layer_groups(config, device_layers)
    sizes = [(w, sum(layer_block_bytes(config, 1, layer=i, types=types) for i in layers)) for w, layers in groups]
    blocks = group_pool_blocks(n_ctx, block_size, sizes, pool_tokens, kv_pool_mb, prefill_chunk)
    on_device = next((i for i, (_, layers) in enumerate(groups) if set(layers) & set(device_layers)), None)
    if on_device is not None and vram_blocks is not None:
        floor = group_pool_blocks(n_ctx, block_size, sizes, pool_tokens, 0, prefill_chunk)[on_device]
        blocks[on_device] = max(floor, min(blocks[on_device], vram_blocks))
    return PoolPlan({w: b for (w, _), b in zip(groups, blocks)},
                    None if on_device is None else blocks[on_device])
