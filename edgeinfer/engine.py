"""The engine: a loaded model's weights, its backend plan, and the forward pass.

`Engine.forward(tokens, positions, kv)` is the one call every front end ends in; it
returns logits only for the rows asked for. Prefill runs in chunks so a long prompt never
needs an activation buffer bigger than one chunk.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgeinfer.backends.base import Backend, ReferenceBackend
from edgeinfer.errors import EdgeInferError
from edgeinfer.kv.cache_types import CacheTypes, flash_types, of_config, parse
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.kv.view import KVView
from edgeinfer.loader import ModelFile

if TYPE_CHECKING:
    from edgeinfer.backends.offload import OffloadPlan
    from edgeinfer.vision.media_ids import MediaRows

BACKENDS = ("cpu", "reference")
DEFAULT_PREFILL_CHUNK = 256


@dataclass(frozen=True)
class EngineOptions:
    n_ctx: int = 4096
    threads: int | None = None
    backend: str = "cpu"
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    gpu_layers: int | str = "auto"  # like llama.cpp's -ngl: N, "auto" (what fits) or 0
    n_cpu_moe: int | None = None  # llama.cpp's --n-cpu-moe: layers whose experts stay on the CPU (None: the plan's)
    cache_type_k: str = "f16"  # llama.cpp's --cache-type-k / -ctk (edgeinfer.kv.cache_types)
    cache_type_v: str = "f16"  # --cache-type-v / -ctv
    flash_attn: str = "auto"  # llama.cpp's -fa: on, off, auto (the flash order where the cache is quantized)
    vram_reserve: int = 0  # bytes of VRAM the offload plan leaves free (the vision encoder's)

    @property
    def cache_types(self) -> CacheTypes:
        """The K/V types, checked by name (one line naming the flag otherwise)."""
        return flash_types(parse(self.cache_type_k, "--cache-type-k"), parse(self.cache_type_v, "--cache-type-v"),
                           self.flash_attn)


def make_backend(mf: ModelFile, options: EngineOptions) -> tuple[Backend, "OffloadPlan | None"]:
    """The backend for this model, and the GPU offload plan (None for the reference backend).

    The cpu backend takes the layers that fit in VRAM onto CUDA when a GPU, its driver and
    pycuda are all present; otherwise the plan says why everything stays on the CPU.
    """
    if options.backend == "reference":
        return ReferenceBackend(mf.gguf), None
    if options.backend == "cpu":
        from edgeinfer.backends.cpu import CpuBackend
        from edgeinfer.backends.offload import plan_for_model

        cpu = CpuBackend(mf.gguf, threads=options.threads)
        plan = plan_for_model(mf.gguf, mf.config, options.n_ctx, gpu_layers=options.gpu_layers,
                              prefill_rows=options.prefill_chunk + options.prefill_chunk // 4,
                              n_cpu_moe=options.n_cpu_moe, cache_types=of_config(mf.config, options.cache_types),
                              reserve_bytes=options.vram_reserve)
        if not plan.on_gpu:
            cpu.prepare_weights()   # a GPU plan leaves them to first use: offloaded layers never ask
            return cpu, plan
        from edgeinfer.backends.hybrid import make_backend as make_hybrid

        return make_hybrid(mf.gguf, plan, cpu), plan
    raise EdgeInferError(f"unknown backend {options.backend!r} (choose from {', '.join(BACKENDS)})")


class Engine:
    def __init__(self, mf: ModelFile, options: EngineOptions | None = None) -> None:
        self.options = options or EngineOptions()
        if self.options.n_ctx < 1:
            raise EdgeInferError(f"--ctx-size must be at least 1, got {self.options.n_ctx}")
        if self.options.prefill_chunk < 1:
            raise EdgeInferError(f"--prefill-chunk must be at least 1, got {self.options.prefill_chunk}")
        self.model_file = mf
        self.config = mf.config
        # K/V types: every cache this engine's users make holds these (edgeinfer.kv.cache_types)
        self.cache_types = of_config(mf.config, self.options.cache_types)
        self.backend, self.offload = make_backend(mf, self.options)
        self.model = mf.family(mf.config, mf.gguf, self.backend)
        self.warm_up()

    def warm_up(self, report=None) -> int:
        """On a cold Numba cache, compile the CPU kernels now, with a progress count
        (kernels_cpu/compile_progress.py: stderr by default), rather than silently inside
        the first request. Nothing happens when they are cached. Returns kernels compiled."""
        from edgeinfer.backends.cpu import CpuBackend

        if not isinstance(self.backend, CpuBackend) or self.n_ctx < 3:
            return 0  # the reference backend compiles nothing; GPU plans keep their own warm-up
        from edgeinfer.kernels_cpu import compile_progress

        top = self.config.n_vocab - 1
        if not self.model.GENERATES:   # an encoder: an input of one token and one of two (embeddings)
            def forward() -> None:
                for ids in ([min(1, top)], [min(1, top), min(2, top)]):
                    self.model.encode(np.array(ids, np.int64), [len(ids)])
                self.backend.warm_prompt_kernels(attention=False)

            return compile_progress.warm_up(forward, self.backend.encoder_kernels(), report, self._warm_key())

        def forward() -> None:
            kv = KVCache(self.config, 16, cache_types=self.cache_types)   # scratch: a short prompt, then one decoded token
            self.prefill([min(1, top), min(2, top)], kv)
            self.decode(min(3, top), kv)
            self.backend.warm_prompt_kernels()

        return compile_progress.warm_up(forward, self.backend.forward_kernels(self.config), report, self._warm_key())

    def _warm_key(self) -> str | None:
        """What the warm-up pass reaches depends on: the model file (its family and types),
        the thread count (matvec's BLAS tiles) and the K/V types (flash order, quantized K/V)."""
        path = getattr(self.model_file.gguf, "path", None)   # None: a stand-in without a file
        try:
            st = os.stat(path)
        except (OSError, TypeError):
            return None
        from edgeinfer.kernels_cpu import get_threads

        return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{get_threads()}|{self.cache_types!r}"

    @property
    def step_graphs(self):
        """The GPU backend's CUDA graphs (edgeinfer.backends.cuda_graph), None on the CPU."""
        return getattr(self.backend, "step_graphs", None)

    @property
    def n_ctx(self) -> int:
        return self.options.n_ctx

    def new_cache(self) -> KVView:
        """A contiguous cache of n_ctx tokens of the engine's K/V types, the backend's own (GPU
        layers keep K/V in VRAM)."""
        return self.backend.new_cache(self.config, self.n_ctx, self.cache_types)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, kv: KVView,
                logits_for: np.ndarray | None = None, decode_bits: bool = False,
                media: "MediaRows | None" = None) -> np.ndarray:
        """Logits of the rows `logits_for` (default: the last token) after appending `tokens`
        at `positions`. decode_bits: each row exactly as decoding its token alone would give
        it (speculative verification); otherwise a short prompt may take faster GEMMs.
        media: the request's images, which its image ids (edgeinfer.vision.media_ids) stand for."""
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        step = media.step(tokens, positions) if media is not None else None
        text = tokens if step is None else tokens[~step.where]
        if (text.size and (text.min() < 0 or text.max() >= self.config.n_vocab)) or \
                (step is None and tokens.size and tokens.min() < 0):
            raise EdgeInferError(f"token id out of range 0..{self.config.n_vocab - 1}")
        before = kv.n_used

        def run() -> np.ndarray:
            with self.backend.decode_order() if decode_bits else contextlib.nullcontext():
                self.model.media_step = step
                try:
                    return self.model.forward(tokens, positions, kv, logits_for)
                finally:
                    self.model.media_step = None

        graphs = self.step_graphs if step is None else None
        try:
            return run() if graphs is None else graphs.forward(self.model, tokens, positions, kv, logits_for, run)
        except BaseException:  # Ctrl-C or an error mid-layer: drop the half-written tokens
            kv.truncate(before)
            raise

    def prefill(self, tokens: list[int] | np.ndarray, kv: KVView, progress=None,
                decode_bits: bool = False, media: "MediaRows | None" = None) -> np.ndarray:
        """Append `tokens` after what `kv` holds, in chunks; logits of the last token (n_vocab,).
        decode_bits, media: as Engine.forward's."""
        logits = None
        for done, total, logits in self.prefill_steps(tokens, kv, decode_bits, media):
            if progress is not None:
                progress(done, total)
        if logits is None:
            raise EdgeInferError("nothing to evaluate: the prompt is empty")
        return logits

    def prefill_steps(self, tokens: list[int] | np.ndarray, kv: KVView, decode_bits: bool = False,
                      media: "MediaRows | None" = None):
        """`prefill` one chunk at a time: yields (tokens done, tokens in all, logits of the
        chunk's last token) after each chunk, so a caller can report progress in between.
        An image is never cut: it runs in one pass (edgeinfer.vision.media_ids)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        start = kv.n_used
        cuts = self.chunk_bounds(len(tokens))
        if media is not None:
            if start == 0:  # a whole prompt: where its images sit sets M-RoPE positions (a no-op otherwise)
                media = media.placed(tokens)
            cuts = media.keep_whole(tokens, cuts, self.max_prefill_rows)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            positions = np.arange(start + lo, start + hi)
            yield hi, len(tokens), self.forward(tokens[lo:hi], positions, kv, decode_bits=decode_bits,
                                                media=media)[0]

    def chunk_bounds(self, n: int) -> list[int]:
        """Where a prefill of n tokens is cut: every prefill_chunk tokens, except that a last
        piece of at most a quarter chunk joins the one before it (one more pass over every
        weight for a handful of tokens costs more than a slightly larger batch)."""
        chunk = self.options.prefill_chunk
        cuts = list(range(0, n, chunk)) + [n]
        if len(cuts) > 2 and n - cuts[-2] <= chunk // 4:
            del cuts[-2]
        return cuts

    @property
    def max_prefill_rows(self) -> int:
        """The most tokens one prefill forward pass takes (see chunk_bounds)."""
        return self.options.prefill_chunk + self.options.prefill_chunk // 4

    def decode(self, token: int, kv: KVView, media: "MediaRows | None" = None) -> np.ndarray:
        """Evaluate one token after the cache; logits (n_vocab,). media: the request's images
        (text after an image may still take M-RoPE positions of its own)."""
        return self.forward(np.array([token]), np.array([kv.n_used]), kv, media=media)[0]
