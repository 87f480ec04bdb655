"""Thin PyCUDA launchers: one Python function per kernel family, on pycuda GPUArrays.

Shapes follow edgeinfer.backends.base: activations float32 (n_tokens, features), per-head
tensors (n_tokens, n_heads, head_dim); weights are raw GGUF rows (n_rows, row_bytes) uint8.
pycuda is imported inside the functions, so importing this module never needs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from edgeinfer.kernels_cpu.quant_types import cuda_types
from edgeinfer.kernels_cuda.graph import COUNTS, CopyOp, KernelOp, current_recorder
from edgeinfer.kernels_cuda import runtime
from edgeinfer.kernels_cuda.runtime import allocator, kernel

# GGUF type -> kernel name suffix (matvec_<s>, gemm_<s>, dequant_<s> in quant.cu): the
# quant-type registry's `cuda` column
QTYPE_SUFFIX = cuda_types()
KERNEL_NAMES = {
    "quant.cu": [f"{op}_{s}" for s in QTYPE_SUFFIX.values()
                 for op in ("matvec", "gemm", "dequant", "matvec_id", "gemm_id")] + ["matvec_many", "matvec_glu"],
    "attention.cu": ["kv_store", "kv_positions", "flash_attention_prefill", "flash_attention_prefill_q",
                     *[f"flash_attention_tc{q}_{hd}" for q in ("", "_q") for hd in (64, 128, 256)],
                     "paged_decode_attention",
                     "paged_decode_attention_wide", "paged_decode_attention_q", "paged_decode_attention_q_wide"],
    "kv_quant.cu": ["kv_store_quant", "hadamard_rows"],
    "elementwise.cu": ["rms_norm", "layer_norm", "pad_cols", "rope", "rope_qk", "rope_qk_store", "silu_mul", "gelu_mul", "gelu", "mul", "mul_rows", "scale_rows", "scale", "add",
                       "add_rows", "swiglu_oai", "add_id", "moe_combine"],
    "recurrent.cu": ["gated_delta_net", "ssm_conv_silu", "delta_gates", "l2_norm_rows", "sigmoid_mul",
                     "qkv_split_norm"],
}
MATVEC_MAX_TOKENS = 4  # up to this many rows re-read the weights per token; more use the GEMM
# K/V cache types the kernels read and kv_store_quant writes (KV_* in attention.cu and kv_quant.cu)
KV_TYPE_CODE = {"f16": 0, "q8_0": 1, "q4_0": 2, "q4_1": 3, "q5_0": 4, "q5_1": 5, "iq4_nl": 6}
FLASH_MAX_HEAD_DIM = 256  # MAX_HD in attention.cu: the prefill kernel and paged_decode_attention
MAX_HEAD_DIM = 512  # MAX_HD_WIDE: paged_decode_attention_wide, for any number of queries


_FORMAT = {np.int32: "i", np.int64: "q", np.float32: "f"}  # pycuda's prepared-call codes; "P" a pointer
_PREPARED: dict[tuple[str, str], tuple[Any, str]] = {}


def _run(source: str, name: str, grid: tuple, block: tuple, *args) -> None:
    """Launch kernel `name` of `source` with pycuda's prepared call.

    Each argument is a device array or None (a pointer; None is NULL) or a numpy scalar. The
    struct format is fixed at the kernel's first launch, so a launch packs plain values: pycuda's
    generic call inspects every argument each time, and at ~250 launches a decode step that
    overhead was most of the step on a fast GPU. A step being recorded for a graph
    (kernels_cuda.graph) keeps the launch too."""
    fmt = "".join("P" if a is None or hasattr(a, "gpudata") else _FORMAT[type(a)] for a in args)
    key = (source, name)
    found = _PREPARED.get(key)
    if found is None or found[0] is not kernel(source, name):
        found = _PREPARED[key] = (kernel(source, name).prepare(fmt), fmt)
    if found[1] != fmt:
        raise TypeError(f"{name}: launched with argument types {fmt}, prepared as {found[1]}")
    values = [0 if a is None else a.ptr if hasattr(a, "gpudata") else a for a in args]
    rec = current_recorder()
    if rec is not None:
        rec.ops.append(KernelOp(found[0], grid, block, tuple(values)))
    COUNTS["kernels"] += 1
    found[0].prepared_call(grid, block, *values)


def _empty(shape: tuple[int, ...], dtype=np.float32):
    """An activation: from the pool, or while a step records for a graph, the recording's own
    (a replay writes it again, so the pool must never hand its address to anything else)."""
    from pycuda import gpuarray

    rec = current_recorder()
    if rec is None:
        return gpuarray.empty(shape, dtype, allocator=allocator())
    out = gpuarray.empty(shape, dtype)
    rec.arena.append(out)
    return out


def copy(x):
    """A device copy of x (recorded like a launch while a step records)."""
    out = _empty(x.shape, x.dtype)
    _dtod(int(out.gpudata), int(x.ptr), x.nbytes)
    return out


def _dtod(dst: int, src: int, nbytes: int) -> None:
    import pycuda.driver as drv

    rec = current_recorder()
    if rec is None:
        drv.memcpy_dtod(dst, src, nbytes)
        return
    rec.ops.append(CopyOp(dst, src, nbytes))
    with rec.allowed():
        drv.memcpy_dtod(dst, src, nbytes)


def zeros(shape, dtype=np.float32):
    """A zeroed device array of any dtype. pycuda's gpuarray.zeros fills through an elementwise
    kernel that has no float16 type (it raises "unable to map dtype"); a driver memset has none."""
    import pycuda.driver as cuda
    from pycuda import gpuarray

    out = gpuarray.empty(shape, dtype)
    if out.nbytes:
        cuda.memset_d8(out.gpudata, 0, out.nbytes)
    return out


def _grid1d(n: int, threads: int = 256) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return ((n + threads - 1) // threads, 1, 1), (threads, 1, 1)


def supports(qtype: Q, n_cols: int) -> bool:
    return qtype in QTYPE_SUFFIX and n_cols % 32 == 0


TC_HEAD_DIMS = {64: 4, 128: 2, 256: 1}  # flash_attention_tc_<HD>: the head dims it pads to, warps a block


def tensor_cores() -> bool:
    """Whether the device has the fp16 WMMA the prefill attention uses (sm_70+)."""
    return runtime.compute_capability() >= (7, 0)


def attention_supports(hd: int, hd_v: int) -> bool:
    return max(hd, hd_v) <= MAX_HEAD_DIM and hd % 2 == 0


def linear(w, qtype: Q, n_rows: int, n_cols: int, x, residual=None):
    """x (n, n_cols) f32 @ W^T (+ residual) -> (n, n_rows); W is raw GGUF rows in VRAM."""
    n = x.shape[0]
    row_bytes = w.shape[1]
    y = _empty((n, n_rows))
    s = QTYPE_SUFFIX[qtype]
    if n <= MATVEC_MAX_TOKENS:
        _run("quant.cu", f"matvec_{s}", ((n_rows + 3) // 4, n, 1), (128, 1, 1),
             w, np.int64(row_bytes), np.int32(n_rows), np.int32(n_cols), x, residual, y)
    else:
        _run("quant.cu", f"gemm_{s}", ((n_rows + 63) // 64, (n + 63) // 64, 1), (128, 1, 1),
             w, np.int64(row_bytes), np.int32(n_rows), np.int32(n_cols), x, np.int32(n), residual, y)
    return y


MANY_MAX = 3  # matrices matvec_many takes in one launch
GLU_ACT = {"silu": 0, "gelu": 1}  # matvec_glu's activations


def linear_many(mats: list[tuple[Any, Q, int]], n_cols: int, x) -> list:
    """[x @ W^T for each (W, qtype, n_rows) in mats] for a few tokens (<= MATVEC_MAX_TOKENS) in
    one launch: Q, K and V, of any types the matvec takes; each result has the plain matvec's bits."""
    n = x.shape[0]
    if not 1 <= len(mats) <= MANY_MAX or n > MATVEC_MAX_TOKENS:
        raise ValueError(f"linear_many takes 1..{MANY_MAX} matrices and up to {MATVEC_MAX_TOKENS} tokens")
    ys = [_empty((n, rows)) for _, _, rows in mats]
    padded = list(mats) + [(None, Q.F32, 0)] * (MANY_MAX - len(mats))
    total = sum(rows for _, _, rows in mats)
    _run("quant.cu", "matvec_many", ((total + 3) // 4, n, 1), (128, 1, 1),
         *[w for w, _, _ in padded], *[np.int64(0 if w is None else w.shape[1]) for w, _, _ in padded],
         *[np.int32(int(t)) for _, t, _ in padded], *[np.int32(rows) for _, _, rows in padded], np.int32(n_cols), x,
         *(ys + [None] * (MANY_MAX - len(ys))))
    return ys


def linear_glu(gate: tuple[Any, Q], up: tuple[Any, Q], n_rows: int, n_cols: int, x, act: str):
    """act(x @ Wg^T) * (x @ Wu^T) for a few tokens in one launch (act "silu" or "gelu"): the bits
    of the two matvecs and silu_mul / gelu_mul."""
    n = x.shape[0]
    if n > MATVEC_MAX_TOKENS:
        raise ValueError(f"linear_glu takes up to {MATVEC_MAX_TOKENS} tokens")
    y = _empty((n, n_rows))
    (wg, tg), (wu, tu) = gate, up
    _run("quant.cu", "matvec_glu", ((n_rows + 3) // 4, n, 1), (128, 1, 1), wg, wu, np.int64(wg.shape[1]),
         np.int64(wu.shape[1]), np.int32(int(tg)), np.int32(int(tu)), np.int32(n_rows), np.int32(n_cols), x,
         np.int32(GLU_ACT[act]), y)
    return y


def expert_linear(w, qtype: Q, n_rows: int, n_cols: int, x, route: "ExpertRoute"):
    """A mixture of experts' matmul on its 3-D tensor w (n_expert * n_rows raw GGUF rows in VRAM):
    row a of the result is expert route.row_expert[a]'s rows . x[route.xrow[a]] -> (route.n, n_rows)."""
    y = _empty((route.n, n_rows))
    s, row_bytes = QTYPE_SUFFIX[qtype], np.int64(w.shape[1])
    if route.max_group <= MATVEC_MAX_TOKENS:
        _run("quant.cu", f"matvec_id_{s}", ((n_rows + 3) // 4, route.n, 1), (128, 1, 1),
             w, row_bytes, np.int32(n_rows), np.int32(n_cols), x, route.xrow, route.row_expert, y)
    else:
        _run("quant.cu", f"gemm_id_{s}", ((n_rows + 63) // 64, (route.max_group + 63) // 64, route.n_groups),
             (128, 1, 1), w, row_bytes, np.int32(n_rows), np.int32(n_cols), x, route.xrow, route.experts,
             route.starts, y)
    return y


class ExpertRoute:
    """The (token, expert) assignments of one expert matmul, as int32 arrays in VRAM, uploaded
    in one copy: experts (the active experts), starts (their groups' bounds in the grouped
    rows), xrow (the input row of each grouped row) and row_expert (its expert)."""

    def __init__(self, experts: np.ndarray, starts: np.ndarray, xrow: np.ndarray) -> None:
        from pycuda import gpuarray

        counts = np.diff(starts)
        self.n, self.n_groups = int(len(xrow)), int(len(experts))
        self.max_group = int(counts.max()) if len(counts) else 0
        packed = np.concatenate([experts, starts, xrow, np.repeat(experts, counts)]).astype(np.int32)
        dev = gpuarray.to_gpu(packed)
        a, b, c = self.n_groups, 2 * self.n_groups + 1, 2 * self.n_groups + 1 + self.n
        self.experts, self.starts, self.xrow, self.row_expert = dev[:a], dev[a:b], dev[b:c], dev[c:]


def dequantize(w, qtype: Q, n_rows: int, n_cols: int):
    out = _empty((n_rows, n_cols))
    grid, block = _grid1d(n_rows * (n_cols // 32))
    _run("quant.cu", f"dequant_{QTYPE_SUFFIX[qtype]}", grid, block,
         w, np.int64(w.shape[1]), np.int32(n_rows), np.int32(n_cols), out)
    return out


def rms_norm(x, weight, eps: float, residual=None):
    """Over the last axis of x (any leading shape), times weight (+ residual)."""
    n_cols = x.shape[-1]
    out = _empty(x.shape)
    _run("elementwise.cu", "rms_norm", (x.size // n_cols, 1, 1), _row_block(n_cols),
         x, weight, residual, out, np.int32(n_cols), np.float32(eps))
    return out


def layer_norm(x, weight, bias, eps: float):
    """(x - mean) / sqrt(var + eps) over the last axis of x, times weight, plus bias (either None)."""
    n_cols = x.shape[-1]
    out = _empty(x.shape)
    _run("elementwise.cu", "layer_norm", (x.size // n_cols, 1, 1), _row_block(n_cols),
         x, weight, bias, out, np.int32(n_cols), np.float32(eps))
    return out


def _row_block(n_cols: int) -> tuple[int, int, int]:
    """A row kernel's block (one block a row, block_sum's shape): whole warps, up to 1024 threads."""
    return (min(1024, max(32, (n_cols + 31) // 32 * 32)), 1, 1)


def pad_cols(x, n_pad: int):
    """x (n, n_cols) -> (n, n_pad), zeros in the new columns (n_pad >= n_cols)."""
    n, n_cols = x.shape
    out = _empty((n, n_pad))
    grid, block = _grid1d(n * n_pad)
    _run("elementwise.cu", "pad_cols", grid, block, x, out, np.int64(n * n_pad), np.int32(n_cols), np.int32(n_pad))
    return out


def rope(x, positions, n_dims: int, base: float, freq_scale: float, neox: bool, freq_factors=None, yarn=None):
    """x (n, heads, hd); positions int32 (n,) on the device; yarn: an edgeinfer.rope.Yarn or None."""
    n, heads, hd = x.shape
    out = _empty(x.shape)
    grid, block = _grid1d(n * heads * (hd // 2))
    _run("elementwise.cu", "rope", grid, block, x, out, positions, np.int32(n), np.int32(heads), np.int32(hd),
         *_rope_args(n_dims, base, freq_scale, neox, freq_factors, yarn))
    return out


def _rope_args(n_dims: int, base: float, freq_scale: float, neox: bool, freq_factors, yarn) -> tuple:
    """The rope kernels' trailing arguments (ROPE_ARGS in elementwise.cu)."""
    ext, mscale, low, high = yarn if yarn is not None else (0.0, 1.0, 0.0, 0.0)
    return (np.int32(n_dims), np.float32(base), np.float32(freq_scale), np.int32(1 if neox else 0), freq_factors,
            np.float32(ext), np.float32(mscale), np.float32(low), np.float32(high))


def rope_qk(q, k, positions, n_dims: int, base: float, freq_scale: float, neox: bool, freq_factors=None, yarn=None):
    """`rope` of q (n, hq, hd) and k (n, hk, hd) in one launch, each with rope's bits."""
    n, hq, hd = q.shape
    hk = k.shape[1]
    q_out, k_out = _empty(q.shape), _empty(k.shape)
    grid, block = _grid1d(n * (hq + hk) * (hd // 2))
    _run("elementwise.cu", "rope_qk", grid, block, q, q_out, k, k_out, positions, np.int32(n), np.int32(hq),
         np.int32(hk), np.int32(hd), *_rope_args(n_dims, base, freq_scale, neox, freq_factors, yarn))
    return q_out, k_out


def rope_qk_store(q, k, v, positions, k_cache, v_cache, block_table, slots, block_size: int, n_dims: int,
                  base: float, freq_scale: float, neox: bool, freq_factors=None, yarn=None):
    """`rope_qk` of q and k, with k and v (n, n_kv, hd / hd_v) written into their f16 cache rows
    at the logical `slots` as kv_store writes them, in one launch. Returns rotated q."""
    n, hq, hd = q.shape
    hk, hd_v = k.shape[1], v.shape[2]
    q_out = _empty(q.shape)
    grid, block = _grid1d(n * (hq + hk) * (hd // 2) + n * hk * hd_v)
    _run("elementwise.cu", "rope_qk_store", grid, block, q, q_out, k, v, k_cache, v_cache, block_table, slots, positions,
         np.int32(n), np.int32(hq), np.int32(hk), np.int32(hd), np.int32(hd_v), np.int32(block_size),
         *_rope_args(n_dims, base, freq_scale, neox, freq_factors, yarn))
    return q_out


def _binary(name: str, a, b):
    return _binary_in("elementwise.cu", name, a, b)


def silu_mul(gate, up):
    return _binary("silu_mul", gate, up)


def gelu_mul(gate, up):
    return _binary("gelu_mul", gate, up)


def add(a, b):
    return _binary("add", a, b)


def mul(a, b):
    """a * b, elementwise, of one shape."""
    return _binary("mul", a, b)


def mul_rows(x, row):
    """x (..., n_cols) times `row` (n_cols,) broadcast over the rows."""
    out = _empty(x.shape)
    grid, block = _grid1d(x.size)
    _run("elementwise.cu", "mul_rows", grid, block, x, row, out, np.int64(x.size), np.int32(row.size))
    return out


def scale_rows(x, factors):
    """x (n, n_cols), row r times factors[r] (float32, device)."""
    out = _empty(x.shape)
    grid, block = _grid1d(x.size)
    _run("elementwise.cu", "scale_rows", grid, block, x, factors, out, np.int64(x.size), np.int32(x.shape[-1]))
    return out


def scale(x, s: float):
    """x * s (a float32 scalar)."""
    out = _empty(x.shape)
    grid, block = _grid1d(x.size)
    _run("elementwise.cu", "scale", grid, block, x, out, np.int64(x.size), np.float32(s))
    return out


def gelu(x):
    """GELU (tanh approximation) of x, as gelu_mul's gate."""
    out = _empty(x.shape)
    grid, block = _grid1d(x.size)
    _run("elementwise.cu", "gelu", grid, block, x, out, np.int64(x.size))
    return out


def swiglu_oai(gate, up, alpha: float, limit: float):
    out = _empty(gate.shape)
    grid, block = _grid1d(gate.size)
    _run("elementwise.cu", "swiglu_oai", grid, block,
         gate, up, out, np.int64(gate.size), np.float32(alpha), np.float32(limit))
    return out


def add_id(x, bias, ids) -> None:
    """x[m] += bias[ids[m]] for every row m, in place; bias (n_expert, n_cols), ids int32 in VRAM."""
    grid, block = _grid1d(x.size)
    _run("elementwise.cu", "add_id", grid, block, x, bias, ids, np.int64(x.size), np.int32(x.shape[-1]))


def moe_combine(y, slot, weights, n_tok: int, k: int):
    """out[t] = sum_j y[slot[t * k + j]] * weights[t * k + j], j in order -> (n_tok, n_cols)."""
    n_cols = y.shape[-1]
    out = _empty((n_tok, n_cols))
    grid, block = _grid1d(n_tok * n_cols)
    _run("elementwise.cu", "moe_combine", grid, block,
         y, slot, weights, out, np.int64(n_tok * n_cols), np.int32(k), np.int32(n_cols))
    return out


def add_rows(x, bias) -> None:
    """x += bias broadcast over rows, in place."""
    grid, block = _grid1d(x.size)
    _run("elementwise.cu", "add_rows", grid, block, x, bias, np.int64(x.size), np.int32(bias.size))


def kv_store(k, v, k_cache, v_cache, block_table, slots, block_size: int) -> None:
    """k (n, n_kv, hd), v (n, n_kv, hd_v) f32 -> f16 cache rows of the logical `slots` (int32,
    device), each in physical slot block_table[s // block_size] * block_size + s % block_size."""
    n, n_kv, hd = k.shape
    hd_v = v.shape[2]
    _run("attention.cu", "kv_store", (n, n_kv, 1), (128, 1, 1), k, v, k_cache, v_cache, block_table, slots,
         np.int32(n), np.int32(block_size), np.int32(n_kv), np.int32(hd), np.int32(hd_v))


def attention(q, k_cache, v_cache, block_table, kpos, qpos, n_keys, block_size: int, n_kv: int,
              hd_v: int, scale: float, window: int, sinks=None, k_type: str = "f16", v_type: str = "f16",
              qlim=None):
    """q (n, n_head, hd) over the first n_keys logical slots of a paged cache -> (n, n_head, hd_v).

    n_keys is an int32 in VRAM (a step's inputs, never a kernel argument: a graph replays it).

    kpos (int32, device) holds the position of every PHYSICAL slot (n_phys_blocks * block_size,
    stored with the blocks); block_table maps the sequence's logical blocks to physical ones.
    The cache is f16 values, or with a quantized `k_type` / `v_type` rows of raw blocks
    (uint8, (..., n_kv, row bytes)); q then comes rotated as K was (hadamard_rows).

    qlim (int32, device, one a query; default qpos): the last key position each query sees.
    An image's rows (a non-causal image, edgeinfer.vision.image_attention) take the image's
    last position; the sliding window still counts back from qpos."""
    n, n_head, hd = q.shape
    if not attention_supports(hd, hd_v):
        raise ValueError(f"head dim {hd}/{hd_v}: the CUDA attention needs an even head dim <= {MAX_HEAD_DIM}")
    if isinstance(n_keys, (int, np.integer)):  # a direct call (tests): the count uploaded here
        from pycuda import gpuarray

        n_keys = gpuarray.to_gpu(np.array([n_keys], np.int32))
    out = _empty((n, n_head, hd_v))
    args = (q, block_table, kpos, qpos, qpos if qlim is None else qlim,
            out, np.int32(n), n_keys, np.int32(block_size), np.int32(n_head), np.int32(n_kv),
            np.int32(hd), np.int32(hd_v), np.float32(scale), np.int32(window), sinks)
    quant = k_type != "f16" or v_type != "f16"
    caches = (k_cache, v_cache)
    if quant:
        caches += (np.int32(KV_TYPE_CODE[k_type]), np.int32(KV_TYPE_CODE[v_type]),
                   np.int32(k_cache.shape[-1] * k_cache.dtype.itemsize), np.int32(v_cache.shape[-1] * v_cache.dtype.itemsize))
    suffix = "_q" if quant else ""
    if max(hd, hd_v) > FLASH_MAX_HEAD_DIM:  # wide heads: K/V tiles would not fit in shared memory
        _run("attention.cu", f"paged_decode_attention{suffix}_wide", (n_head, n, 1), (128, 1, 1), *caches, *args)
    elif n >= 8 and tensor_cores():  # a prompt: 16 queries a warp on the fp16 tensor cores
        padded = next(p for p in TC_HEAD_DIMS if p >= max(hd, hd_v))
        warps = TC_HEAD_DIMS[padded]
        _run("attention.cu", f"flash_attention_tc{suffix}_{padded}", ((n + 16 * warps - 1) // (16 * warps), n_head, 1),
             (32 * warps, 1, 1), *caches, *args)
    elif n >= 8:  # enough queries per head to share K/V tiles in shared memory
        _run("attention.cu", f"flash_attention_prefill{suffix}", ((n + 7) // 8, n_head, 1), (256, 1, 1), *caches, *args)
    else:
        _run("attention.cu", f"paged_decode_attention{suffix}", (n_head, n, 1), (128, 1, 1), *caches, *args)
    return out


def kv_positions(kpos, block_table, step, n: int, block_size: int) -> None:
    """The positions of a step's n new tokens into the pool's slot positions: `step` (int32, VRAM)
    is [n_keys, logical slot x n, position x n] (edgeinfer.kv.step_fields)."""
    _run("attention.cu", "kv_positions", _grid1d(n, 32)[0], (32, 1, 1), kpos, block_table, step, np.int32(n),
         np.int32(block_size))


def kv_store_quant(x, cache, block_table, slots, block_size: int, kv_type: str, rot: int) -> None:
    """One side's f32 rows x (n, n_kv, hd) -> their logical `slots` of a paged cache of `kv_type`
    (f16 values, or uint8 rows of raw blocks), rotated first by `rot` (0: none)."""
    n, n_kv, hd = x.shape
    if hd > 512 or (kv_type != "f16" and hd % 32):
        raise ValueError(f"head dim {hd}: the K/V store takes at most 512 values, whole 32-value blocks")
    row_bytes = cache.shape[-1] * cache.dtype.itemsize
    _run("kv_quant.cu", "kv_store_quant", (n, n_kv, 1), (32, 1, 1), x, cache, block_table, slots, np.int32(n),
         np.int32(block_size), np.int32(n_kv), np.int32(hd), np.int32(row_bytes), np.int32(KV_TYPE_CODE[kv_type]),
         np.int32(rot))


def hadamard_rows(x, rot: int):
    """Every `rot`-value chunk of x's last axis (at most 512 values) Walsh-Hadamard transformed,
    scaled by 1/sqrt(rot): kernels_cpu/kv_quant.fwht's bits."""
    n = x.shape[-1]
    if n > 512 or n % rot:
        raise ValueError(f"rows of {n} values: the rotation takes at most 512, whole chunks of {rot}")
    out = _empty(x.shape)
    _run("kv_quant.cu", "hadamard_rows", (x.size // n, 1, 1), (32, 1, 1), x, out, np.int32(n), np.int32(rot))
    return out


def copy_rows_between(dst, dst_row: int, src, src_row: int, n: int) -> None:
    """dst[dst_row:dst_row + n] = src[src_row:src_row + n] along the first axis, device to
    device: C-contiguous arrays with rows of one size, so one cuMemcpyDtoD."""
    if n <= 0:
        return
    row = src.nbytes // src.shape[0]
    _dtod(int(dst.ptr) + dst_row * row, int(src.ptr) + src_row * row, n * row)


def copy_rows(cache, src: int, dst: int, n: int) -> None:
    """cache[dst:dst + n] = cache[src:src + n] along the first axis, device to device.

    `cache` is C-contiguous (a flat K/V or position pool: rows of whole slots), so a run of rows
    is one contiguous byte range: one cuMemcpyDtoD, no kernel (copy-on-write of a block)."""
    copy_rows_between(cache, dst, cache, src, n)


# -- gated DeltaNet (recurrent.cu) -------------------------------------------------------------
DELTA_WARPS = 4  # DN_WARPS: state rows a block
DELTA_MAX_S = 256  # DN_MAX_PER_LANE x 32


def delta_net_supports(S: int) -> bool:
    return S % 32 == 0 and S <= DELTA_MAX_S


def delta_rule(q, k, v, g, beta, state, snap_at=None, n_snap: int = 0):
    """The delta rule over n tokens: q, k (n, n_k, S), v (n, n_v, S), g, beta (n, n_v), state
    (n_v, S, S) updated in place; snap_at (int32 token counts 1..n in VRAM) asks for copies of
    the state after them. Returns (out (n, n_v, S), snaps (n_snap, n_v, S, S))."""
    n, n_k, S = q.shape
    n_v = v.shape[1]
    out = _empty((n, n_v, S))
    snaps = _empty((max(n_snap, 1), n_v, S, S))
    _run("recurrent.cu", "gated_delta_net", (n_v, (S + DELTA_WARPS - 1) // DELTA_WARPS, 1), (32 * DELTA_WARPS, 1, 1),
         q, k, v, g, beta, state, out, snaps, snap_at, np.int32(n_snap), np.int32(n), np.int32(n_k), np.int32(n_v),
         np.int32(S))
    return out, snaps


def conv_silu(inp, w_t):
    """silu of the short causal conv: inp (n + K - 1, C) = window ++ x, w_t (K, C) -> (n, C)."""
    K, C = w_t.shape
    n = inp.shape[0] - K + 1
    out = _empty((n, C))
    grid, block = _grid1d(n * C)
    _run("recurrent.cu", "ssm_conv_silu", grid, block, inp, w_t, out, np.int32(n), np.int32(C), np.int32(K))
    return out


def delta_gates(b, a, dt_bias, ssm_a):
    """(beta, g) of the (n, n_v) projections b and a."""
    n, n_v = b.shape
    beta, g = _empty((n, n_v)), _empty((n, n_v))
    grid, block = _grid1d(n * n_v)
    _run("recurrent.cu", "delta_gates", grid, block, b, a, dt_bias, ssm_a, beta, g, np.int32(n), np.int32(n_v))
    return beta, g


def l2_norm_rows(x, eps: float):
    """Each row of the last axis scaled to unit L2 norm as build_gdn_l2_norm does."""
    n = x.shape[-1]
    rows = x.size // n
    out = _empty(x.shape)
    _run("recurrent.cu", "l2_norm_rows", ((rows + 3) // 4, 1, 1), (128, 1, 1), x, out, np.int32(rows), np.int32(n),
         np.float32(eps))
    return out


def qkv_split_norm(xc, n_k: int, n_v: int, S: int, eps: float):
    """The conv's output (n, (2 n_k + n_v) S) -> (q, k L2-normed per head (n, n_k, S), v (n, n_v, S))."""
    n = xc.shape[0]
    q, k, v = _empty((n, n_k, S)), _empty((n, n_k, S)), _empty((n, n_v, S))
    rows = n * (2 * n_k + n_v)
    _run("recurrent.cu", "qkv_split_norm", ((rows + 3) // 4, 1, 1), (128, 1, 1), xc, q, k, v, np.int32(n),
         np.int32(n_k), np.int32(n_v), np.int32(S), np.float32(eps))
    return q, k, v


def sigmoid_mul(x, gate):
    return _binary_in("recurrent.cu", "sigmoid_mul", x, gate)


def _binary_in(source: str, name: str, a, b):
    out = _empty(a.shape)
    grid, block = _grid1d(a.size)
    _run(source, name, grid, block, a, b, out, np.int64(a.size))
    return out
