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

Hybrid models (qwen35: K/V for the attention layers, a recurrent state for the others,
edgeinfer.kv.recurrent): a sequence is reused only as far back as its state can be put
back to. Each request keeps snapshots at its reuse point (the previous turn's end) and at
its prompt's last-but-one token, so a resent history, a regenerate, an edit of the last
message and `n > 1` choices prefill only what is new. Cached K/V blocks are used only as
far as the state cache (edgeinfer.kv.state_cache) has the state after them. They never shift the context
(a state cannot be re-roped): full windows end with finish_reason length, and asking for a
shift is an error. Their K/V are not exported to saved sessions (the conversation is).

Pool sizes (one pool per layer group: the full-attention layers, and the sliding-window
layers of one window) are edgeinfer.kv.pool_sizing's. GPU-offloaded layers: the backend's
`new_block_storage` gives the pool VRAM blocks for those layers
(edgeinfer.kv.device_storage.DeviceBlockStorage, same block ids as their group's pool, so
prefix sharing and copy-on-write hold there too), and `max_kv_blocks` caps their group at
what the offload plan reserved VRAM for. The backend contract's defaults keep every layer
in host memory.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator, Sequence

import numpy as np

from edgeinfer.errors import EdgeInferError
from edgeinfer.generate import check_prompt_fits, stream_generate
from edgeinfer.kv.context_shift import shift_context
from edgeinfer.kv.paged import PagedKVCache
from edgeinfer.kv.pool_sizing import plan_pools
from edgeinfer.kv.prefix_cache import common_prefix_len
from edgeinfer.kv.recurrent import keep_at
from edgeinfer.kv.cache_types import from_key
from edgeinfer.kv.saved import F16_KEY, SavedKV
from edgeinfer.kv.sequence import SequenceKV
from edgeinfer.results import FinishReason, GenerationChunk
from edgeinfer.sampling import SamplingParams


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
        cfg, backend = engine.config, engine.backend
        self.recurrent = cfg.has_recurrent  # a sequence is K/V and a recurrent state
        self.context_shift = context_shift and not self.recurrent  # never the default for them
        self.n_keep = n_keep
        # GPU-offloaded layers keep their K/V in VRAM blocks of their group's pool (the CUDA
        # paged attention reads them through the sequence's block table).
        device_layers = backend.kv_layers(cfg)
        types = getattr(engine, "cache_types", None)
        pools = plan_pools(cfg, self.n_ctx, block_size, device_layers, pool_tokens=pool_tokens,
                           kv_pool_mb=kv_pool_mb, prefill_chunk=engine.max_prefill_rows,
                           vram_blocks=backend.max_kv_blocks(cfg, block_size, types), types=types)
        self._device = None  # VRAM blocks of the GPU layers, kept across reset()
        if pools.device_blocks is not None:
            self._device = backend.new_block_storage(cfg, pools.device_blocks, block_size, types)
        self._group_blocks = pools.blocks
        self.cache = self._new_cache()
        self._resident: SequenceKV | None = None  # the last finished request's sequence
        self.lock = threading.Lock()  # one generation at a time
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.shifts = 0

    def _new_cache(self) -> PagedKVCache:
        return PagedKVCache(self.engine.config, self._group_blocks, self.block_size,
                            extra_keys=(self.model_id,), device=self._device,
                            cache_types=getattr(self.engine, "cache_types", None))

    # -- generation ---------------------------------------------------------------------------
    def generate(self, ids: Sequence[int], params: SamplingParams, cancel: threading.Event | None = None,
                 progress: Callable[[int, int], None] | None = None, *, context_shift: bool | None = None,
                 n_keep: int | None = None, speculation=None, report_progress: bool = False,
                 media=None) -> Iterator[GenerationChunk]:
        """Stream a completion of `ids`, reusing the longest cached prefix.

        `speculation` (edgeinfer.speculative.Speculation) drafts and verifies several tokens
        per step; only tokens the stream yields are recorded, so only their blocks are
        committed to the prefix cache.

        `media` (edgeinfer.vision.media_ids.MediaRows): the images whose ids `ids` holds; their
        blocks are cached and reused by those ids like any text.

        The engine runs one request at a time: the lock is held while the stream is consumed.
        """
        ids = [int(t) for t in ids]
        if not ids:
            raise EdgeInferError("the prompt is empty")
        check_prompt_fits(len(ids), self.n_ctx)
        shift = self.context_shift if context_shift is None else context_shift
        if media is not None and len(media):
            shift = False  # as llama-server with images: a shift could cut one in half
        if shift and self.recurrent:
            raise EdgeInferError(f"context shift is not supported for {self.engine.config.arch} models (their "
                                 f"recurrent state cannot be re-roped); raise --ctx-size instead")
        keep = self.n_keep if n_keep is None else n_keep
        if keep < 0:
            raise EdgeInferError(f"n_keep must be at least 0, got {keep}")
        with self.lock:
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
                                             progress=on_progress, make_room=make_room,
                                             report_progress=report_progress,
                                             speculation=speculation, media=media):
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
        # a recurrent state is reusable only where it kept a snapshot: this turn's start and
        # the prompt's last-but-one token (a regenerate, the next of n choices)
        keep_at(seq, seq.n_used)
        keep_at(seq, len(ids) - 1)
        return seq

    # -- management ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every cached prefix (the pool is rebuilt empty)."""
        with self.lock:
            self._resident = None
            self.cache = self._new_cache()

    def resident_tokens(self) -> list[int]:
        """Token ids whose K/V the resident sequence holds (empty if none)."""
        seq = self._resident
        return [] if seq is None else list(seq.tokens[:seq.n_used])

    def export_kv(self) -> SavedKV | None:
        """The resident sequence's tokens, K/V per layer and positions, and a hybrid model's
        recurrent state after them (edgeinfer.kv.saved.SavedKV), or None.

        K/V are as the cache stores them (f16, or a quantized type's raw blocks: SavedKV.
        kv_types says which); rows a sliding-window layer no longer holds (out of its window)
        carry a blank marker (CacheTypes.blank_rows) that import_kv knows.
        """
        seq = self._resident
        if seq is None or seq.n_used == 0 or not np.array_equal(seq.positions, np.arange(seq.n_used)):
            return None
        if min(seq.tokens[:seq.n_used]) < 0:  # image rows (edgeinfer.vision.media_ids): files keep text ids only
            return None
        state = None
        if self.recurrent:  # K/V go only with the state after exactly those tokens
            if seq.recurrent.n_tokens != seq.n_used:
                return None
            state = seq.recurrent.export()
        k, v = seq.export()
        return SavedKV(self.resident_tokens(), k, v, np.array(seq.positions), state, self.cache.cache_types.key)

    def import_kv(self, tokens: Sequence[int], k: list, v: list, pos: np.ndarray,
                  state: dict[str, np.ndarray] | None = None, kv_types: str = F16_KEY) -> int:
        """Make saved K/V of `tokens[:len(pos)]` the resident sequence; returns tokens restored.
        A hybrid model needs `state`, its recurrent state after those tokens (SavedKV.state).

        Positions must be 0..n-1 (K/V as a fresh run computes them); the full blocks are
        registered in the prefix cache like freshly prefilled ones. Sliding-window groups
        take only the blocks the next token's window needs.
        """
        cfg = self.engine.config
        types = self.cache.cache_types
        if kv_types != types.key:
            k_type, v_type = from_key(kv_types)
            raise EdgeInferError(f"saved K/V are K {k_type}, V {v_type} and this run's cache is {types} "
                                 f"(-ctk/-ctv): resume with those cache types, or without the saved K/V")
        if self.recurrent and state is None:
            raise EdgeInferError(f"the saved K/V of this {cfg.arch} session come without its recurrent state "
                                 f"(an older file); resume the conversation without --session-kv")
        pos = np.asarray(pos, dtype=np.int64)
        n = len(pos)
        if n == 0 or n >= self.n_ctx:
            return 0
        if not np.array_equal(pos, np.arange(n)) or len(k) != cfg.n_layer or len(v) != cfg.n_layer:
            raise EdgeInferError("saved K/V do not fit this model")
        for i in range(cfg.n_layer):
            (hk, dk), (hv, dv) = cfg.saved_kv_shapes(i)
            if np.shape(k[i]) != (n, hk, types.width("k", dk) if dk else 0) or \
                    np.shape(v[i]) != (n, hv, types.width("v", dv) if dv else 0) or \
                    np.asarray(k[i]).dtype != types.dtype("k") or np.asarray(v[i]).dtype != types.dtype("v"):
                raise EdgeInferError("saved K/V do not fit this model")
        with self.lock:
            if self._resident is not None:
                self.cache.release(self._resident)
                self._resident = None
            seq = self.cache.new_sequence(self.n_ctx)
            try:
                try:
                    seq.load(pos, k, v)
                    if seq.recurrent is not None:
                        seq.recurrent.load(state, n)
                        seq.recurrent.keep_at(n)  # a regenerate may cut back to here
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
        s = self._pool_stats()
        s.update(
            block_size=self.block_size,
            resident_tokens=0 if self._resident is None else self._resident.n_used,
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
        self.cache.check_invariants()
        live = self.cache._live
        assert live <= ({self._resident} if self._resident is not None else set()), \
            "a sequence outlived its request"
