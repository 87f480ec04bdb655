"""The narrow set of ops a model's forward pass is written against, and the numpy reference.

Models call ops by GGUF tensor name (`linear("blk.0.attn_q.weight", x)`), so a backend can
keep weights wherever it likes (raw blocks in an mmap, dequantized floats, VRAM). Every
faster backend (Numba CPU, CUDA) subclasses `Backend` and is tested against
`ReferenceBackend`, which dequantizes with `gguf.quants.dequantize` and does float math.

Shapes: activations are float32 (n_tokens, features); per-head tensors are
(n_tokens, n_heads, head_dim).

Beside the ops, the contract says where K/V live, as methods with host-memory defaults
(a backend that keeps some layers' K/V elsewhere overrides them, as the hybrid CPU/GPU
one does): `kv_layers` (layers whose K/V the backend keeps itself), `new_block_storage`
(its blocks for the session manager's paged pool), `max_kv_blocks` (how many it has
room for) and `new_cache` (a contiguous cache for one sequence). `at_layer` tells the
backend which block the forward pass runs.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType, quants

from edgeinfer.kv.contiguous import KVCache
from edgeinfer.rope import ROPE_NEOX, RopeArgs, Yarn

if TYPE_CHECKING:
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.kv.view import KVView
    from edgeinfer.models.config import ModelConfig

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


_UNIT = "<ones "


def unit_weight(size: int) -> str:
    """The vector name of `size` ones: rms_norm's weight for ggml_rms_norm without a weight
    (times 1.0 is exact), which every backend (and its device) then treats as any vector."""
    return f"{_UNIT}{int(size)}>"


class Backend:
    """Ops shared by every backend; subclasses override the ones they accelerate."""

    name = "base"

    def __init__(self, gguf: "GGUFFile") -> None:
        self.gguf = gguf
        self._vectors: dict[str, np.ndarray] = {}

    # -- where K/V live, and where a layer runs ----------------------------------------------
    def kv_layers(self, config: "ModelConfig") -> list[int]:
        """Layers whose K/V this backend keeps in its own storage (none: all in host memory)."""
        return []

    def new_block_storage(self, config: "ModelConfig", num_blocks: int, block_size: int,
                          cache_types: "CacheTypes | None" = None) -> Any:
        """Storage for the K/V of `kv_layers` in `num_blocks` blocks of the paged pool, with
        the pool's block ids, holding `cache_types` (edgeinfer.kv.device_storage), or None
        when there are none."""
        return None

    def max_kv_blocks(self, config: "ModelConfig", block_size: int, cache_types: "CacheTypes | None" = None
                      ) -> int | None:
        """The most blocks of `kv_layers` the backend has room for (None: no limit of its own)."""
        return None

    def new_cache(self, config: "ModelConfig", n_ctx: int, cache_types: "CacheTypes | None" = None) -> "KVView":
        """A contiguous cache for one sequence of up to n_ctx tokens, of `cache_types` (f16 default)."""
        return KVCache(config, n_ctx, cache_types=cache_types)

    def decode_order(self):
        """A context in which a forward pass of several tokens gives each one's logits with the
        bits of decoding it alone (speculative verification). The host backends' short
        prompts otherwise take GEMMs with their own summation order."""
        return contextlib.nullcontext()

    def at_layer(self, layer: int | None) -> None:
        """The forward pass is about to run block `layer` (None: the output head). A backend
        that places layers on different devices notes where unnamed ops (`add`) now run."""

    # -- weights --------------------------------------------------------------------------
    def run_layers(self, n_layer: int, x: np.ndarray, layer, positions: np.ndarray, kv: "KVView") -> np.ndarray:
        """x through blocks 0..n_layer-1 in order (`layer(i, x)` runs block i): a backend may
        replay a run of them it has recorded (edgeinfer.backends.cuda_graph)."""
        return self.run_layers_from(0, n_layer, x, layer)

    def run_layers_from(self, first: int, end: int, x: np.ndarray, layer) -> np.ndarray:
        """x through blocks first..end-1 in order."""
        for i in range(first, end):
            self.at_layer(i)
            x = layer(i, x)
        return x

    def vector(self, name: str) -> np.ndarray:
        """A 1-D weight (norm, bias, rope factors) as float32, cached; `unit_weight(n)` names
        n ones."""
        vec = self._vectors.get(name)
        if vec is None and name.startswith(_UNIT):
            vec = self._vectors[name] = np.ones(int(name[len(_UNIT):-1]), np.float32)
        elif vec is None:
            info = self.gguf.tensors[name]
            vec = quants.dequantize(self.gguf.raw(name), info.qtype).astype(np.float32).ravel()
            self._vectors[name] = vec
        return vec

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        """x (n, n_cols) @ W^T -> (n, n_rows) for the GGUF matrix `name`."""
        raise NotImplementedError

    def recurrence(self, layer: int, head_dim: int):
        """What runs a recurrent (DeltaNet) layer's recurrence on this backend's own device, with
        its state there (edgeinfer.backends.cuda_recurrence), or None: the host kernels."""
        return None

    def linear_many(self, names: list[str], x: np.ndarray) -> list[np.ndarray]:
        """[linear(name, x) for name in names]: several matrices on the same input (Q/K/V,
        gate/up), which a backend may run together."""
        return [self.linear(name, x) for name in names]

    def expert_batch(self, names: list[str], experts: np.ndarray, starts: np.ndarray, rows_of: np.ndarray,
                     x: np.ndarray) -> list[np.ndarray]:
        """A mixture-of-experts layer's expert matmuls (edgeinfer.experts.ffn): for active expert
        experts[i] and each assignment a in starts[i]..starts[i + 1], out[a] = x[rows_of[a]] @ W_e^T
        with W_e that expert's rows of the 3-D tensor (GGML shape (n_cols, rows, n_expert));
        one (n_assignments, rows) array per name."""
        raise NotImplementedError

    def expert_bias(self, y: np.ndarray, name: str, expert_of_row: np.ndarray) -> np.ndarray:
        """y + the rows of a per-expert bias tensor (GGML shape (rows, n_expert)) for each row's
        expert (ggml_add_id)."""
        n_expert = self.gguf.tensors[name].shape[1]
        return y + self.vector(name).reshape(n_expert, -1)[expert_of_row]

    def expert_combine(self, y: np.ndarray, order: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Each token's expert outputs weighted and summed: y holds the assignments grouped by
        expert (grouped row i is assignment order[i] = t * k + j); out[t] = sum_j y_tj * w_tj,
        each product rounded to float32, then added slot by slot as ggml does."""
        n, k = weights.shape
        per_assignment = np.empty_like(y)
        per_assignment[order] = y
        per_assignment = per_assignment.reshape(n, k, -1)
        out = None
        for j in range(k):
            term = (per_assignment[:, j] * weights[:, j:j + 1]).astype(np.float32)
            out = term if out is None else (out + term).astype(np.float32)
        return out

    def get_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of matrix `name` as float32 (len(ids), n_cols): the embedding lookup."""
        info = self.gguf.tensors[name]
        raw = self.gguf.raw(name)[np.asarray(ids, dtype=np.int64)]
        return quants.dequantize(raw, info.qtype).astype(np.float32).reshape(len(ids), info.n_cols)

    # -- elementwise and normalisation ---------------------------------------------------
    def rms_norm(self, x: np.ndarray, weight: str, eps: float) -> np.ndarray:
        """RMSNorm over the last axis, times the weight vector (any leading shape)."""
        # ggml's order: sum of float32 squares in double, mean back to float32, then
        # x * (1 / sqrt(mean + eps)). This model family amplifies last-bit differences.
        sq = np.square(x, dtype=np.float32).astype(np.float64)
        total = np.cumsum(sq, axis=-1)[..., -1:]  # in order, as ggml (sum() would pair up)
        mean = (total / x.shape[-1]).astype(np.float32)
        scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
        return (x * scale) * self.vector(weight)

    def norm_swiglu_residual(self, x: np.ndarray, norm: str, eps: float, gate: str, up: str,
                             down: str) -> np.ndarray:
        """A pre-norm SwiGLU feed-forward with its residual: x + down(silu(gate(h)) * up(h)),
        h = rms_norm(x). Backends may run it as one fused step (the CPU one does, in decode)."""
        h = self.rms_norm(x, norm, eps)
        return self.linear_residual(down, self.gated_linear(gate, up, h, "silu"), x)

    def gated_linear(self, gate: str, up: str, x: np.ndarray, act: str) -> np.ndarray:
        """act(gate(x)) * up(x), act "silu" or "gelu": a gated feed-forward's first half, which a
        backend may run as one step."""
        g, u = self.linear_many([gate, up], x)
        return self.silu_mul(g, u) if act == "silu" else self.gelu_mul(g, u)

    def linear_residual(self, name: str, x: np.ndarray, residual: np.ndarray) -> np.ndarray:
        """residual + linear(name, x): a backend may add the residual as the matmul writes."""
        return residual + self.linear(name, x)

    def residual_rms_norm(self, residual: np.ndarray, x: np.ndarray, weight: str, eps: float) -> np.ndarray:
        """residual + rms_norm(x, weight) (Gemma's post-norms): a backend may add it as the norm writes."""
        return residual + self.rms_norm(x, weight, eps)

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """SiLU of gate, times up, as ggml's AVX2 swiglu: gate / (1 + ggml_v_expf(-gate))."""
        gate = np.asarray(gate, np.float32)
        with np.errstate(over="ignore"):
            silu = (gate / (np.float32(1.0) + ggml_expf_any(-gate))).astype(np.float32)
        return (silu * up).astype(np.float32)

    def gelu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """GELU (tanh approximation) of gate, times up, the way ggml's CPU geglu computes it:
        a table lookup by the F16-rounded input; identity above 10 and zero below -10."""
        table = _gelu_f16_table()
        g = table[gate.astype(np.float16).view(np.uint16)]
        y = np.where(gate >= 10.0, gate, np.where(gate <= -10.0, np.float32(0.0), g)) * up
        return y.astype(np.float32)

    def scale_rows(self, x: np.ndarray, factors: np.ndarray) -> np.ndarray:
        """Row r of x (n, n_cols) times factors[r], in float32 (a per-expert output scale)."""
        return (np.asarray(x, np.float32) * np.asarray(factors, np.float32)[:, None]).astype(np.float32)

    def layer_norm(self, x: np.ndarray, weight: str, bias: str | None, eps: float) -> np.ndarray:
        """LayerNorm over the last axis (encoders: BERT), times the weight plus the bias;
        ggml_norm's order: mean and variance summed in double, 1/sqrt in float32."""
        x64 = x.astype(np.float64)
        centred = (x64 - x64.mean(axis=-1, keepdims=True)).astype(np.float32)
        var = np.square(centred.astype(np.float64)).mean(axis=-1, keepdims=True).astype(np.float32)
        out = centred * (np.float32(1.0) / np.sqrt(var + np.float32(eps)))
        out = out * self.vector(weight)
        return out + self.vector(bias) if bias is not None else out

    def gelu(self, x: np.ndarray) -> np.ndarray:
        """GELU (tanh approximation) as ggml's CPU gelu: the F16 table of `gelu_mul`."""
        x = np.asarray(x, np.float32)
        return Backend.gelu_mul(self, x, np.ones_like(x))

    def swiglu_oai(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """gpt-oss's clamped SwiGLU (alpha 1.702, limit 7) of two (n, n_ff) arrays."""
        from edgeinfer.experts.activations import swiglu_oai

        return swiglu_oai(gate, up)

    def attention_full(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
        """Non-causal attention of one sequence (encoders): every query sees every key.
        q: (n, n_head, hd), k/v: (n, n_kv, hd|hd_v) -> (n, n_head, hd_v); softmax in double."""
        n, n_head, hd = q.shape
        n_kv = k.shape[1]
        qg = q.astype(np.float64).reshape(n, n_kv, n_head // n_kv, hd)
        scores = np.einsum("tkgd,skd->kgts", qg, k.astype(np.float64)) * scale
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out = np.einsum("kgts,skd->tkgd", p, v.astype(np.float64))
        return out.reshape(n, n_head, -1).astype(np.float32)

    def rope_qk(self, q: np.ndarray, k: np.ndarray, positions: np.ndarray, n_dims: int, base: float,
                freq_scale: float, mode: str, freq_factors: str | None, yarn: Yarn | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """`rope` of a step's Q and of its K, which a backend may run as one step."""
        return (self.rope(q, positions, n_dims, base, freq_scale, mode, freq_factors, yarn),
                self.rope(k, positions, n_dims, base, freq_scale, mode, freq_factors, yarn))

    def rope_store(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, rope: "RopeArgs",
                   kv: "KVView", layer: int, slots: np.ndarray) -> np.ndarray:
        """RoPE of Q and K, and K/V stored in `layer`'s `slots` of kv: rotated Q. A backend may run
        the rotation and the store as one step."""
        q, k = self.rope_qk(q, k, positions, *rope)
        kv.store(layer, slots, k, v)
        return q

    def rope(self, x: np.ndarray, positions: np.ndarray, n_dims: int, base: float,
             freq_scale: float, mode: str, freq_factors: str | None, yarn: Yarn | None = None) -> np.ndarray:
        """Rotary embedding of the first n_dims of each head; x: (n, heads, head_dim).

        ggml's exact arithmetic: its float32 angle recurrence and cosf/sinf (`rope_cache`),
        and the rotation as the compiler emits it, x0*cos - x1*sin = fma(x0, cos, -(x1*sin))
        and x0*sin + x1*cos = fma(x0, sin, x1*cos)."""
        from edgeinfer.kernels_cpu.ops import rope_cache

        ff = self.vector(freq_factors) if freq_factors is not None else None
        cos, sin = rope_cache(positions, n_dims, base, freq_scale, ff, yarn)
        cos, sin = cos[:, None, :], sin[:, None, :]
        out = x.astype(np.float32, copy=True)
        if mode == ROPE_NEOX:
            half = n_dims // 2
            a, b = out[..., :half].copy(), out[..., half:n_dims].copy()
            out[..., :half] = _fma(a, cos, -(b * sin))
            out[..., half:n_dims] = _fma(a, sin, b * cos)
        else:
            a, b = out[..., 0:n_dims:2].copy(), out[..., 1:n_dims:2].copy()
            out[..., 0:n_dims:2] = _fma(a, cos, -(b * sin))
            out[..., 1:n_dims:2] = _fma(a, sin, b * cos)
        return out

    # -- attention ------------------------------------------------------------------------
    def attention(self, q: np.ndarray, kv: "KVView", layer: int, positions: np.ndarray,
                  scale: float, window: int, q_scale: float = 1.0, sinks: str | None = None) -> np.ndarray:
        """Causal attention of q (n, n_head, hd) over the cached K/V of `layer`.

        A query at position p sees cached keys at positions <= p, and with a sliding
        window only those with p - key_pos < window (llama.cpp's standard SWA mask).
        `q_scale` multiplies Q first (in float32, before its F16 rounding: Gemma), `scale`
        multiplies Q K^T. `sinks` names a per-head vector of attention sinks (gpt-oss): a
        logit each head's softmax counts as if one more key had it, with no value (ggml's
        soft_max sinks: the row max takes it in, and libm expf(sink - max) joins the sum
        last). Returns (n, n_head, hd_v).

        This is the readable numpy form of llama.cpp's exact rounding order, which
        kernels_cpu/kv_attention.py explains and the CPU backend runs compiled.
        """
        k, v, kpos = kv.layer_view(layer)  # (S, n_kv, hd), (S, n_kv, hd_v), (S,) in slot order
        if q_scale != 1.0:
            q = q * np.float32(q_scale)
        types = getattr(kv, "cache_types", None)
        if types is not None and types.flash_order:   # quantized K/V, or -fa on: llama.cpp's flash order
            from edgeinfer.kernels_cpu import flash_attention_ref

            sink = None if sinks is None else np.asarray(self.vector(sinks), np.float32)
            out = flash_attention_ref.flash_attention(types.rotate("k", q), k, v, kpos, positions, types.k, types.v,
                                                      scale, window, sink)
            return types.rotate("v", out)   # llama.cpp's rotations (edgeinfer.kv.cache_types)
        n, n_head, hd = q.shape
        n_keys, n_kv = k.shape[0], k.shape[1]
        group = n_head // n_kv
        qpos = np.asarray(positions)[:, None]
        allowed = kpos[None, :] <= qpos
        if window:
            allowed &= (qpos - kpos[None, :]) < window  # (n, S)
        q16 = q.astype(np.float16).astype(np.float32).reshape(n, n_kv, group, hd)
        k32 = k.astype(np.float32)
        # Q K^T as ggml_vec_dot_f16: SLOTS float32 slots (32; 64 on AVX-512), slot e % SLOTS
        # sums dims e, e + SLOTS, ... in order (the products of two F16 values are exact), the
        # fixed reduction, then the dims past the last multiple of SLOTS in double.
        from edgeinfer.kernels_cpu.ggml_math_ref import LANES, SLOTS, expf_nonpositive, hsum_vec, reduce_slots

        n_vec = hd - hd % SLOTS
        slots = np.zeros((n, n_kv, group, n_keys, SLOTS), np.float32)
        for c in range(0, n_vec, SLOTS):
            kc = k32[:, :, c:c + SLOTS].transpose(1, 0, 2)  # (n_kv, S, SLOTS)
            slots += q16[:, :, :, None, c:c + SLOTS] * kc[None, :, None, :, :]
        dots = reduce_slots(slots).astype(np.float64)
        if n_vec < hd:
            dots += np.einsum("tkgd,skd->tkgs", q16[..., n_vec:].astype(np.float64),
                              k32[:, :, n_vec:].astype(np.float64))
        scores = dots.astype(np.float32).reshape(n, n_head, n_keys) * np.float32(scale)
        scores = np.where(allowed[:, None, :], scores, np.float32(-np.inf))
        mx = scores.max(axis=-1, keepdims=True)
        if sinks is not None:
            sink = np.asarray(self.vector(sinks), np.float32)[None, :, None]
            mx = np.maximum(mx, sink)
        e = expf_nonpositive(scores - mx)
        pad = (-n_keys) % LANES  # ggml sums each vector of LANES in float32, those sums in double
        groups = np.concatenate([e, np.zeros((n, n_head, pad), np.float32)], axis=-1)
        total = hsum_vec(groups.reshape(n, n_head, -1, LANES)).astype(np.float64).sum(axis=-1, keepdims=True)
        if sinks is not None:
            from edgeinfer.kernels_cpu import libm

            total += libm.expf(sink - mx).astype(np.float64)
        probs = (e * (1.0 / total).astype(np.float32)).astype(np.float16).astype(np.float32)
        # weights x V: ggml_vec_dot_f16 over the keys, key j in slot j % SLOTS, in key order
        pad32 = (-n_keys) % SLOTS
        v32 = np.concatenate([v.astype(np.float32), np.zeros((pad32,) + v.shape[1:], np.float32)])
        p = np.concatenate([probs, np.zeros((n, n_head, pad32), np.float32)], axis=-1)
        p = p.reshape(n, n_kv, group, -1)
        out_slots = np.zeros((n, n_kv, group, v.shape[2], SLOTS), np.float32)
        for j in range(0, n_keys + pad32, SLOTS):
            block = v32[j:j + SLOTS].transpose(1, 2, 0)  # (n_kv, hd_v, SLOTS)
            out_slots += p[:, :, :, None, j:j + SLOTS] * block[None, :, None, :, :]
        return reduce_slots(out_slots).reshape(n, n_head, -1)

    def image_attention(self, q, kv: "KVView", layer: int, positions: np.ndarray, firsts: np.ndarray,
                        limits: np.ndarray, scale: float, window: int, **kw):
        """`attention`, except that query r, a row of the non-causal image at positions
        firsts[r]..limits[r], sees its whole image (firsts[r] == limits[r]: a causal row). The
        default runs `attention` on views of the cache (edgeinfer.vision.image_attention);
        a backend whose kernels mask by a per-query limit overrides it."""
        from edgeinfer.vision.image_attention import attention_to_limits

        return attention_to_limits(self.attention, q, kv, layer, positions, firsts, limits, scale, window, **kw)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add: the product of two float32 is exact in float64."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


_GELU_TABLE: list[np.ndarray] = []


def _gelu_f16_table() -> np.ndarray:
    """ggml's GELU table: for every F16 input, 0.5x(1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))
    in float32 ops (the compiler fuses (0.044715 x) x + 1 into an fma; tanh correctly
    rounded), rounded to F16. Built once (65536 entries)."""
    if not _GELU_TABLE:
        x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
        with np.errstate(all="ignore"):
            ax = np.float32(0.044715) * x
            inner = (ax.astype(np.float64) * x + 1.0).astype(np.float32)  # exact-product fma
            arg = (np.float32(_SQRT_2_OVER_PI) * x) * inner
            t = np.tanh(arg.astype(np.float64)).astype(np.float32)
            g = (np.float32(0.5) * x) * (np.float32(1.0) + t)
        _GELU_TABLE.append(g.astype(np.float16).astype(np.float32))
    return _GELU_TABLE[0]


def ggml_expf_any(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf of this CPU's llama.cpp build over any finite float32 x (kernels_cpu.ggml_math_ref)."""
    from edgeinfer.kernels_cpu import ggml_math_ref   # Numba: not at import, the CLI and server start light

    return ggml_math_ref.expf_any(x)


class ReferenceBackend(Backend):
    """Plain numpy: dequantize each matrix once to float32 and multiply. Slow, obviously right."""

    name = "reference"

    def __init__(self, gguf: "GGUFFile") -> None:
        super().__init__(gguf)
        self._dense: dict[str, np.ndarray] = {}

    def dense(self, name: str) -> np.ndarray:
        """The matrix dequantized, as float64 (n_rows, n_cols), cached."""
        w = self._dense.get(name)
        if w is None:
            info = self.gguf.tensors[name]
            if info.qtype == GGMLQuantizationType.F32:
                w = np.asarray(self.gguf.array(name))
            else:
                w = quants.dequantize(self.gguf.raw(name), info.qtype)
            w = w.reshape(info.n_rows, info.n_cols).astype(np.float64)
            self._dense[name] = w
        return w

    def expert_batch(self, names, experts, starts, rows_of, x):
        x = np.asarray(x, np.float64)
        outs = []
        for name in names:
            n = self.gguf.tensors[name].shape[1]
            w = self.dense(name)  # all experts' rows, (n_expert * n, n_cols)
            out = np.empty((len(rows_of), n), np.float32)
            for i, e in enumerate(experts):
                a0, a1 = int(starts[i]), int(starts[i + 1])
                out[a0:a1] = (x[rows_of[a0:a1]] @ w[e * n:(e + 1) * n].T).astype(np.float32)
            outs.append(out)
        return outs

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        # float64 sums rounded once to float32: a row's result does not depend on how many
        # rows share the call. In float32 it did: BLAS picks other kernels (and summation
        # orders) by batch size, so a cached prefix plus a new chunk could pick another
        # greedy token than the whole prompt at once.
        return (x.astype(np.float64) @ self.dense(name).T).astype(np.float32)
