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

Pool size (`pool_tokens`): by default 2 x n_ctx tokens (rounded up to blocks), so one
conversation can run at full context while another's cached prefix survives beside it;
`kv_pool_mb` caps that by memory, but never below n_ctx + one block (one full sequence
must always fit). Gemma 3 270M at n_ctx 4096: 2 x 4096 x 18 KiB = 144 MiB of f16 K/V.

GPU-offloaded layers: the backend's `new_block_storage` gives the pool VRAM blocks for
those layers (edgeinfer.backend_cuda.DeviceBlockStorage, same block ids, so prefix sharing
and copy-on-write hold there too); the pool is then capped at what the offload plan
reserved VRAM for (`max_kv_blocks`: n_ctx tokens, like llama.cpp's unified KV), again
never below n_ctx + one block. A backend with its own contiguous cache (`new_cache`) and
no block storage gets one slot with token-level prefix reuse instead.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator, Sequence

import numpy as np

from edgeinfer.context_shift import shift_context
from edgeinfer.errors import EdgeInferError
from edgeinfer.generate import check_prompt_fits, common_prefix_len, stream_generate
from edgeinfer.paged_kv import PagedKVCache, SequenceKV
from edgeinfer.results import FinishReason, GenerationChunk
from edgeinfer.sampling import SamplingParams


def pool_blocks(n_ctx: int, block_size: int, bytes_per_token: int, pool_tokens: int | None = None,
                kv_pool_mb: float | None = None) -> int:
    """Number of blocks for the pool (see the module docstring for the policy)."""
    minimum = -(-n_ctx // block_size) + 1  # one full sequence + a copy-on-write block
    tokens = 2 * n_ctx if pool_tokens is None else pool_tokens
    blocks = -(-tokens // block_size)
    if kv_pool_mb is not None:
        blocks = min(blocks, int(kv_pool_mb * 2**20) // max(1, bytes_per_token * block_size))
    return max(minimum, blocks)


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
        per_token = 2 * cfg.n_layer * cfg.n_head_kv * (cfg.head_dim + cfg.head_dim_v)  # f16 K + V
        backend = engine.backend
        self._num_blocks = pool_blocks(self.n_ctx, block_size, per_token, pool_tokens, kv_pool_mb)
        # GPU-offloaded layers keep their K/V in VRAM blocks of the same pool (the CUDA paged
        # attention reads them through the sequence's block table). A backend that only offers
        # its own contiguous cache gets one slot with token-level prefix reuse, no block cache.
        self.paged = hasattr(backend, "new_block_storage") or not hasattr(backend, "new_cache")
        self._device = None  # VRAM blocks of the GPU layers, kept across reset()
        if self.paged and hasattr(backend, "new_block_storage"):
            vram_blocks = backend.max_kv_blocks(cfg, block_size)
            if vram_blocks is not None:
                self._num_blocks = max(pool_blocks(self.n_ctx, block_size, per_token, 0),
                                       min(self._num_blocks, vram_blocks))
            self._device = backend.new_block_storage(cfg, self._num_blocks, block_size)
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
        return PagedKVCache(self.engine.config, self._num_blocks, self.block_size,
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
                self.cache.release(seq)
                seq = self.cache.fork(old)
                seq.truncate(common)
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
        """(tokens, k per layer, v per layer, positions) of the resident sequence, or None."""
        seq = self._resident if self.paged else self._slot
        if seq is None or seq.n_used == 0 or getattr(seq, "n_dropped", 0):
            return None
        tokens = self.resident_tokens()
        views = [seq.layer_view(i) for i in range(self.engine.config.n_layer)]
        return (tokens, [np.array(k) for k, _, _ in views],
                [np.array(v) for _, v, _ in views], np.array(views[0][2]))

    def import_kv(self, tokens: Sequence[int], k: list, v: list, pos: np.ndarray) -> int:
        """Make saved K/V of `tokens[:len(pos)]` the resident sequence; returns tokens restored.

        Positions must be 0..n-1 (K/V as a fresh run computes them); the full blocks are
        registered in the prefix cache like freshly prefilled ones.
        """
        cfg = self.engine.config
        pos = np.asarray(pos, dtype=np.int64)
        n = len(pos)
        if n == 0 or n >= self.n_ctx:
            return 0
        if not np.array_equal(pos, np.arange(n)) or len(k) != cfg.n_layer or len(v) != cfg.n_layer:
            raise EdgeInferError("saved K/V do not fit this model")
        with self.lock:
            if not self.paged:
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
                slots = seq.append(pos)
                for i in range(cfg.n_layer):
                    if k[i].shape[1:] != (cfg.n_head_kv, cfg.head_dim) or v[i].shape[1:] != (
                            cfg.n_head_kv, cfg.head_dim_v):
                        raise EdgeInferError("saved K/V do not fit this model")
                    seq.store(i, slots, k[i], v[i])
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
        for _ in range(3):
            try:
                return dict(self.cache.stats())
            except RuntimeError:
                continue
        pool = self.cache.pool
        return dict(used=pool.num_blocks - pool.num_free, free=pool.num_free, cached=0,
                    total=pool.num_blocks, hits=pool.hits, queries=pool.queries,
                    hit_rate=pool.hits / pool.queries if pool.queries else 0.0)

    def check_invariants(self) -> None:
        if not self.paged:
            return
        self.cache.check_invariants()
        live = self.cache._live
        assert live <= ({self._resident} if self._resident is not None else set()), \
            "a sequence outlived its request"
