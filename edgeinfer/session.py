"""The session manager: one user, many conversations, one paged KV pool with a prefix cache.

Every request runs in a fresh `SequenceKV` that starts from the longest reusable prefix:
- the block-level prefix cache (full blocks hashed over their token chain, vLLM-style;
  freed blocks stay findable in LRU order until the pool needs them), or
- the previous request's sequence ("resident", like a llama-server slot), reusable down to
  the token: a chat client that resends a growing conversation prefills only the new turn.
Only the rest of the prompt is prefilled, in `Engine.options.prefill_chunk` pieces; full
blocks are registered in the prefix cache as they fill.

After a successful request its sequence stays resident until the next request starts; a
cancelled or failed request gives all its blocks back at once (hashed ones stay cached).

Pool size, per layer group (edgeinfer.paged_kv: the full-attention layers, and the
sliding-window layers of one window, each have their own pool). Full-attention group: by
default 2 x n_ctx tokens (`pool_tokens` to change it), so one conversation can run at full
context while another's cached prefix survives beside it. A sliding-window group gives
back what falls out of its window, so one sequence needs only window + prefill chunk
tokens there (plus the drop alignment and a copy-on-write block): it gets twice that,
never more than the full group. `kv_pool_mb` caps the sum by memory, shrinking every group
in proportion, but never below what one full sequence needs (n_ctx + one block in the
full group). Gemma 3 270M at n_ctx 4096 (3 global + 15 sliding-window-512 layers, 1 KiB
of f16 K/V per layer and token): 8192 x 3 KiB + 1632 x 15 KiB = 48 MiB, where one pool
for all layers took 2 x 4096 x 18 KiB = 144 MiB.

GPU-offloaded layers: the backend's `new_block_storage` gives the pool VRAM blocks for
those layers (edgeinfer.backend_cuda.DeviceBlockStorage, same block ids as their group's
pool, so prefix sharing and copy-on-write hold there too); they all sit in one group, the
full-attention one unless every one is a sliding-window layer. That group is then capped
at what the offload plan reserved VRAM for (`max_kv_blocks`: n_ctx tokens, like
llama.cpp's unified KV), again never below n_ctx + one block. A backend with its own
contiguous cache (`new_cache`) and no block storage gets one slot with token-level prefix
reuse instead.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator, Sequence

import numpy as np

from edgeinfer.context_shift import shift_context
from edgeinfer.errors import EdgeInferError
from edgeinfer.generate import check_prompt_fits, common_prefix_len, stream_generate
from edgeinfer.paged_kv import DROP_ALIGN, PagedKVCache, SequenceKV, drop_quantum, layer_groups
from edgeinfer.results import FinishReason, GenerationChunk
from edgeinfer.sampling import SamplingParams


def pool_blocks(n_ctx: int, block_size: int, bytes_per_token: int, pool_tokens: int | None = None,
                kv_pool_mb: float | None = None) -> int:
    """Number of blocks for a pool of one group holding every layer (see the module docstring)."""
    minimum = -(-n_ctx // block_size) + 1  # one full sequence + a copy-on-write block
    tokens = 2 * n_ctx if pool_tokens is None else pool_tokens
    blocks = -(-tokens // block_size)
    if kv_pool_mb is not None:
        blocks = min(blocks, int(kv_pool_mb * 2**20) // max(1, bytes_per_token * block_size))
    return max(minimum, blocks)


def group_pool_blocks(n_ctx: int, block_size: int, groups: Sequence[tuple[int, int]],
                      pool_tokens: int | None = None, kv_pool_mb: float | None = None,
                      prefill_chunk: int = 256, drop_align: int = DROP_ALIGN) -> list[int]:
    """Blocks for each layer group's pool; `groups`: (window, bytes per token) of each.

    Full-attention group (window 0): `pool_blocks`'s policy. Sliding-window group: one
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


class SessionManager:
    def __init__(self, engine, tokenizer, *, n_ctx: int | None = None, pool_tokens: int | None = None,
                 block_size: int = 16, model_id: str = "", kv_pool_mb: float | None = None,
                 context_shift: bool = False, n_keep: int = 0) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx or engine.n_ctx
        if self.n_ctx > engine.n_ctx:
            raise EdgeInferError(f"the session context {self.n_ctx} exceeds the engine's {engine.n_ctx}")
        self.block_size = block_size
        self.model_id = model_id
        self.context_shift = context_shift
        self.n_keep = n_keep
        cfg = engine.config
        backend = engine.backend
        # GPU-offloaded layers keep their K/V in VRAM blocks of their group's pool (the CUDA paged
        # attention reads them through the sequence's block table). A backend that only offers
        # its own contiguous cache gets one slot with token-level prefix reuse, no block cache.
        self.paged = hasattr(backend, "new_block_storage") or not hasattr(backend, "new_cache")
        device_layers = list(backend.kv_layers(cfg)) if self.paged and hasattr(backend, "kv_layers") else []
        groups = layer_groups(cfg, device_layers)
        per_layer = 2 * cfg.n_head_kv * (cfg.head_dim + cfg.head_dim_v)  # f16 K + V of one layer and token
        chunk = getattr(engine, "max_prefill_rows", 256)  # the largest prefill pass
        sizes = [(w, len(layers) * per_layer) for w, layers in groups]
        blocks = group_pool_blocks(self.n_ctx, block_size, sizes, pool_tokens, kv_pool_mb, chunk)
        self._device = None  # VRAM blocks of the GPU layers, kept across reset()
        if self.paged and hasattr(backend, "new_block_storage"):
            on_device = next((i for i, (_, layers) in enumerate(groups) if set(layers) & set(device_layers)), None)
            if on_device is not None:
                vram_blocks = backend.max_kv_blocks(cfg, block_size)
                if vram_blocks is not None:  # ... but never below one sequence's need
                    floor = group_pool_blocks(self.n_ctx, block_size, sizes, pool_tokens, 0, chunk)[on_device]
                    blocks[on_device] = max(floor, min(blocks[on_device], vram_blocks))
                self._device = backend.new_block_storage(cfg, blocks[on_device], block_size)
        self._group_blocks = {w: b for (w, _), b in zip(groups, blocks)}
        self.cache: PagedKVCache | None = self._new_cache() if self.paged else None
        self._slot = None if self.paged else engine.new_cache()
        self._slot_tokens: list[int] = []  # the ids whose K/V _slot holds
        self._resident: SequenceKV | None = None  # the last finished request's sequence
        self.lock = threading.Lock()  # one generation at a time
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.shifts = 0

    def _new_cache(self) -> PagedKVCache:
        return PagedKVCache(self.engine.config, self._group_blocks, self.block_size,
                            extra_keys=(self.model_id,), device=self._device)

    # -- generation ---------------------------------------------------------------------------
    def generate(self, ids: Sequence[int], params: SamplingParams, cancel: threading.Event | None = None,
                 progress: Callable[[int, int], None] | None = None, *, context_shift: bool | None = None,
                 n_keep: int | None = None) -> Iterator[GenerationChunk]:
        """Stream a completion of `ids`, reusing the longest cached prefix.

        The engine runs one request at a time: the lock is held while the stream is consumed.
        """
        ids = [int(t) for t in ids]
        if not ids:
            raise EdgeInferError("the prompt is empty")
        check_prompt_fits(len(ids), self.n_ctx)
        shift = self.context_shift if context_shift is None else context_shift
        keep = self.n_keep if n_keep is None else n_keep
        if keep < 0:
            raise EdgeInferError(f"n_keep must be at least 0, got {keep}")
        with self.lock:
            if not self.paged:
                yield from self._generate_in_slot(ids, params, cancel, progress)
                return
            seq = self._start(ids)
            state = {"shifted": False}
            done = False

            def on_progress(n_done: int, n_total: int) -> None:
                self.cache.commit_full_blocks(seq)  # prefix blocks become findable as they fill
                if progress is not None:
                    progress(n_done, n_total)

            def make_room() -> bool:
                if not shift or not shift_context(self.engine, seq, keep):
                    return False
                state["shifted"] = True
                self.shifts += 1
                return True

            try:
                last = None
                for chunk in stream_generate(self.engine, seq, self.tokenizer, ids, params, cancel=cancel,
                                             progress=on_progress, make_room=make_room):
                    if chunk.token is not None:
                        seq.record_tokens([chunk.token])  # K/V written by the next decode
                        if not state["shifted"]:
                            self.cache.commit_full_blocks(seq)
                    last = chunk
                    yield chunk
                done = last is not None and last.finish_reason != FinishReason.CANCELLED
                if last is not None and last.usage is not None:
                    self._count(last)
            finally:
                # A shifted sequence no longer matches a fresh run of its tokens: never reuse it.
                if done and not state["shifted"]:
                    self._resident = seq
                else:
                    self.cache.release(seq)

    def _generate_in_slot(self, ids: list[int], params: SamplingParams, cancel, progress
                          ) -> Iterator[GenerationChunk]:
        kv = self._slot
        keep = min(common_prefix_len(self._slot_tokens, ids), len(ids) - 1)
        kv.truncate(keep)
        self._slot_tokens = self._slot_tokens[:keep]
        generated: list[int] = []
        try:
            for chunk in stream_generate(self.engine, kv, self.tokenizer, ids, params, cancel=cancel,
                                         progress=progress):
                if chunk.token is not None:
                    generated.append(chunk.token)
                if chunk.usage is not None:
                    self._count(chunk)
                yield chunk
        finally:  # whatever got evaluated stays reusable
            self._slot_tokens = (ids + generated)[:kv.n_used]

    def _count(self, last: GenerationChunk) -> None:
        self.requests += 1
        self.prompt_tokens += last.usage.prompt_tokens
        self.cached_tokens += last.usage.cached_tokens

    def _start(self, ids: list[int]) -> SequenceKV:
        """A new sequence holding the longest reusable prefix of ids[:-1] (the last prompt
        token is always evaluated, for its logits). Releases the previous resident."""
        seq = self.cache.new_sequence(self.n_ctx)
        cached = self.cache.reuse_prefix(seq, ids[:-1])
        old, self._resident = self._resident, None
        if old is not None:
            common = min(common_prefix_len(old.tokens[:old.n_used], ids), len(ids) - 1)
            if common > cached:  # the previous conversation goes further than whole blocks
                fork = self.cache.fork(old)
                fork.truncate(common)  # may come out shorter: sliding-window blocks given back
                if fork.n_used > cached:
                    self.cache.release(seq)
                    seq = fork
                else:
                    self.cache.release(fork)
            self.cache.release(old)  # its full blocks stay cached; shared ones stay with seq
        seq.record_tokens(ids[seq.n_used:])
        return seq

    # -- management ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every cached prefix (the pool is rebuilt empty)."""
        with self.lock:
            self._resident = None
            if self.paged:
                self.cache = self._new_cache()
            else:
                self._slot.truncate(0)
                self._slot_tokens = []

    def resident_tokens(self) -> list[int]:
        """Token ids whose K/V the resident sequence holds (empty if none)."""
        if not self.paged:
            return list(self._slot_tokens)
        seq = self._resident
        return [] if seq is None else list(seq.tokens[:seq.n_used])

    def export_kv(self) -> tuple[list[int], list, list, np.ndarray] | None:
        """(tokens, k per layer, v per layer, positions) of the resident sequence, or None.

        Rows a sliding-window layer no longer holds (out of its window) are NaN; import_kv
        knows them.
        """
        if not self.paged:
            seq = self._slot
            if seq.n_used == 0:
                return None
            views = [seq.layer_view(i) for i in range(self.engine.config.n_layer)]
            return (self.resident_tokens(), [np.array(k) for k, _, _ in views],
                    [np.array(v) for _, v, _ in views], np.array(views[0][2]))
        seq = self._resident
        if seq is None or seq.n_used == 0 or not np.array_equal(seq.positions, np.arange(seq.n_used)):
            return None
        k, v = seq.export()
        return self.resident_tokens(), k, v, np.array(seq.positions)

    def import_kv(self, tokens: Sequence[int], k: list, v: list, pos: np.ndarray) -> int:
        """Make saved K/V of `tokens[:len(pos)]` the resident sequence; returns tokens restored.

        Positions must be 0..n-1 (K/V as a fresh run computes them); the full blocks are
        registered in the prefix cache like freshly prefilled ones. Sliding-window groups
        take only the blocks the next token's window needs.
        """
        cfg = self.engine.config
        pos = np.asarray(pos, dtype=np.int64)
        n = len(pos)
        if n == 0 or n >= self.n_ctx:
            return 0
        if not np.array_equal(pos, np.arange(n)) or len(k) != cfg.n_layer or len(v) != cfg.n_layer:
            raise EdgeInferError("saved K/V do not fit this model")
        for i in range(cfg.n_layer):
            if (np.shape(k[i]) != (n, cfg.n_head_kv, cfg.head_dim)
                    or np.shape(v[i]) != (n, cfg.n_head_kv, cfg.head_dim_v)):
                raise EdgeInferError("saved K/V do not fit this model")
        with self.lock:
            if not self.paged:
                if any(np.isnan(a).any() for a in list(k) + list(v)):
                    return 0  # rows a sliding window dropped: this slot needs them all, recompute
                self._slot.truncate(0)
                slots = self._slot.append(pos)
                for i in range(cfg.n_layer):
                    self._slot.store(i, slots, np.asarray(k[i], np.float32), np.asarray(v[i], np.float32))
                self._slot_tokens = [int(t) for t in list(tokens)[:n]]
                return n
            if self._resident is not None:
                self.cache.release(self._resident)
                self._resident = None
            seq = self.cache.new_sequence(self.n_ctx)
            try:
                try:
                    seq.load(pos, k, v)
                except ValueError:
                    raise EdgeInferError("saved K/V do not fit this model") from None
                seq.record_tokens(list(tokens)[:n])
                self.cache.commit_full_blocks(seq)
            except BaseException:
                self.cache.release(seq)
                raise
            self._resident = seq
        return n

    def stats(self) -> dict:
        """Pool blocks used/free/cached, block hit rate, and token-level reuse over requests."""
        if self.paged:
            s = self._pool_stats()
            resident = 0 if self._resident is None else self._resident.n_used
        else:  # one contiguous slot: report it as blocks of one token
            used = self._slot.n_used
            s = dict(used=used, free=self.n_ctx - used, cached=0, total=self.n_ctx, hits=0, queries=0,
                     hit_rate=0.0)
            resident = used
        s.update(
            block_size=self.block_size if self.paged else 1,
            resident_tokens=resident,
            requests=self.requests,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            token_hit_rate=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            context_shifts=self.shifts,
        )
        return s

    def _pool_stats(self) -> dict:
        # /metrics may read this from another thread while a generation changes the pool;
        # iterating its free queue then can fail: retry, and fall back to the lock-free counts.
        cache = self.cache
        for _ in range(3):
            try:
                return dict(cache.stats())
            except RuntimeError:
                continue
        pools = [g.pool for g in cache.groups]
        total = sum(p.num_blocks for p in pools)
        free = sum(p.num_free for p in pools)
        return dict(used=total - free, free=free, cached=0, total=total, hits=cache.hits,
                    queries=cache.queries, hit_rate=cache.hits / cache.queries if cache.queries else 0.0)

    def check_invariants(self) -> None:
        if not self.paged:
            return
        self.cache.check_invariants()
        live = self.cache._live
        assert live <= ({self._resident} if self._resident is not None else set()), \
            "a sequence outlived its request"
