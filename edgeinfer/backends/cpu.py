"""The CPU backend: quantized matmuls through the Numba kernels on the raw GGUF blocks.

Decode (one token) takes the matvec path that quantizes the activation to 8 bits and uses
integer dot products; prefill (many tokens) takes the tile-dequantize + GEMM path.
Everything else is inherited from the numpy ops in `Backend` (cheap next to the matmuls).
"""

from __future__ import annotations

import numpy as np

from edgeinfer import kernels_cpu
from edgeinfer.backends import huge_pages
from edgeinfer.backends.base import Backend, _gelu_f16_table
from edgeinfer.backends.offload import is_expert_tensor
from edgeinfer.kernels_cpu import flash_attention, fused_layer, heap, kv_attention, moe_routing, ops
from edgeinfer.kernels_cpu.act_quant import PARALLEL_ROWS
from edgeinfer.kernels_cpu.matvec import matvec_prepared, prepare_group
from edgeinfer.kernels_cpu.prompt_attention import long_prompt_attention_kernel
from edgeinfer.kernels_cpu.prompt_plan import model_matrices, prompt_paths
from edgeinfer.kernels_cpu.repack import repack, repacks
from edgeinfer.kernels_cpu.threads import worker_pool
from edgeinfer.rope import ROPE_NEOX


def attention_path(n_queries: int, flash: bool) -> str:
    """Which attention CpuBackend.attention runs for n_queries new tokens: "flash" (a
    flash-order cache), "exact" (llama.cpp's order, up to EXACT_MAX_QUERIES) or "blas"."""
    if flash:
        return "flash"
    return "exact" if n_queries <= kv_attention.EXACT_MAX_QUERIES else "blas"


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, gguf, threads: int | None = None) -> None:
        super().__init__(gguf)
        if threads:
            kernels_cpu.set_threads(threads)
        kernels_cpu.single_threaded_blas()   # the prefill GEMM tiles' and attention's BLAS
        heap.keep_freed_buffers()             # a layer's big temporaries: reused, not re-faulted
        self._rope_angles: dict = {}
        # one kernel set for the model's types: only their code compiles
        experts = [info for name, info in gguf.tensors.items()   # the 3-D ones, not gpt-oss's expert biases
                   if len(info.shape) == 3 and is_expert_tensor(name, info.shape)]
        self._type_kernels = kernels_cpu.use_model_types(gguf.tensors.values(), experts)
        self._matrices, self._expert_matrices = model_matrices(gguf.tensors.values(), experts)
        self._prepared: dict = {}
        self._weights: dict = {}
        self._arena = huge_pages.HugePageArena() if huge_pages.available() else None

    def weight(self, name: str) -> tuple[np.ndarray, int]:
        """(blocks, type id) the kernels read for matrix `name`: on first use a copy in huge
        pages (backends/huge_pages.py; where the OS has none, the file's mapped bytes), in
        a faster layout where there is one (Q4_K -> Q4_K_X8 on AVX-512 hosts,
        kernels_cpu/repack.py). The file pages of a copy then leave this process's memory
        (peak RSS stays about the file's size). Only matrices computed here are copied:
        layers offloaded to the GPU never ask."""
        got = self._weights.get(name)
        if got is None:
            raw = self.gguf.raw(name)
            w, qt = repack(raw, self.gguf.tensors[name].qtype, self._arena.empty if self._arena else np.empty)
            if w is raw and self._arena is not None:
                w = self._arena.copy(raw)
            if w is not raw:
                self.gguf.drop_pages(name)
            got = self._weights[name] = (w, qt)
        return got

    def prepare_weights(self) -> None:
        """Make the copies `weight` would make, now: at load rather than on the first prompt
        (about 0.4 s for a 1B model's Q4_K). For a model computed wholly on this backend.
        Embedding tables (names with "embd") stay in the file, where get_rows reads a few
        of their rows, unless a matmul reads them: token_embd where the file has no
        output.weight (a tied output)."""
        tied = "output.weight" not in self.gguf.tensors
        # 3-D expert tensors stay in the file: their experts' rows are read where they lie
        names = [name for name, info in self.gguf.tensors.items()
                 if len(info.shape) == 2 and not is_expert_tensor(name, info.shape)
                 and ("embd" not in name or (tied and name == "token_embd.weight"))
                 and (self._arena is not None or repacks(info.qtype, info.n_rows))]
        # numpy copies without the GIL: the worker threads share the matrices out
        list(worker_pool(kernels_cpu.get_threads()).map(self.weight, names))

    def decode_order(self):
        return kernels_cpu.decode_order()

    def warm_prompt_kernels(self, attention: bool = True) -> None:
        """Compile (or load) what Engine.warm_up's two-token prompt does not reach: the
        prompt GEMMs (kernels_cpu.prompt_plan.warm_prompt_gemms), the float ops' parallel
        twins (ops.warm_team_kernels) and the long-prompt attention's helpers (a prompt past
        kv_attention.EXACT_MAX_QUERIES tokens; not an encoder's)."""
        from edgeinfer.kernels_cpu.prompt_plan import warm_prompt_gemms

        warm_prompt_gemms()
        ops.warm_team_kernels()
        for qtype in self._act_block_types():   # a prompt's rows quantized on every thread
            kernels_cpu.quantize_activation_rows(np.zeros((PARALLEL_ROWS, 256), np.float32),
                                                 kernels_cpu.quant_info(qtype))
        if not attention:
            return
        n = kv_attention.EXACT_MAX_QUERIES + 1
        kv = np.zeros((n, 1, 32), np.float16)
        kv_attention.attention_blas(np.zeros((n, 1, 32), np.float32), kv, kv, np.arange(n), np.arange(n), 1.0)

    def prompt_reach(self, n_tokens: int, flash: bool = False) -> frozenset:
        """What a prompt chunk of n_tokens reaches here, as the dispatch picks it: its matmuls'
        and experts' paths (kernels_cpu.prompt_plan.prompt_paths) and its attention's."""
        return prompt_paths(self._matrices, n_tokens, self._expert_matrices) | {
            ("attention", attention_path(n_tokens, flash))}

    def encoder_kernels(self) -> list:
        """The Numba kernels an encoder's first inputs compile (its matmuls and their
        activations' quantizers: its other ops are numpy), for compile_progress.warm_up."""
        from edgeinfer.kernels_cpu import quant_kernels as qk

        return [*self._type_kernels, qk.quantize_act, *self._row_quantizers()]

    def _row_quantizers(self) -> list:
        """The quantizers of a prompt's activation rows this model's types take."""
        from edgeinfer.kernels_cpu import quant_kernels as qk

        blocks = {kernels_cpu.quant_info(t).act_block for t in self._act_block_types()}
        # and the parallel ones a prompt of PARALLEL_ROWS tokens takes
        return (([qk.quantize_rows_q8_0, qk.quantize_rows_q8_0_parallel] if 32 in blocks else [])
                + ([qk.quantize_rows_q8_k, qk.quantize_rows_q8_k_parallel] if 256 in blocks else []))

    def _act_block_types(self) -> list:
        """One quantized type of this model per activation block size it needs (Q8_0's 32,
        Q8_K's 256)."""
        by_block = {}
        for t in self.gguf.tensors.values():
            if t.qtype in kernels_cpu.QUANT_INFO:
                by_block.setdefault(kernels_cpu.quant_info(t.qtype).act_block, t.qtype)
        return [by_block[b] for b in sorted(by_block)]

    def forward_kernels(self, config) -> list:
        """The Numba kernels a forward pass of this model compiles on its first tokens (a
        short prompt, then decode): what kernels_cpu.compile_progress.warm_up checks."""
        from edgeinfer.kernels_cpu import f16
        from edgeinfer.kernels_cpu import quant_kernels as qk
        from edgeinfer.kernels_cpu.matvec import compile_quantize_act_first

        # one attention kernel per head size: gemma4's sliding layers have their own
        heads = {(config.head_dim_of(i), config.head_dim_v_of(i)) for i in range(config.n_layer)
                 if not config.is_recurrent(i)} or {(config.head_dim, config.head_dim_v)}
        kernels = [*self._type_kernels, qk.quantize_act, ops._rms_norm_kernel, ops._rope_kernel, ops._rope_cache_kernel,
                   f16._round_f16_kernel, *[kv_attention.attention_kernel(*h) for h in sorted(heads)],
                   # the long-prompt attention's (warm_prompt_kernels)
                   f16._f16_to_f32_kernel, long_prompt_attention_kernel()]
        kernels += self._row_quantizers()
        if config.arch.startswith("gemma"):
            kernels.append(ops._gelu_mul_kernel)
            # nothing big is left for the end of the pass: this process compiles the decode
            # step's quantizer first rather than wait for the second process to get to it
            compile_quantize_act_first()
        else:   # SwiGLU: a decoded token's MLP is one fused kernel (fused_layer)
            kernels.append(ops._silu_mul_kernel)
            fused = fused_layer.model_kernel()
            kernels += [fused] if fused is not None else []
        return kernels

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape[0] == 1:
            prepared = self._decode_group((name,))
            if prepared is not None:
                return matvec_prepared(prepared, x[0])[0][None, :]
            return kernels_cpu.matvec(*self.weight(name), x[0])[None, :]
        return kernels_cpu.matmul(*self.weight(name), x)

    def linear_many(self, names, x):
        if x.shape[0] != 1:  # prefill: one quantized input for all of them where they take it
            return kernels_cpu.matmul_many(*self._weights_of(names), np.ascontiguousarray(x, dtype=np.float32))
        x0 = np.ascontiguousarray(x[0], np.float32)
        prepared = self._decode_group(tuple(names))
        if prepared is not None:   # every decoded token: no per-call weight lookups
            return [y[None, :] for y in matvec_prepared(prepared, x0)]
        return [y[None, :] for y in kernels_cpu.matvec_many(*self._weights_of(names), x0)]

    def expert_batch(self, names, experts, starts, rows_of, x):
        """Every active expert of one or two tensors in one parallel kernel call (kernels_cpu.expert_matvec)."""
        ws = [self.gguf.raw(name) for name in names]
        qts = [self.gguf.tensors[name].qtype for name in names]
        return kernels_cpu.expert_matvec(ws, qts, experts, starts, rows_of, self.gguf.tensors[names[0]].shape[1], x)

    def expert_combine(self, y, order, weights):
        """The base class's sum (the same bits) in one compiled pass over the outputs."""
        return moe_routing.combine(y, order, weights)

    def _weights_of(self, names) -> tuple[list, list]:
        """([blocks], [type ids]) of these matrices, as `weight` gives them."""
        got = [self.weight(n) for n in names]
        return [w for w, _ in got], [qt for _, qt in got]

    def norm_swiglu_residual(self, x, norm, eps, gate, up, down):
        if x.shape[0] == 1:  # decode: norm, MLP and residual in one compiled call (fused_layer)
            gate_up, down_w = self._decode_group((gate, up)), self._decode_group((down,))
            if gate_up is not None and down_w is not None:
                x0 = np.ascontiguousarray(x[0], np.float32)
                return fused_layer.norm_swiglu_residual(x0, self.vector(norm), eps, gate_up, down_w[0])[None, :]
        return super().norm_swiglu_residual(x, norm, eps, gate, up, down)

    def _decode_group(self, names: tuple[str, ...]):
        """The decode matvec's prepared weights for these matrices (validated once), or
        None where they need the general path (see kernels_cpu.matvec.prepare_group)."""
        if names not in self._prepared:
            self._prepared[names] = prepare_group(*self._weights_of(names))
        return self._prepared[names]

    def get_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        info = self.gguf.tensors[name]
        got = self._weights.get(name)   # an embedding table stays in the file unless a matmul copied it
        if got is None:
            got = self.weight(name) if repacks(info.qtype, info.n_rows) else (self.gguf.raw(name), int(info.qtype))
        return kernels_cpu.get_rows(*got, info.n_cols, np.asarray(ids, dtype=np.int64))

    def attention(self, q, kv, layer, positions, scale, window, q_scale=1.0, sinks=None):
        k, v, kpos = kv.layer_view(layer)
        if q_scale != 1.0:
            q = q * np.float32(q_scale)
        head_sinks = self.vector(sinks) if sinks is not None else None
        types = getattr(kv, "cache_types", None)
        path = attention_path(q.shape[0], types is not None and types.flash_order)
        if path == "flash":   # llama.cpp's flash-attention order over the blocks
            out = flash_attention.flash_attention(q, k, v, kpos, positions, types.k, types.v, scale, window,
                                                  head_sinks, rotate_q=types.rot_k)
            return types.rotate("v", out)
        if path == "exact":  # decode, short prompts: llama.cpp's order
            return kv_attention.attention(q, k, v, kpos, positions, scale, window, head_sinks)
        return kv_attention.attention_blas(q, k, v, kpos, np.asarray(positions), scale, window, head_sinks)

    # The float ops below compute what Backend's numpy versions compute, bit for bit
    # (tests/test_kernels_ops.py), in one compiled call each: per-token Python overhead.
    def rms_norm(self, x, weight, eps):
        return ops.rms_norm(x, self.vector(weight), eps)

    def rope(self, x, positions, n_dims, base, freq_scale, mode, freq_factors, yarn=None):
        # Q and K of every layer with the same base share the angles: computed once per step
        key = (np.asarray(positions).tobytes(), n_dims, base, freq_scale, freq_factors, yarn)
        cached = self._rope_angles.get(key)
        if cached is None:
            ff = self.vector(freq_factors) if freq_factors is not None else None
            cached = ops.rope_cache(positions, n_dims, base, freq_scale, ff, yarn)
            if len(self._rope_angles) >= 8:
                self._rope_angles.clear()
            self._rope_angles[key] = cached
        out = np.array(x, dtype=np.float32, order="C")
        return ops.rope_rotate(out, cached, n_dims, mode == ROPE_NEOX)

    def silu_mul(self, gate, up):
        return ops.silu_mul(gate, up)

    def swiglu_oai(self, gate, up):
        from edgeinfer.experts.activations import OAI_ALPHA, OAI_LIMIT

        return ops.swiglu_oai(gate, up, OAI_ALPHA, OAI_LIMIT)

    def gelu_mul(self, gate, up):
        return ops.gelu_mul(gate, up, _gelu_f16_table())
