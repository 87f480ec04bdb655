"""Float32 matrices in ggml's summation order: a mixture of experts' router picks its experts
from these dot products, and a last-bit difference there can pick another expert.

- Decode (one token): ggml_vec_dot_f32. GGML_F32_STEP (4 vectors of `lanes`) fused
  multiply-adds per step, the 4 accumulators reduced lane-wise as (0 + 2) + (1 + 3), then
  across lanes (AVX2: 128-bit halves, then hadd twice; AVX-512: _mm512_reduce_add_ps), the
  tail (n % STEP) added one product at a time as GCC compiled it: products of whole vectors
  (then half a vector) rounded before their adds, the last few fused (`_tail`).
- Prompts (two tokens or more): llamafile's tinyBLAS sgemm, which ggml calls for F32 x F32
  with n >= 2 where k is a multiple of `lanes` and the rows of 4: one vector accumulator
  of `lanes` per output over k, then its horizontal sum; else vec_dot_f32 per token.
`lanes` is 16 where the CPU has AVX-512 (ggml's build for it), else 8. The kernels compile
with LLVM's `contract` only (no reassociation): a * b + c becomes one fused multiply-add, as
GGML_F32_VEC_FMA is, and every sum keeps the order written here; the lanes are independent
chains, so LLVM still vectorises them.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from edgeinfer.kernels_cpu.ggml_math import hsum16, unfused
from edgeinfer.kernels_cpu.f16 import has_f16c
from edgeinfer.kernels_cpu.ir_helpers import (F32T, I16, IRHelpers, c64, counted_loop, row_ptrs,
                                              target_features, vec)

_JIT = dict(cache=True, nogil=True, fastmath={"contract"})


@functools.cache
def host_lanes() -> int:
    """float32 lanes of ggml's vectors on this CPU: 16 with AVX-512, else 8."""
    return 16 if "+avx512f" in target_features(cpu_target.target_context) else 8


@njit(inline="always", **_JIT)
def _hsum(v, lanes):
    """The horizontal sum of one vector: _mm512_reduce_add_ps, or AVX's two halves then hadd."""
    if lanes == 16:
        return hsum16(v, 0)
    t = np.empty(4, np.float32)
    for i in range(4):
        t[i] = v[i] + v[i + 4]
    return np.float32((t[0] + t[1]) + (t[2] + t[3]))


@njit(inline="always", **_JIT)
def _tail(wr, x, body, n, lanes, s):
    """ggml_vec_dot_f32's leftovers (sumf += x[i]*y[i]) as GCC compiled them in llama.cpp's
    builds: the products of whole vectors (lanes, then one half vector) rounded on their
    own and added one by one in order, the last few (< lanes / 2) fused multiply-adds."""
    left = n - body
    plain = body + left // lanes * lanes
    if left % lanes >= lanes // 2:
        plain += lanes // 2
    for k in range(body, plain):
        s += unfused(wr[k] * x[k])
    for k in range(plain, n):
        s += wr[k] * x[k]
    return s


@njit(inline="always", **_JIT)
def vec_dot_f32(wr, x, lanes, acc, red):
    """ggml_vec_dot_f32(wr, x): 4 vectors of `lanes` fused multiply-adds a step, reduced as
    (0 + 2) + (1 + 3) lane-wise, then across lanes, then the tail (_tail). acc (4 * lanes)
    and red (lanes): float32 scratch the caller keeps (no allocation a dot)."""
    n = x.shape[0]
    step = 4 * lanes
    body = n - n % step
    acc[:] = 0.0   # accumulator j's lane l is acc[j * lanes + l]
    for i in range(0, body, step):
        wi, xi = wr[i:i + step], x[i:i + step]
        for q in range(step):  # independent chains: vectorised, each one fma a step
            acc[q] += wi[q] * xi[q]
    for l in range(lanes):
        red[l] = (acc[l] + acc[2 * lanes + l]) + (acc[lanes + l] + acc[3 * lanes + l])
    return _tail(wr, x, body, n, lanes, _hsum(red, lanes))


@njit(parallel=True, **_JIT)
def vec_dot_rows(w, x, out, lanes):
    """out[r] = ggml_vec_dot_f32(w[r], x) for every row; w (n_rows, n) float32."""
    for r in prange(w.shape[0]):
        acc, red = np.empty(4 * lanes, np.float32), np.empty(lanes, np.float32)
        out[r] = vec_dot_f32(w[r], x, lanes, acc, red)


@njit(parallel=True, **_JIT)
def vec_dot_tokens(w, X, out, lanes):
    """out[t, r] = ggml_vec_dot_f32(w[r], X[t]): ggml's per-output fallback, tokens on the threads."""
    for t in prange(X.shape[0]):
        acc, red = np.empty(4 * lanes, np.float32), np.empty(lanes, np.float32)
        x = X[t]
        for r in range(w.shape[0]):
            out[t, r] = vec_dot_f32(w[r], x, lanes, acc, red)


def _make_vec_dot_f16_tokens(lanes: int):
    step = 4 * lanes   # a compile-time constant: the chains unroll into registers

    @njit(parallel=True, **_JIT)
    def kernel(w, X, out):
        n_tok, n = X.shape
        body = n - n % step
        for t in prange(n_tok):
            x = X[t]
            for r in range(w.shape[0]):
                wr = w[r]
                acc = np.zeros(step, np.float32)
                for i in range(0, body, step):
                    for q in range(step):  # independent chains: one fma each a step
                        acc[q] += wr[i + q] * x[i + q]
                red = np.empty(lanes, np.float32)
                for l in range(lanes):
                    red[l] = (acc[l] + acc[2 * lanes + l]) + (acc[lanes + l] + acc[3 * lanes + l])
                total = np.float64(_hsum(red, lanes))
                for k in range(body, n):
                    total += np.float64(np.float32(wr[k] * x[k]))
                out[t, r] = np.float32(total)
    return kernel


_VEC_DOT_F16 = {}


def vec_dot_f16_tokens(w: np.ndarray, X: np.ndarray, out: np.ndarray, lanes: int) -> np.ndarray:
    """out[t, r] = ggml_vec_dot_f16(w[r], X[t]) for F16 values held in float32: vec_dot_rows's
    steps and reduction, the leftovers past the last full step summed in double. Tokens on
    the threads (a convolution's patches: thousands of them, each against every row)."""
    kernel = _VEC_DOT_F16.get(lanes)
    if kernel is None:
        kernel = _VEC_DOT_F16[lanes] = _make_vec_dot_f16_tokens(lanes)
    kernel(w, X, out)
    return out


# tinyBLAS's tiles: 4 rows x 6 tokens of accumulators with 32 vector registers (AVX-512),
# 4 x 3 with 16. The tiling does not change a result's order (each output is one chain),
# only how many chains share each loaded vector.
TILE_ROWS = 4
TOKEN_BLOCK = 96   # tokens whose rows stay in cache while every row group passes over them


def tile_tokens(lanes: int) -> int:
    return 6 if lanes == 16 else 3


def _tile_codegen(lanes, rn, half):
    """out[t0 + j, r0 + i] for i < TILE_ROWS, j < rn: one `lanes`-wide fused multiply-add
    chain an output over k (w's row, X's token row), then the horizontal sum as tinyBLAS's
    hsum (halves added down to one: ggml_math.hsum8 / hsum16). half: w holds F16 bits
    (uint16), widened as they load (vcvtph2ps)."""
    def codegen(context, builder, sig, args):
        b = builder
        w = context.make_array(sig.args[0])(context, builder, args[0])
        X = context.make_array(sig.args[2])(context, builder, args[2])
        out = context.make_array(sig.args[4])(context, builder, args[4])
        r0, t0 = args[1], args[3]
        h = IRHelpers(b, target_features(context))
        wrows = row_ptrs(b, w, r0, TILE_ROWS)
        xrows = row_ptrs(b, X, t0, rn)
        n = cgutils.unpack_tuple(b, X.shape)[1]
        fv = vec(F32T, lanes)
        zero = ir.Constant(fv, [0.0] * lanes)

        def step(i, accs):
            if half:
                ws = [h.f16_lanes(h.load(wr, b.mul(i, c64(2)), vec(I16, lanes))) for wr in wrows]
            else:
                ws = [h.load(wr, b.mul(i, c64(4)), fv) for wr in wrows]
            new = []
            for j, xr in enumerate(xrows):
                xv = h.load(xr, b.mul(i, c64(4)), fv)
                new += [h.fma(wv, xv, accs[j * TILE_ROWS + r]) for r, wv in enumerate(ws)]
            return new
        fin = counted_loop(b, n, lanes, [zero] * (TILE_ROWS * rn), step, "sgemm")
        orow = row_ptrs(b, out, t0, rn)
        for j in range(rn):
            for r in range(TILE_ROWS):
                at = b.gep(orow[j], [b.mul(b.add(r0, c64(r)), c64(4))])
                b.store(h.hsum_f32(fin[j * TILE_ROWS + r]), b.bitcast(at, F32T.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _make_tile(lanes, half):
    codegen = _tile_codegen(lanes, tile_tokens(lanes), half)

    @intrinsic
    def tile(typingctx, w, r0, X, t0, out):
        """tinyBLAS's outputs of rows r0.. (TILE_ROWS) and tokens t0.. (tile_tokens) into out."""
        return types.void(w, r0, X, t0, out), codegen
    return tile


_TILES = {(lanes, half): _make_tile(lanes, half) for lanes in (8, 16) for half in (False, True)}
_tile8, _tile16, _tile8_f16, _tile16_f16 = _TILES[8, False], _TILES[16, False], _TILES[8, True], _TILES[16, True]


@njit(inline="always", **_JIT)
def _tile(w, r0, X, t0, out, lanes, half):
    if lanes == 16:
        if half:
            _tile16_f16(w, r0, X, t0, out)
        else:
            _tile16(w, r0, X, t0, out)
    elif half:
        _tile8_f16(w, r0, X, t0, out)
    else:
        _tile8(w, r0, X, t0, out)


@njit(parallel=True, **_JIT)
def sgemm_tiles(w, X, out, lanes, half, rn, block):
    """out[t, r] = tinyBLAS's dot of w[r] and X[t] for every tile: w (rows, k) with rows %
    TILE_ROWS == 0 (float32, or F16 bits as uint16 with `half`), X (n padded to a multiple
    of rn, k) with k % lanes == 0, out (n padded, rows). Token blocks of `block` in turn,
    the row groups of each on the threads."""
    n_groups = w.shape[0] // TILE_ROWS
    for tb in range(0, X.shape[0], block):
        te = min(tb + block, X.shape[0])
        for g in prange(n_groups):
            for t0 in range(tb, te, rn):
                _tile(w, g * TILE_ROWS, X, t0, out, lanes, half)


def matvec(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    vec_dot_rows(w, x, out, host_lanes())
    return out


TINYBLAS_ROWS = TILE_ROWS   # tinyBLAS tiles src0's rows by 16, 8 or 4, and declines other counts


def tinyblas_takes(m: int, n: int, k: int) -> bool:
    """Whether ggml hands a product of src0 (m rows) and src1 (n rows), k long, to tinyBLAS:
    two src1 rows or more, k a multiple of its vector, m of its row tiles."""
    return n >= 2 and k % host_lanes() == 0 and m % TINYBLAS_ROWS == 0


def matmul(w: np.ndarray, X: np.ndarray, out: np.ndarray) -> np.ndarray:
    """ggml_mul_mat(w, X): tinyBLAS for two tokens or more where k is a multiple of its
    vector and w's rows a multiple of TINYBLAS_ROWS, else ggml's vec_dot per output (its
    fallback: a one-row gate such as qwen35moe's shared-expert gate)."""
    if tinyblas_takes(w.shape[0], X.shape[0], X.shape[1]):
        return sgemm(w, X, out)
    vec_dot_tokens(np.ascontiguousarray(w, np.float32), np.ascontiguousarray(X, np.float32), out, host_lanes())
    return out


def sgemm(w: np.ndarray, X: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = X @ w.T in tinyBLAS's order (k a multiple of host_lanes(), w's rows of
    TILE_ROWS), for a caller that has checked ggml would take it (tinyBLAS tiles ggml's
    src0: for a conv's product that is the patches, not the kernel: vision.patch_conv).
    w float32, or float16 (ggml's F16 x F16 tinyBLAS: X then holds F16 values)."""
    lanes = host_lanes()
    half = w.dtype == np.float16
    if half and not has_f16c():
        w, half = w.astype(np.float32), False
    rn = tile_tokens(lanes)
    n_tok = X.shape[0]
    pad = -n_tok % rn
    Xp = np.ascontiguousarray(X, np.float32)
    if pad:
        Xp = np.concatenate([Xp, np.zeros((pad, X.shape[1]), np.float32)])
    full = out if not pad else np.empty((n_tok + pad, w.shape[0]), np.float32)
    wk = np.ascontiguousarray(w).view(np.uint16) if half else np.ascontiguousarray(w, np.float32)
    sgemm_tiles(wk, Xp, full, lanes, half, rn, TOKEN_BLOCK)
    if pad:
        out[:] = full[:n_tok]
    return out


def matmul_f16(w: np.ndarray, X: np.ndarray, out: np.ndarray) -> np.ndarray:
    """ggml_mul_mat of an F16 matrix w (float16 (rows, k)) and tokens X already rounded to F16
    (ggml converts src1 to F16 first): tinyBLAS where it takes the shape (two tokens or more,
    k a multiple of its vector, rows of TILE_ROWS), else ggml_vec_dot_f16 per output."""
    if tinyblas_takes(w.shape[0], X.shape[0], X.shape[1]):
        return sgemm(w, X, out)
    return vec_dot_f16_tokens(np.ascontiguousarray(w, np.float32), X, out, host_lanes())
