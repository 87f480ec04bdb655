"""Public entry points: quantized matvec (decode), matmul (prefill), row lookup.

Weights are the raw GGUF bytes, a C-contiguous uint8 (n_rows, row_bytes) array (often a
read-only view into the mmap), or the CPU backend's Q4_K_X8 copy of a Q4_K matrix (type id
quant_kernels.Q4_K_X8, see repack.py), which every entry point here reads as well.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as T

from . import compile_progress
from . import quant_kernels as qk
from .quant_types import QuantInfo, check_weight, quant_info, row_bytes
from .threads import apply_threads, get_threads, worker_pool

from . import bf16_ggml, dispatch, f32_ggml, gemm_kquant, gemm_kquant_wide, gemm_q32, pair_tokens, tile_gemm

# EDGEINFER_PLAIN_KERNELS=1 routes every type through the plain Numba kernels (debugging).
_FAST = not os.environ.get("EDGEINFER_PLAIN_KERNELS")
# EDGEINFER_NO_KQUANT_GEMM=1 sends long K-quant / IQ4_XS prompts to dequantize + BLAS (A/B benchmarks).
_KQUANT_GEMM = _FAST and not os.environ.get("EDGEINFER_NO_KQUANT_GEMM")


def _fast(qt: int) -> bool:
    return _FAST and dispatch.has_fast_path(qt)

_PREFILL_TILE_ROWS = 64        # rows dequantized at once for the BLAS GEMM (measured: 32-64 best)
_INT8_MATMUL_MAX_TOKENS = 64   # up to here the 8-bit row kernels beat dequantize + BLAS (measured)
# From here Q4_K takes gemm_kquant even in decode_order (the same bits as the row kernels).
# Measured with 2 threads on Zen 3, rows against gemm_kquant: 14336 x 4096 at 8 tokens 7.4
# against 7.4 ms, at 12 10.3 against 7.0; 4096 x 14336 at 12 9.5 against 6.3; 640 x 1024
# (gemma3-270m's attn_output) at 12 0.175 against 0.163. The GEMM drivers compile at warm-up,
# so a first short prompt compiles nothing.
_Q4K_GEMM_MIN_TOKENS = 12


def _f32_vec(x: np.ndarray, n: int, what: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != (n,):
        raise ValueError(f"{what} has shape {x.shape}, expected ({n},)")
    return x


def quantize_activations(x: np.ndarray, info: QuantInfo):
    """x (n_cols,) f32 -> (xq int8 (n_cols,), xd f32 per block, xs int32 block sums) as matvec uses them.

    32-blocks (Q8_0 style) for the 32-element weight types: xs = sum of the block.
    256-blocks (Q8_K style) for K-quants / IQ4_XS: xs = sums of each 16 elements (bsums).
    """
    if compile_progress._pending:
        compile_progress.wait_for(qk.quantize_act)
    return qk.quantize_act(x, info.act_block)


def compile_quantize_here(rows: bool) -> None:
    """Compile (or load) the Q8_K row quantizers (rows: quantize_rows_q8_k and the parallel
    one a prompt of PARALLEL_ROWS tokens takes) or quantize_act with the signatures the
    prefill or decode path calls them with (compile_progress's second process)."""
    if rows:
        xq, xd, xs = np.empty((2, 256), np.int8), np.empty((2, 1), np.float32), np.empty((2, 16), np.int32)
        qk.quantize_rows_q8_k(np.zeros((2, 256), np.float32), xq, xd, xs)
        qk.quantize_rows_q8_k_parallel(np.zeros((2, 256), np.float32), xq, xd, xs)
    else:
        qk.quantize_act(np.zeros(256, np.float32), 256)


def _quantize_job(rows: bool) -> str:
    # the package's `matvec` attribute is the function, so the job imports the module by name
    return f"import importlib; importlib.import_module('edgeinfer.kernels_cpu.matvec').compile_quantize_here({rows})"


def compile_quantize_act_first() -> None:
    """On a cold start shared with a second process, compile quantize_act here before the
    forward pass instead (for a model whose pass leaves nothing big for its end)."""
    compile_progress.compile_before(qk.quantize_act, _quantize_job(False))


# a cold start's second process compiles these: the row quantizer first (a K-quant
# model's first matmul needs it; attention comes next), quantize_act last (the decode
# step's, after the FFN's activation)
compile_progress.compile_elsewhere(qk.quantize_rows_q8_k, _quantize_job(True), 0)
compile_progress.compile_elsewhere(qk.quantize_act, _quantize_job(False), 3)


def quantize_activation_rows(X: np.ndarray, info: QuantInfo):
    """X (n_tok, n_cols) f32 -> per-row (xq, xd, xs) stacked: shapes (n_tok, ...) as quantize_activations."""
    n_tok, n = X.shape
    xq = np.empty((n_tok, n), np.int8)
    parallel = n_tok >= qk.PARALLEL_ROWS   # a prompt: its rows on every thread
    if info.act_block == 32:
        xd = np.empty((n_tok, n // 32), np.float32)
        xs = np.empty((n_tok, n // 32), np.int32)
        (qk.quantize_rows_q8_0_parallel if parallel else qk.quantize_rows_q8_0)(X, xq, xd, xs)
    else:
        xd = np.empty((n_tok, n // 256), np.float32)
        xs = np.empty((n_tok, n // 16), np.int32)
        if compile_progress._pending:
            compile_progress.wait_for(qk.quantize_rows_q8_k)
        (qk.quantize_rows_q8_k_parallel if parallel else qk.quantize_rows_q8_k)(X, xq, xd, xs)
    return xq, xd, xs


def matvec(w_raw: np.ndarray, qtype: T, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out (n_rows,) f32 = W @ x; x (n_cols,) f32. The decode path.

    Quantized types quantize x once to 8-bit blocks and use integer block dots, as llama.cpp.
    """
    info = check_weight(w_raw, qtype)
    w_raw = _readonly(w_raw)
    apply_threads()
    n_rows = w_raw.shape[0]
    n_cols = w_raw.shape[1] // info.type_size * info.block_size
    x = _f32_vec(x, n_cols, "x")
    if out is None:
        out = np.empty(n_rows, np.float32)
    elif out.shape != (n_rows,) or out.dtype != np.float32:
        raise ValueError(f"out must be float32 ({n_rows},), got {out.dtype} {out.shape}")
    qt = int(info.qtype)
    if qt == qk.F32:  # ggml's order: a router's choice of experts hangs on these bits
        f32_ggml.matvec(w_raw.view(np.float32), x, out)
        return out
    if qt == qk.F16:
        from .matvec_half_ir import matvec_f16

        matvec_f16(w_raw.view(np.uint16), x, out)
        return out
    if qt == qk.BF16:   # ggml's order, vdpbf16ps where the CPU has it
        bf16_ggml.matvec(w_raw.view(np.uint16), x, out)
        return out
    xq, xd, xs = quantize_activations(x, info)
    if _fast(qt):
        dispatch.matvec_fast(w_raw, qt, xq, xd, xs, out)
    else:
        qk.matvec_q_kernel(w_raw, w_raw.view(np.int8), qt, xq, xd, xs, out, 16, 32)
    return out


def expert_matvec(ws: list[np.ndarray], qtypes: list, experts: np.ndarray, starts: np.ndarray,
                  rows_of: np.ndarray, n_per: int, X: np.ndarray) -> list[np.ndarray]:
    """A mixture-of-experts layer's expert matmul for one or two 3-D expert tensors (ws[i]:
    (n_expert * n_per, row_bytes), the file's bytes): for each active expert experts[e] and
    each of its assignments a in starts[e]..starts[e + 1], out[a] = W_expert @ X[rows_of[a]].
    Returns [(n_assignments, n_per)] per tensor. One parallel region for all of them where
    the types have the fast kernels; each row the same bits as `matvec` of that token."""
    experts = np.ascontiguousarray(experts, dtype=np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    rows_of = np.ascontiguousarray(rows_of, dtype=np.int64)
    X = np.ascontiguousarray(X, dtype=np.float32)
    infos = [check_weight(w, qt) for w, qt in zip(ws, qtypes)]
    outs = [np.empty((rows_of.shape[0], n_per), np.float32) for _ in ws]
    fast = (1 <= len(ws) <= 2 and all(_fast(int(i.qtype)) for i in infos)
            and len({i.act_block for i in infos}) == 1)
    if not fast:
        for w, qt, out in zip(ws, qtypes, outs):
            for i, e in enumerate(experts):
                for a in range(starts[i], starts[i + 1]):
                    matvec(w[e * n_per:(e + 1) * n_per], qt, X[rows_of[a]], out[a])
        return outs
    apply_threads()
    ws = [_readonly(w) for w in ws]
    qts = [int(i.qtype) for i in infos]
    counts = np.diff(starts)
    path = _expert_gemm_path(qts, n_per, X.shape[0])
    big = counts >= _GEMM_MIN_TOKENS[qts[0]] if path else np.zeros(len(experts), bool)
    if big.any():
        _expert_gemm(path, ws, qts, infos[0], experts[big], starts[:-1][big], counts[big], rows_of, n_per, X, outs)
    if big.all():
        return outs
    if big.any():   # the experts with few tokens: the row kernels on their assignments alone
        keep = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in np.flatnonzero(~big)])
        sub = [np.empty((keep.shape[0], n_per), np.float32) for _ in ws]
        sub_starts = np.concatenate([[0], np.cumsum(counts[~big])])
        _expert_rows(ws, qts, infos[0], experts[~big], sub_starts, rows_of[keep], n_per, X, sub)
        for out, part in zip(outs, sub):
            out[keep] = part
        return outs
    _expert_rows(ws, qts, infos[0], experts, starts, rows_of, n_per, X, outs)
    return outs


def _expert_rows(ws, qts, info, experts, starts, rows_of, n_per, X, outs) -> None:
    """The row kernels on every listed expert's assignments (matvec's bits), one parallel region."""
    xq, xd, xs = quantize_activation_rows(X, info)
    dispatch.expert_matvec_fast(ws, qts, experts, starts, rows_of, n_per, xq, xd, xs, outs)


def _expert_gemm_path(qts: list, n_per: int, n_tok: int) -> str | None:
    """The GEMM ("kquant" or "q32") every tensor of an expert matmul can take on a prompt
    chunk of n_tok tokens, or None (a decoded token, decode_order, a mixed pair, a CPU
    with other kernels for long prompts)."""
    if n_tok < 2 or _in_decode_order():
        return None
    paths = {matmul_path(qt, n_per, _INT8_MATMUL_MAX_TOKENS + 1) for qt in qts}
    path = paths.pop() if len(paths) == 1 else None
    return path if path in ("kquant", "q32") else None


def _expert_gemm(path, ws, qts, info, experts, firsts, counts, rows_of, n_per, X, outs) -> None:
    """Each listed expert's tokens as one batch through the GEMM: its slab of every tensor
    read once per 256 of its tokens. X is quantized once, the experts' token rows packed
    once, and every expert runs in one parallel region."""
    gemm = gemm_kquant if path == "kquant" else gemm_q32
    xq, xd, xs = quantize_activation_rows(X, info)
    # the listed experts' assignments, expert after expert
    ends = np.cumsum(counts)
    assigned = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(firsts - (ends - counts), counts)
    rows = rows_of[assigned]
    packed, seg = gemm.pack_segments(xq[rows], xd[rows], xs[rows], counts)
    driver = gemm.DRIVERS.for_types(qts)
    if compile_progress._pending:
        compile_progress.wait_for(driver.expert_kernel)
    driver.run_experts(ws, qts, experts, seg, firsts, counts, n_per, packed, outs, get_threads())


def matvec_many(ws: list[np.ndarray], qtypes: list, x: np.ndarray) -> list[np.ndarray]:
    """[W @ x for W in ws] for matrices with the same column count: x is quantized once
    when their types share an activation format, and the rows of all of them run in one
    parallel region (fewer thread launches per decoded token). Same results as matvec."""
    group = prepare_group(ws, qtypes) if len(ws) in (2, 3) else None
    if group is None:
        return [matvec(w, qt, x) for w, qt in zip(ws, qtypes)]
    return matvec_prepared(group, _f32_vec(x, group[0].n_cols, "x"))


class PreparedWeight(NamedTuple):
    """A weight validated once for `matvec_prepared`."""
    w: np.ndarray       # read-only raw blocks (n_rows, row_bytes)
    qt: int             # GGML type id
    info: QuantInfo
    n_cols: int


def prepare_weight(w_raw: np.ndarray, qtype) -> PreparedWeight | None:
    """Validate a weight once for `matvec_prepared`, or None for a type without the 8-bit
    fast path (use `matvec` for those)."""
    info = check_weight(w_raw, qtype)
    qt = int(info.qtype)
    n_cols = w_raw.shape[1] // info.type_size * info.block_size
    return PreparedWeight(_readonly(w_raw), qt, info, n_cols) if _fast(qt) else None


def prepare_group(ws: list[np.ndarray], qtypes: list) -> list[PreparedWeight] | None:
    """prepare_weight for matrices that take the same quantized activations, or None where
    one lacks the fast path or their activation formats differ (then: `matvec` each)."""
    group = [prepare_weight(w, qt) for w, qt in zip(ws, qtypes)]
    if any(p is None for p in group) or len({p.info.act_block for p in group}) != 1:
        return None
    if len({p.n_cols for p in group}) != 1:
        raise ValueError("matvec_many needs matrices with the same number of columns")
    return group


def matvec_prepared(prepared: list[PreparedWeight], x: np.ndarray) -> list[np.ndarray]:
    """[W @ x for each prepared weight], x float32 C-contiguous (n_cols,): the decode path
    without per-call validation (~6 us a call, hundreds of calls a token). The matrices
    must share the column count and activation format (prepare_group checks); 2-3 of them
    run in one parallel region."""
    n_cols = prepared[0].n_cols
    if x.dtype != np.float32 or x.shape != (n_cols,) or not x.flags.c_contiguous:
        raise ValueError(f"x must be C-contiguous float32 ({n_cols},), got {x.dtype} {x.shape}")
    apply_threads()
    xq, xd, xs = quantize_activations(x, prepared[0].info)
    outs = [np.empty(p.w.shape[0], np.float32) for p in prepared]
    if len(prepared) == 1:
        dispatch.matvec_fast(prepared[0].w, prepared[0].qt, xq, xd, xs, outs[0])
    else:
        dispatch.matvec_fast_many([p.w for p in prepared], [p.qt for p in prepared], xq, xd, xs, outs)
    return outs


def dequantize_rows(w_raw: np.ndarray, qtype: T, n_cols: int, start: int, stop: int,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Rows start..stop-1 as float32 (stop - start, n_cols)."""
    info = check_weight(w_raw, qtype)
    w_raw = _readonly(w_raw)
    apply_threads()
    _check_cols(w_raw, info, n_cols)
    if not 0 <= start <= stop <= w_raw.shape[0]:
        raise IndexError(f"row range {start}:{stop} outside 0:{w_raw.shape[0]}")
    if out is None:
        out = np.empty((stop - start, n_cols), np.float32)
    elif out.shape != (stop - start, n_cols) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 ({stop - start}, {n_cols})")
    if info.qtype == T.F32:
        out[...] = w_raw[start:stop].view(np.float32)
    else:
        _dequant_into(w_raw, int(info.qtype), start, out)
    return out


def get_rows(w_raw: np.ndarray, qtype: T, n_cols: int, ids) -> np.ndarray:
    """Embedding lookup: float32 (len(ids), n_cols), dequantizing only the rows asked for."""
    info = check_weight(w_raw, qtype)
    w_raw = _readonly(w_raw)
    apply_threads()
    _check_cols(w_raw, info, n_cols)
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w_raw.shape[0]):
        raise IndexError(f"row id outside 0:{w_raw.shape[0]}")
    out = np.empty((ids.shape[0], n_cols), np.float32)
    if info.qtype == T.F32:
        out[...] = w_raw.view(np.float32)[ids]
    else:
        _dequant_rows_into(w_raw, int(info.qtype), ids, out)
    return out


# ----------------------------------------------------------------------------- prefill routing
# Which kernel serves a matmul of n tokens (matmul_path), on an AVX2 CPU (VNNI: see below):
# - "rows": the decode row kernels, token by token on each row chunk (matvec's bits);
# - "kquant": gemm_kquant (gemm_kquant.GEMM_TYPES: Q2_K-Q6_K, IQ4_XS): for Q4_K also matvec's bits;
# - "q32": gemm_q32 (gemm_q32.GEMM_TYPES: the 32-element block types and MXFP4);
# - "blas": dequantized float tiles and BLAS; "tiles": the VNNI tiles (VNNI CPUs).
# The crossovers were measured on Zen 3 with 2 threads (benchmarks/bench_kernels.py
# --batch --paths): the GEMMs stage each 8-row block once for every token, which pays
# from a few tokens (_GEMM_MIN_TOKENS: Q5_0 2048 x 640 at 4 tokens 0.30 ms against 0.37
# for rows, at 16 0.40 against 1.05; Q6_K 640 x 2048 at 8 0.32 against 0.32, at 12 0.36
# against 0.45; 2048 x 8192 at 8 2.1 against 3.1) and beats
# BLAS on long prompts (512 tokens: Q5_0 9.7 against 12.6 ms, Q4_0 2048 x 2048 18 against
# 37, MXFP4 2880 x 2880 42 against 90). Q2_K, Q3_K and IQ4_XS on 8192 x 2048 and 2048 x 8192:
# about even at 4 tokens, the GEMM 1.2-3.3x faster at 8, 2.0-2.6x faster than BLAS at 512.
# On VNNI CPUs the same GEMMs serve short batches (measured on an AVX-512 VNNI Xeon, 2
# threads, against the row kernels: Q4_K_X8 2048 x 2048 at 16 tokens 0.52 against 0.63 ms,
# at 64 1.82 against 2.35; Q6_K 2048 x 8192 at 8 1.20 against 1.95, at 64 7.3 against 15.2;
# Q5_0 2048 x 640 at 16 0.23 against 0.45), and long prompts of the K-quants too, where they
# beat the VNNI tiles (512 tokens: Q6_K 2048 x 8192 55 against 80 ms, 640 x 2048 6.3 against
# 8.0, Q4_K_X8 2048 x 2048 13.2 against 14.8); the 32-element types keep the tiles there
# (Q5_0 2048 x 640 5.39 against 5.41 for q32, Q8_0 256 x 640 1.46 against 1.51).
_KQUANT_OVER_TILES = (qk.Q4_K, qk.Q4_K_X8, qk.Q6_K)
_GEMM_OVER_TILES = _KQUANT_OVER_TILES   # long prompts of these types take their GEMM over the tiles
# Speculative verification needs every row to be what decoding that token alone would
# give: inside `decode_order()` the short batches keep to the paths with matvec's bits.
# q32 and kquant from this many tokens (outside decode_order). Q8_0 keeps the row kernels
# up to _INT8_MATMUL_MAX_TOKENS: they gain little there (16 tokens on 2048 x 2048: 1.9 ms
# rows, 1.6 q32), and llama.cpp's own batches of Q8_0 have exactly the row kernels' bits.
_GEMM_MIN_TOKENS = {qk.Q5_0: 4, qk.Q4_0: 8, qk.MXFP4: 8, qk.Q8_0: 65, qk.Q6_K: 12, qk.Q4_K: 12, qk.Q4_K_X8: 12, qk.Q5_K: 12,
                    qk.Q4_1: 8, qk.Q5_1: 8, qk.IQ4_NL: 8,   # these three: as Q4_0's, not measured apart
                    qk.Q3_K: 8, qk.Q2_K: 8, qk.IQ4_XS: 8,
                    # the i-quants' row kernels are bound by their grid lookups, a token at a time
                    qk.IQ2_XXS: 8, qk.IQ2_XS: 8, qk.IQ2_S: 8, qk.IQ3_XXS: 8, qk.IQ3_S: 8}
if gemm_kquant_wide.enabled():
    # the 32-row kernels (AVX512-VNNI Xeon, 2 threads, rows against kquant): Q4_K_X8 at 8
    # tokens 640 x 1024 0.084 against 0.076 ms, 2048 x 2048 0.32 against 0.27, 2048 x 8192
    # 1.17 against 0.94; at 6 within 5% either way
    _Q4K_GEMM_MIN_TOKENS = 8
    # Q6_K keeps 12 (its rows prefetch on these hosts since; rows against kquant, 2 threads:
    # 640 x 2048 at 4 tokens 0.060 against 0.106 ms, at 8 0.118 against 0.153, at 12 0.171
    # against 0.173; 2048 x 8192 at 8 1.09 against 1.16, at 12 1.58 against 1.40)
    # gemm_q32_wide from 4 tokens (rows against q32): Q4_0 2048 x 2048 0.32 against 0.20 ms,
    # Q4_1 0.52 against 0.24, MXFP4 2880 x 2880 0.74 against 0.48 (Q8_0 keeps llama.cpp's
    # row bits up to _INT8_MATMUL_MAX_TOKENS: 2048 x 2048 at 16 tokens 1.31 against 0.50)
    _GEMM_MIN_TOKENS.update({qt: 4 for qt in (qk.Q4_0, qk.Q4_1, qk.Q5_1, qk.IQ4_NL, qk.MXFP4)})
    # and long prompts, over the VNNI tiles (512 tokens): Q5_0 2048 x 640 3.4 against 5.7 ms,
    # Q4_0 2048 x 2048 8.9 against 12.6, Q8_0 256 x 640 0.99 against 1.45, MXFP4 2880 x 2880
    # 17.2 against 22.3
    _GEMM_OVER_TILES = _GEMM_OVER_TILES + tuple(gemm_q32.GEMM_TYPES)
_Q32_GEMM = _FAST and not os.environ.get("EDGEINFER_NO_Q32_GEMM")
# short batches of the 32-element types two tokens a 512-bit vector (pair_tokens.py)
# where the CPU has 512-bit VNNI; EDGEINFER_NO_PAIRS=1 keeps them on the row kernels (A/B)
_PAIRS = _FAST and pair_tokens.host_has_pairs() and not os.environ.get("EDGEINFER_NO_PAIRS")
# matrices on the same tokens that split between gemm_q32 and the rows (Gemma 3's Q5_0 Q
# and K, Q8_0 V) take the pairs together up to here: one region, not three calls (AVX-512
# VNNI Xeon, 2 threads, Q 1024 x 640, K and V 256 x 640: at 4 tokens 0.115 -> 0.075 ms,
# 8 0.148 -> 0.122, 12 0.188 -> 0.164, 16 0.205 -> 0.197)
_PAIRS_MIXED_MAX_TOKENS = 16
_ORDER = threading.local()


@contextlib.contextmanager
def decode_order():
    """Within this block (on this thread), a matmul gives each token exactly matvec's numbers
    (speculative verification; an encoder's Q8_0 products in ggml's order): batches past
    _INT8_MATMUL_MAX_TOKENS go through the row kernels that many tokens at a time."""
    before = getattr(_ORDER, "on", False)
    _ORDER.on = True
    try:
        yield
    finally:
        _ORDER.on = before


def _in_decode_order() -> bool:
    return getattr(_ORDER, "on", False)


def matmul_path(qtype, n_rows: int, n_tokens: int) -> str:
    """The kernel matmul takes for this matrix and token count (see above)."""
    qt = int(qtype)
    if qt == qk.F32:
        return "f32"
    if qt == qk.BF16:
        return "bf16"
    if not _fast(qt):
        return "blas"
    short = n_tokens <= _INT8_MATMUL_MAX_TOKENS
    exact = short and _in_decode_order()
    avx2_gemms = gemm_kquant.host_has_avx2() and n_rows % 8 == 0
    if not short and _uses_tiles(qt) and qt not in _GEMM_OVER_TILES:
        return "tiles"
    if avx2_gemms and _KQUANT_GEMM and qt in gemm_kquant.GEMM_TYPES:
        if qt in (qk.Q4_K, qk.Q4_K_X8) and n_tokens >= _Q4K_GEMM_MIN_TOKENS:   # matvec's bits
            return "kquant"
        if not short or (not exact and n_tokens >= _GEMM_MIN_TOKENS[qt]):
            return "kquant"
    if (avx2_gemms and _Q32_GEMM and qt in gemm_q32.GEMM_TYPES
            and (not short or (not exact and n_tokens >= _GEMM_MIN_TOKENS[qt]))):
        return "q32"
    if short:
        return "rows"
    return "tiles" if _uses_tiles(qt) else "blas"


def matmul_uses_int8(qtype: T, n_tokens: int, n_rows: int) -> bool:
    """Whether matmul takes an 8-bit activation path (else dequantized tiles + BLAS)."""
    return matmul_path(qtype, n_rows, n_tokens) in ("rows", "kquant", "q32", "tiles")


def matmul_uses_rows(qtype: T, n_tokens: int, n_rows: int) -> bool:
    """Whether matmul's results equal matvec's token by token: the decode row kernels, or
    for Q4_K gemm_kquant, which keeps their bits."""
    path = matmul_path(qtype, n_rows, n_tokens)
    return path == "rows" or (path == "kquant" and int(qtype) in (qk.Q4_K, qk.Q4_K_X8))


def _kquant_gemm_for(qtype, n_rows: int, n_tokens: int) -> bool:
    """Whether matmul takes gemm_kquant for this call."""
    return matmul_path(qtype, n_rows, n_tokens) == "kquant"


def _uses_tiles(qt: int) -> bool:
    """Long prompts of these types take the 8-bit tile kernels (VNNI CPUs only: elsewhere
    the float BLAS GEMM is faster)."""
    return _FAST and qt in tile_gemm.TILE_LAYOUTS and tile_gemm.has_vnni()


def _run_pieces(pieces: list, run_piece) -> None:
    """run_piece(*piece) for every piece, on the worker threads: each takes the next piece
    in turn, as the decode matvecs claim rows, so a core slowed by another process takes
    fewer."""
    n_threads = get_threads()
    todo = queue.SimpleQueue()
    for p in pieces:
        todo.put(p)

    def run(_):
        while True:
            try:
                p = todo.get_nowait()
            except queue.Empty:
                return
            run_piece(*p)
    if n_threads == 1:
        run(0)
    else:
        list(worker_pool(n_threads).map(run, range(n_threads)))


def _split(n: int, total: int, step: int):
    """Pieces [a, b) of range(n) in multiples of `step`: about CLAIMS_PER_THREAD a thread,
    sized by `total` (the row count of every matrix of the call)."""
    size = max(step, total // (dispatch.CLAIMS_PER_THREAD * get_threads()) // step * step)
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def matmul_many(ws: list[np.ndarray], qtypes: list, X: np.ndarray, outs: list | None = None) -> list[np.ndarray]:
    """[matmul(w, qt, X) for w, qt in zip(ws, qtypes)] for matrices on the same input
    (Q/K/V, gate/up). Where every one takes the same 8-bit GEMM (the VNNI tiles,
    gemm_kquant or gemm_q32), the row kernels two tokens a vector (pair_tokens), or the
    row kernels on one activation format, X is quantized (and packed) once and the rows of
    all of them are shared out in one batch."""
    infos = [check_weight(w, qt) for w, qt in zip(ws, qtypes)]
    qts = [int(info.qtype) for info in infos]
    paths = {matmul_path(qt, w.shape[0], X.shape[0]) for qt, w in zip(qts, ws)}
    path = paths.pop() if len(paths) == 1 else None
    n_tok = X.shape[0]
    if _takes_pairs(qts, n_tok) and (path == "rows" or (path is None and n_tok <= _PAIRS_MIXED_MAX_TOKENS)):
        path = "pairs"   # quantized and packed once, the matrices in one parallel region
    if path == "rows" and len({info.act_block for info in infos}) > 1:
        path = None   # Q8_0 and Q8_K activations: matrix by matrix
    if path not in ("tiles", "kquant", "q32", "pairs", "rows") or len(ws) > 3:
        return [matmul(w, qt, X) for w, qt in zip(ws, qtypes)]
    ws = [_readonly(w) for w in ws]
    X = np.ascontiguousarray(X, dtype=np.float32)
    for w, info in zip(ws, infos):
        n_cols = w.shape[1] // info.type_size * info.block_size
        if X.ndim != 2 or X.shape[1] != n_cols:
            raise ValueError(f"X has shape {X.shape}, expected (n_tokens, {n_cols})")
    if outs is None:
        outs = [np.empty((X.shape[0], w.shape[0]), np.float32) for w in ws]
    apply_threads()
    if path == "tiles":
        total = sum(w.shape[0] for w in ws)
        packed = tile_gemm.pack_activations(X)
        pieces = [(w, qt, a, b, out) for w, qt, out in zip(ws, qts, outs)
                  for a, b in _split(w.shape[0], total, tile_gemm.TILE_ROWS)]
        _run_pieces(pieces, lambda w, qt, a, b, out: tile_gemm.matmul_rows(w, qt, a, b, packed, out))
    elif path == "pairs":
        xq, xd, _ = quantize_activation_rows(X, infos[0])
        dispatch.matmul_pairs(ws, qts, xq, xd, outs)
    elif path == "rows":   # quantized once, the matrices' rows in one parallel region
        dispatch.matmul_int_many(ws, qts, *quantize_activation_rows(X, infos[0]), outs)
    else:
        gemm = gemm_kquant if path == "kquant" else gemm_q32
        packed = gemm.pack_activations(*quantize_activation_rows(X, infos[0]))
        _wait_compiled(gemm, qts)
        gemm.DRIVERS.run(ws, qts, packed, outs, get_threads())
    return outs


def _takes_pairs(qts, n_tok: int) -> bool:
    """Whether the row kernels' short batch of these types runs two tokens a vector here."""
    return _PAIRS and n_tok >= 2 and all(map(pair_tokens.serves, qts))


def _wait_compiled(gemm, qts) -> None:
    """Nothing to wait for unless a background compile owes this process the GEMM's kernel."""
    if compile_progress._pending:
        compile_progress.wait_for(gemm.DRIVERS.for_types(qts).kernel)


def matmul(w_raw: np.ndarray, qtype: T, X: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out (n_tokens, n_rows) f32 = X @ W.T; X (n_tokens, n_cols) f32. The prefill path.

    Up to _INT8_MATMUL_MAX_TOKENS tokens, fast-path types quantize each token to 8 bits and
    use the decode row kernels (each weight row read once for all tokens; llama.cpp's
    numerics). Longer prompts take 8-bit kernels where there are some: gemm_kquant and gemm_q32
    (32 rows a step with 512-bit VNNI), or with 256-bit VNNI only the VNNI tiles for the
    32-element types (tile_gemm). Otherwise tiles
    of rows are dequantized into a small float32 buffer and multiplied with BLAS (numpy's
    OpenBLAS).
    """
    info = check_weight(w_raw, qtype)
    w_raw = _readonly(w_raw)
    apply_threads()
    n_rows = w_raw.shape[0]
    n_cols = w_raw.shape[1] // info.type_size * info.block_size
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != n_cols:
        raise ValueError(f"X has shape {X.shape}, expected (n_tokens, {n_cols})")
    n_tok = X.shape[0]
    if out is None:
        out = np.empty((n_tok, n_rows), np.float32)
    elif out.shape != (n_tok, n_rows) or out.dtype != np.float32:
        raise ValueError(f"out must be float32 ({n_tok}, {n_rows}), got {out.dtype} {out.shape}")
    qt = int(info.qtype)
    if n_tok > _INT8_MATMUL_MAX_TOKENS and _in_decode_order():
        for lo in range(0, n_tok, _INT8_MATMUL_MAX_TOKENS):
            hi = lo + _INT8_MATMUL_MAX_TOKENS
            matmul(w_raw, qtype, X[lo:hi], out[lo:hi])
        return out
    path = matmul_path(qt, n_rows, n_tok)
    if path in ("f32", "bf16", "blas") and n_tok <= _INT8_MATMUL_MAX_TOKENS and _in_decode_order():
        # float weights (a router, a tensor the file keeps in F16) sum in another order for
        # a batch (tinyBLAS, BLAS) than for one token: here each row is matvec's
        for t in range(n_tok):
            matvec(w_raw, qt, X[t], out[t])
        return out
    if path == "f32":
        f32_ggml.matmul(w_raw.view(np.float32), np.ascontiguousarray(X, np.float32), out)
        return out
    if path == "bf16":
        bf16_ggml.matmul(w_raw.view(np.uint16), X, out)
        return out
    if path in ("kquant", "q32", "tiles"):
        matmul_many([w_raw], [qt], X, [out])
        return out
    if path == "rows":
        xq, xd, xs = quantize_activation_rows(X, info)
        if _takes_pairs([qt], n_tok):
            dispatch.matmul_pairs([w_raw], [qt], xq, xd, [out])
        else:
            dispatch.matmul_int(w_raw, qt, xq, xd, xs, out)
        return out
    n_threads = get_threads()
    if _serial_tiles(qt, n_rows):
        # numpy's BLAS runs single-threaded beside Numba (see edgeinfer.backends.cpu), so the row tiles
        # are split across our own threads: each dequantizes its tiles on its own thread
        # (no Numba parallel region) and calls BLAS, both without the GIL.
        bounds = np.linspace(0, n_rows // _PREFILL_TILE_ROWS, n_threads + 1).astype(int) * _PREFILL_TILE_ROWS
        bounds[-1] = n_rows
        jobs = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        list(worker_pool(n_threads).map(lambda ab: _tiled_gemm(X, w_raw, qt, ab[0], ab[1], out, True), jobs))
    else:
        _tiled_gemm(X, w_raw, qt, 0, n_rows, out, False)
    return out


def _serial_tiles(qt: int, n_rows: int) -> bool:
    """Whether matmul's BLAS path dequantizes its row tiles on each worker thread (else in
    one parallel region)."""
    return get_threads() > 1 and (_fast(qt) or qt == qk.F16) and n_rows >= 2 * _PREFILL_TILE_ROWS


def _tiled_gemm(X: np.ndarray, w_raw: np.ndarray, qt: int, r0: int, r1: int, out: np.ndarray,
                serial: bool) -> None:
    """out[:, r0:r1] = X @ W[r0:r1].T through float32 tiles of _PREFILL_TILE_ROWS rows."""
    tile = np.empty((min(_PREFILL_TILE_ROWS, r1 - r0), X.shape[1]), np.float32)
    for a in range(r0, r1, _PREFILL_TILE_ROWS):
        b = min(a + _PREFILL_TILE_ROWS, r1)
        t = tile[: b - a]
        if serial and qt == qk.F16:
            _f16_rows_serial(w_raw, a, t)
        elif serial:
            dispatch.dequantize_fast_serial(w_raw, qt, a, t)
        else:
            _dequant_into(w_raw, qt, a, t)
        # Into a fresh contiguous block: numpy only calls BLAS when `out` is contiguous,
        # and a column slice of `out` is not (that fallback ran ~10x slower).
        out[:, a:b] = X @ t.T


def _f16_rows_serial(w_raw: np.ndarray, start: int, out: np.ndarray) -> None:
    """out[i] = F16 row start + i as float32 on this thread (numpy's cast releases the GIL;
    BF16 takes bf16_ggml, never these tiles)."""
    out[...] = w_raw[start:start + out.shape[0]].view(np.float16)


def _dequant_into(w_raw: np.ndarray, qt: int, start: int, out: np.ndarray) -> None:
    """out[i] = row start + i as float32 (fast IR kernel where there is one)."""
    if _fast(qt):
        dispatch.dequantize_fast(w_raw, qt, start, out)
    else:
        _dequant_rows_into(w_raw, qt, np.arange(start, start + out.shape[0]), out)


def _dequant_rows_into(w_raw: np.ndarray, qt: int, ids: np.ndarray, out: np.ndarray) -> None:
    """out[i] = row ids[i] as float32: fast IR kernel, small F16/BF16 kernel, or the plain one."""
    if _fast(qt):
        dispatch.dequantize_rows_fast(w_raw, qt, ids, out)
    elif _FAST and qt in (qk.F16, qk.BF16):
        qk.dequantize_half_rows_kernel(w_raw.view(np.uint16), qt == qk.BF16, ids, out)
    else:
        qk.dequantize_rows_kernel(w_raw, w_raw.view(np.int8), qt, ids, out)


def _readonly(w_raw: np.ndarray) -> np.ndarray:
    """A read-only view: Numba then compiles one specialization whether the caller's array
    is an mmap view (read-only) or a writable copy."""
    if not w_raw.flags.writeable:
        return w_raw
    v = w_raw.view()
    v.flags.writeable = False
    return v


def _check_cols(w_raw: np.ndarray, info: QuantInfo, n_cols: int) -> None:
    have = w_raw.shape[1] // info.type_size * info.block_size
    if have != n_cols:
        raise ValueError(f"n_cols={n_cols} but the rows hold {have} {info.qtype.name} elements")
