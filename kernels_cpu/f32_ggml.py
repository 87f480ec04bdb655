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

from edgeinfer.kernels_cpu.ggml_math import hsum8, hsum16, unfused
from edgeinfer.kernels_cpu.ir_helpers import (F32T, I32, IRHelpers, c64, counted_loop, row_ptrs, target_features,
                                              vec)

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
def _hsum_sgemm(v, lanes):
    """tinyBLAS's hsum: AVX-512's reduce, or AVX's (lo + hi), movehl, movehdup (ggml_math.hsum8)."""
    if lanes == 16:
        return _hsum(v, lanes)
    return hsum8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7])


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


@njit(parallel=True, **_JIT)
def vec_dot_rows(w, x, out, lanes):
    """out[r] = ggml_vec_dot_f32(w[r], x) for every row; w (n_rows, n) float32."""
    n = x.shape[0]
    step = 4 * lanes
    body = n - n % step
    for r in prange(w.shape[0]):
        acc = np.zeros(step, np.float32)  # accumulator j's lane l is acc[j * lanes + l]
        wr = w[r]
        for i in range(0, body, step):
            wi, xi = wr[i:i + step], x[i:i + step]
            for q in range(step):  # independent chains: vectorised, each one fma a step
                acc[q] += wi[q] * xi[q]
        red = np.empty(lanes, np.float32)
        for l in range(lanes):
            red[l] = (acc[l] + acc[2 * lanes + l]) + (acc[lanes + l] + acc[3 * lanes + l])
        out[r] = _tail(wr, x, body, n, lanes, _hsum(red, lanes))


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


SGEMM_TOKENS = 4   # tokens a tile: 4 independent accumulator chains a row


def _sgemm_tile_codegen(lanes):
    def codegen(context, builder, sig, args):
        b = builder
        w = context.make_array(sig.args[0])(context, builder, args[0])
        X = context.make_array(sig.args[2])(context, builder, args[2])
        acc = context.make_array(sig.args[4])(context, builder, args[4])
        r, t0 = args[1], args[3]
        h = IRHelpers(b, target_features(context))
        wrow = row_ptrs(b, w, r, 1)[0]
        xrows = row_ptrs(b, X, t0, SGEMM_TOKENS)
        n = cgutils.unpack_tuple(b, X.shape)[1]
        zero = ir.Constant(vec(F32T, lanes), [0.0] * lanes)

        def step(i, accs):
            off = b.mul(i, c64(4))
            wv = h.load(wrow, off, vec(F32T, lanes))
            return [h.fma(wv, h.load(xr, off, vec(F32T, lanes)), a) for xr, a in zip(xrows, accs)]
        fin = counted_loop(b, n, lanes, [zero] * SGEMM_TOKENS, step, "sgemm")
        base = b.bitcast(acc.data, vec(F32T, lanes).as_pointer())
        for j, v in enumerate(fin):
            b.store(v, b.gep(base, [ir.Constant(I32, j)]), align=4)
        return context.get_dummy_value()
    return codegen


def _make_sgemm_tile(lanes):
    codegen = _sgemm_tile_codegen(lanes)

    @intrinsic
    def tile(typingctx, w, r, X, t0, acc):
        """acc[j] = the `lanes` partial sums of w[r] . X[t0 + j], j < SGEMM_TOKENS: one fused
        multiply-add chain a token over k, as tinyBLAS's accumulator (X rows t0.. must exist)."""
        return types.void(w, r, X, t0, acc), codegen
    return tile


_sgemm_tile8, _sgemm_tile16 = _make_sgemm_tile(8), _make_sgemm_tile(16)


@njit(parallel=True, **_JIT)
def sgemm_rows(w, X, out, lanes):
    """out[t, r] = tinyBLAS's dot of w[r] and X[t] (n % lanes == 0); w (n_rows, n), X (n_tok
    padded to a multiple of SGEMM_TOKENS, n); out (n_tok, n_rows). Each output is one
    accumulator chain over k then its horizontal sum, as before; SGEMM_TOKENS tokens run
    side by side so the chains overlap (one chain alone waits on each fma's latency)."""
    n_tok = out.shape[0]
    for r in prange(w.shape[0]):
        acc = np.empty((SGEMM_TOKENS, lanes), np.float32)
        for t0 in range(0, n_tok, SGEMM_TOKENS):
            if lanes == 16:
                _sgemm_tile16(w, r, X, t0, acc)
            else:
                _sgemm_tile8(w, r, X, t0, acc)
            for j in range(min(SGEMM_TOKENS, n_tok - t0)):
                out[t0 + j, r] = _hsum_sgemm(acc[j], lanes)


def matvec(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    vec_dot_rows(w, x, out, host_lanes())
    return out


TINYBLAS_ROWS = 4   # tinyBLAS tiles src0's rows by 16, 8 or 4, and declines other counts


def matmul(w: np.ndarray, X: np.ndarray, out: np.ndarray) -> np.ndarray:
    """ggml_mul_mat(w, X) for two tokens or more: tinyBLAS where k is a multiple of its
    vector and w's rows a multiple of TINYBLAS_ROWS, else ggml's vec_dot per token (its
    fallback: a one-row gate such as qwen35moe's shared-expert gate)."""
    lanes = host_lanes()
    if X.shape[1] % lanes == 0 and w.shape[0] % TINYBLAS_ROWS == 0:
        return sgemm(w, X, out)
    for t in range(X.shape[0]):
        vec_dot_rows(w, X[t], out[t], lanes)
    return out


def sgemm(w: np.ndarray, X: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = X @ w.T in tinyBLAS's order (k a multiple of host_lanes()), for a caller that
    has checked ggml would take it (tinyBLAS tiles ggml's src0: for a conv's product that
    is the patches, not the kernel: vision.patch_conv)."""
    lanes = host_lanes()
    n_tok = X.shape[0]
    pad = -n_tok % SGEMM_TOKENS
    Xp = np.ascontiguousarray(X, np.float32) if not pad else np.concatenate(
        [X, np.zeros((pad, X.shape[1]), np.float32)])
    sgemm_rows(np.ascontiguousarray(w, np.float32), Xp, out, lanes)
    return out
