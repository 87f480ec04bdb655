"""Whether a context size fits in memory, checked before its K/V pools are allocated.

`edgeinfer run -c 1000000000000` used to end in a bare `MemoryError:` from deep inside
the block pool. `check_context_memory` computes what the session manager will allocate in
host memory for `n_ctx` (the paged pools of edgeinfer.kv.pool_sizing, f16 K/V, plus each
block's bookkeeping) and compares it with the memory available now:

- one sequence at full context does not fit: one line naming --ctx-size, what it needs,
  what is available and the largest context that fits;
- one fits but the default pool (2 x n_ctx, room for a cached prefix beside a full
  conversation) does not: the pool is capped to what is available (the `kv_pool_mb` to
  use), never below one full sequence.

Layers the backend keeps on a GPU (their K/V in VRAM) are not counted. Where the memory
available cannot be read (not Linux), nothing is checked here and an allocation that
fails still ends as one line (edgeinfer.api).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgeinfer.errors import EdgeInferError
from edgeinfer.units import human_bytes

if TYPE_CHECKING:
    from edgeinfer.engine import Engine

BLOCK_SIZE = 16  # the session manager's block size
# Per block and layer group: its row of stored positions (int64) and the block pool's
# Python bookkeeping (reference count, hash slot, free-queue entry), measured at ~150 bytes.
BLOCK_OVERHEAD = 8 * BLOCK_SIZE + 192


class ContextTooLargeError(EdgeInferError):
    """A context size whose K/V cache does not fit in the memory available."""


def pool_host_bytes(engine: "Engine", n_ctx: int, kv_pool_mb: float | None, *, minimum: bool = False) -> int:
    """Host bytes of the session manager's K/V pools for `n_ctx` (`minimum`: one full
    sequence only, the floor no `kv_pool_mb` goes below)."""
    from edgeinfer.kv.groups import layer_groups
    from edgeinfer.kv.pool_sizing import layer_block_bytes, plan_pools

    cfg, backend = engine.config, engine.backend
    device_layers = set(backend.kv_layers(cfg))
    pools = plan_pools(cfg, n_ctx, BLOCK_SIZE, sorted(device_layers), kv_pool_mb=0 if minimum else kv_pool_mb,
                       prefill_chunk=engine.max_prefill_rows,
                       vram_blocks=backend.max_kv_blocks(cfg, BLOCK_SIZE))
    total = 0
    for window, layers in layer_groups(cfg, sorted(device_layers)):
        blocks = pools.blocks[window]
        host = sum(layer_block_bytes(cfg, BLOCK_SIZE, layer=i) for i in layers if i not in device_layers)
        total += blocks * (host + BLOCK_OVERHEAD)
    return total


def largest_fitting(engine: "Engine", available: int) -> int:
    """The largest context whose one full sequence fits in `available` bytes (0: none)."""
    lo, hi = 0, 1
    while pool_host_bytes(engine, hi, None, minimum=True) <= available:
        lo, hi = hi, hi * 2
        if hi > 1 << 62:
            return lo
    while hi - lo > 1:  # pool_host_bytes grows with n_ctx
        mid = (lo + hi) // 2
        if pool_host_bytes(engine, mid, None, minimum=True) <= available:
            lo = mid
        else:
            hi = mid
    return lo


def check_context_memory(engine: "Engine", n_ctx: int, kv_pool_mb: float | None,
                         available: int | None = None) -> float | None:
    """Raise ContextTooLargeError when one sequence of `n_ctx` tokens does not fit in the
    memory available; return the `kv_pool_mb` to build the pools with (the one given, or a
    cap where the default pool would not fit)."""
    if available is None:
        available = mem_available()
    if available is None or not engine.config.kv_layers:
        return kv_pool_mb
    need = pool_host_bytes(engine, n_ctx, None, minimum=True)
    if need > available:
        fits = largest_fitting(engine, available)
        hint = f"at most --ctx-size {fits} fits" if fits >= 1 else "no context fits"
        raise ContextTooLargeError(
            f"--ctx-size {n_ctx} needs about {human_bytes(need)} of memory for its K/V cache, but "
            f"{human_bytes(available)} are available: {hint}")
    if pool_host_bytes(engine, n_ctx, kv_pool_mb) > available:
        return 0.9 * available / 2**20  # the pools shrink in proportion, never below one sequence
    return kv_pool_mb


def mem_available() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
