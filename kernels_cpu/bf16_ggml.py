"""BF16 matrices in ggml's summation order, with vdpbf16ps where the CPU has AVX512-BF16.

ggml first rounds the activation to BF16 (the type's vec_dot_type; round to nearest even, a
NaN made quiet: `to_bf16`). Then, per llama.cpp build (`BUILD`, from the Numba target):
- Decode (one token): ggml_vec_dot_bf16.
  - "bf16" (AVX512-BF16): two vdpbf16ps accumulators over 64-value steps, each reduced
    (_mm512_reduce_add_ps) and added into a double; the n % 64 tail in double.
  - "avx512" (AVX512F only): two 16-lane accumulators of widened values over 32-value steps
    (mul then add, which GCC fuses), each reduced into the double; the tail in double. (Read
    from the source: no host here has AVX-512 without BF16 to hold it to an oracle.)
  - "avx2" (and the portable build): four 8-lane accumulators over 32-value steps, reduced
    (c1 + c3) + (c2 + c4), then AVX's halves / movehl / movehdup; the tail in double.
- Prompts (two tokens or more): llamafile's tinyBLAS, which ggml calls for n >= 2 when k is
  a multiple of its step (32 values for vdpbf16ps, else one vector) and the rows of 4: one
  accumulator an output over k, then its horizontal sum. Otherwise vec_dot per token.

A vdpbf16ps lane is acc = (acc + a_odd b_odd) + a_even b_even, each add rounded, each
product exact (bf16_ggml_ref.py: the numpy reference of every path). The path this replaces
dequantized tiles to float32 for BLAS, with the activation in float32: not llama.cpp's
numbers, and its decode was a scalar loop. F16 weights keep matvec_half_ir.py: vdpbf16ps
would round their values.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from .ir_helpers import F32T, I16, I32, I64, IRHelpers, counted_loop, target_features, vec

_JIT = dict(cache=True, nogil=True)


def _build() -> str:
    feats = target_features(cpu_target.target_context)
    if {"+avx512f", "+avx512bf16"} <= feats:
        return "bf16"
    return "avx512" if "+avx512f" in feats else "avx2"


BUILD = _build()
DOT_STEP = 64 if BUILD == "bf16" else 32        # values a vec_dot_bf16 loop step
SGEMM_STEP = {"bf16": 32, "avx512": 16, "avx2": 8}[BUILD]   # tinyBLAS's KN
TINYBLAS_ROWS = 4            # tinyBLAS tiles src0's rows by 16, 8 or 4, and declines other counts
TILE_ROWS = 2 if BUILD == "avx2" else 4   # rows x TILE_TOKENS accumulators live: 16 vector registers on AVX2
TILE_TOKENS = 4
X_BLOCK_BYTES = 1 << 20      # BF16 activations that stay in L2 while every row streams past them


@njit(inline="always", **_JIT)
def _to_bf16_row(x, out):
    """ggml_compute_fp32_to_bf16: round to nearest even; a NaN keeps its top bits, made quiet."""
    u = x.view(np.uint32)
    for i in range(u.shape[0]):
        v = u[i]
        if (v & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            out[i] = np.uint16((v >> np.uint32(16)) | np.uint32(64))
        else:
            out[i] = np.uint16((v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(**_JIT)
def _to_bf16_vec(x, out):
    _to_bf16_row(x, out)


@njit(parallel=True, **_JIT)
def _to_bf16_rows(X, out):
    for t in prange(X.shape[0]):
        _to_bf16_row(X[t], out[t])


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 vector or matrix -> its BF16 bits (uint16, same shape), as ggml's from_float
    for BF16 (a matrix's rows on the threads, a vector on this one)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty(x.shape, np.uint16)
    if x.ndim == 2:
        _to_bf16_rows(x, out)
    else:
        _to_bf16_vec(x.reshape(-1), out.reshape(-1))
    return out


def _halving_sums(b, vs, lanes):
    """The horizontal sums of the vectors vs (each `lanes` floats), every one in the order of
    _mm512_reduce_add_ps and of AVX's hsum8 alike: halves added, lo + hi, until one value is
    left. Done for all of them at once: two vectors holding segments of width w are split
    into their segments' low halves and high halves, and one add leaves twice the segments
    of width w / 2 (each lane's add the one it would be alone). Returns vectors holding the
    sums in vs's order, `lanes` a vector (the last one's tail lanes undefined)."""
    vs = list(vs)
    width = lanes
    while width > 1:
        if len(vs) % 2:
            vs.append(vs[-1])
        segs = lanes // width
        half = width // 2
        lo = [s * width + k for s in range(segs) for k in range(half)]
        hi = [s * width + half + k for s in range(segs) for k in range(half)]
        nxt = []
        for p, q in zip(vs[::2], vs[1::2]):
            x = b.shuffle_vector(p, q, ir.Constant(vec(I32, lanes), lo + [lanes + m for m in lo]))
            y = b.shuffle_vector(p, q, ir.Constant(vec(I32, lanes), hi + [lanes + m for m in hi]))
            nxt.append(b.fadd(x, y))
        vs, width = nxt, half
    return vs


def _chains_codegen(dp: bool, lanes: int, n_acc: int, n_rows: int, n_tok: int, prefetch: int):
    """IR for n_rows x n_tok dot products advanced n_steps steps of n_acc vectors each: the
    accumulator (row r, token t, slot a) takes the values a*per .. of each step (per = 32 for
    vdpbf16ps, else `lanes` widened values). Rows start at w_addr + r * w_stride bytes,
    tokens at x_addr + t * x_stride. The horizontal sums go to acc_addr in the order (token,
    row, slot); four slots (AVX2's vec_dot) are first added (c1 + c3) + (c2 + c4), one sum.
    prefetch: bytes ahead of each row's reads to prefetch (0: none)."""
    per = 32 if dp else lanes
    step = per * n_acc
    vf = vec(F32T, lanes)

    def codegen(context, b, sig, args):
        h = IRHelpers(b, target_features(context))
        w_addr, w_stride, x_addr, x_stride, n_steps, acc_addr = args
        i8p = ir.IntType(8).as_pointer()
        wrows = [b.inttoptr(b.add(w_addr, b.mul(w_stride, ir.Constant(I64, r))), i8p) for r in range(n_rows)]
        xrows = [b.inttoptr(b.add(x_addr, b.mul(x_stride, ir.Constant(I64, t))), i8p) for t in range(n_tok)]
        zero = ir.Constant(vf, [0.0] * lanes)

        def load(base, off):
            if dp:
                return h.load(base, off, vec(I32, 16))     # 32 BF16 values, as vdpbf16ps takes them
            u = b.zext(h.load(base, off, vec(I16, lanes)), vec(I32, lanes))
            return b.bitcast(b.shl(u, ir.Constant(vec(I32, lanes), [16] * lanes)), vf)

        def idx(r, t, a):
            return (t * n_rows + r) * n_acc + a

        def body(i, accs):
            out = list(accs)
            for a in range(n_acc):
                off = b.mul(b.add(b.mul(i, ir.Constant(I64, step)), ir.Constant(I64, a * per)), ir.Constant(I64, 2))
                if prefetch and a == 0:   # one line a step: every line (prefetch_lines) measured 3-10% slower
                    for w in wrows:
                        h.prefetch(b.gep(w, [b.add(off, ir.Constant(I64, prefetch))]))
                wv = [load(w, off) for w in wrows]
                xv = [load(x, off) for x in xrows]
                for r in range(n_rows):
                    for t in range(n_tok):
                        j = idx(r, t, a)
                        if dp:
                            out[j] = h.x86("llvm.x86.avx512bf16.dpbf16ps.512", vf, [out[j], wv[r], xv[t]])
                        else:
                            out[j] = h.fma(wv[r], xv[t], out[j])
            return out
        fin = counted_loop(b, n_steps, 1, [zero] * (n_rows * n_tok * n_acc), body, "bf16dot")
        if n_acc == 4:
            fin = [b.fadd(b.fadd(fin[j], fin[j + 2]), b.fadd(fin[j + 1], fin[j + 3])) for j in range(0, len(fin), 4)]
        base = b.inttoptr(acc_addr, vf.as_pointer())
        for j, v in enumerate(_halving_sums(b, fin, lanes)):
            b.store(v, b.gep(base, [ir.Constant(I32, j)]), align=4)
        return context.get_dummy_value()
    return codegen


def _make_chains(dp: bool, lanes: int, n_acc: int, n_rows: int, n_tok: int, prefetch: int = 0):
    codegen = _chains_codegen(dp, lanes, n_acc, n_rows, n_tok, prefetch)

    @intrinsic
    def chains(typingctx, w_addr, w_stride, x_addr, x_stride, n_steps, acc_addr):
        return types.void(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64), codegen
    return chains


_DP = BUILD == "bf16"
_LANES = 8 if BUILD == "avx2" else 16
_N_ACC = 4 if BUILD == "avx2" else 2    # vec_dot_bf16's accumulators
_SUMS = 1 if _N_ACC == 4 else 2         # its horizontal sums a row (AVX2 adds its four first)
DOT_ROWS = 4                            # rows a vec_dot call
DOT_PREFETCH = 1024   # bytes ahead of each row stream (Gemma's head 262144 x 640: 11.3 -> 10.3 ms, 2 threads)
_dot_chains = _make_chains(_DP, _LANES, _N_ACC, DOT_ROWS, 1, DOT_PREFETCH)
_dot_chains1 = _make_chains(_DP, _LANES, _N_ACC, 1, 1)
_tile_chains = _make_chains(_DP, _LANES, 1, TILE_ROWS, TILE_TOKENS)
_SCRATCH = 64                           # floats: the largest call's sums, rounded up to whole vectors


@njit(inline="always", **_JIT)
def _vec_dot_finish(w, xb, body, sums, o):
    """One row's ggml_vec_dot_bf16 from its horizontal sums sums[o:o + _SUMS]: added in
    double, then the products past the last whole step (each exact in float32)."""
    s = np.float64(sums[o])
    if _SUMS == 2:
        s += np.float64(sums[o + 1])
    n = xb.shape[0]
    if body < n:
        wt = (w[body:].astype(np.uint32) << np.uint32(16)).view(np.float32)
        xt = (xb[body:].astype(np.uint32) << np.uint32(16)).view(np.float32)
        for k in range(n - body):
            s += np.float64(wt[k] * xt[k])
    return np.float32(s)


@njit(parallel=True, **_JIT)
def _vec_dot_rows(w, xb, out):
    """out[r] = ggml_vec_dot_bf16(w[r], xb) for every row; w (n_rows, n) uint16. Rows
    DOT_ROWS a call a quarter of the matrix apart (i, i + q, ..: long sequential streams for
    the prefetchers), a thread's share of them in one prange item."""
    n = xb.shape[0]
    body = n - n % DOT_STEP
    q = w.shape[0] // DOT_ROWS
    n_items = min(q, 64)
    ws = w.strides[0]
    for it in prange(n_items):
        sums = np.empty(_SCRATCH, np.float32)
        for i in range(it * q // n_items, (it + 1) * q // n_items):
            _dot_chains(w[i].ctypes.data, q * ws, xb.ctypes.data, 0, body // DOT_STEP, sums.ctypes.data)
            for k in range(DOT_ROWS):
                out[i + k * q] = _vec_dot_finish(w[i + k * q], xb, body, sums, k * _SUMS)
    sums = np.empty(_SCRATCH, np.float32)
    for r in range(q * DOT_ROWS, w.shape[0]):
        _dot_chains1(w[r].ctypes.data, ws, xb.ctypes.data, 0, body // DOT_STEP, sums.ctypes.data)
        out[r] = _vec_dot_finish(w[r], xb, body, sums, 0)


@njit(parallel=True, **_JIT)
def _sgemm_block(w, xb, t0, t1, out):
    """out[t, r] = tinyBLAS's dot of w[r] and xb[t] for tokens t0 <= t < t1 (xb holds rows up
    to t1 rounded up to TILE_TOKENS); w's rows a multiple of TILE_ROWS."""
    n = xb.shape[1]
    n_steps = n // SGEMM_STEP
    ws, xs = w.strides[0], xb.strides[0]
    for g in prange(w.shape[0] // TILE_ROWS):
        sums = np.empty(_SCRATCH, np.float32)
        r0 = g * TILE_ROWS
        for t in range(t0, t1, TILE_TOKENS):
            _tile_chains(w[r0].ctypes.data, ws, xb[t].ctypes.data, xs, n_steps, sums.ctypes.data)
            for j in range(min(TILE_TOKENS, t1 - t)):
                for i in range(TILE_ROWS):
                    out[t + j, r0 + i] = sums[j * TILE_ROWS + i]


def matvec(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = ggml's BF16 matrix-vector product; w (n_rows, n) uint16 BF16 bits, x (n,) float32."""
    _vec_dot_rows(w, to_bf16(x), out)
    return out


def token_block(n: int) -> int:
    """Tokens a pass of the rows: as many as X_BLOCK_BYTES of activations hold, whole tiles."""
    return max(TILE_TOKENS, X_BLOCK_BYTES // (2 * n) // TILE_TOKENS * TILE_TOKENS)


def matmul(w: np.ndarray, X: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = ggml_mul_mat(w, X) for two tokens or more: tinyBLAS where it takes the shape,
    else vec_dot_bf16 per token (ggml's fallback)."""
    xb = to_bf16(X)
    n_tok, n = xb.shape
    if n % SGEMM_STEP or w.shape[0] % TINYBLAS_ROWS or n_tok < 2:
        for t in range(n_tok):
            _vec_dot_rows(w, xb[t], out[t])
        return out
    pad = -n_tok % TILE_TOKENS
    if pad:
        xb = np.concatenate([xb, np.zeros((pad, n), np.uint16)])
    block = token_block(n)
    for t0 in range(0, n_tok, block):
        _sgemm_block(w, xb, t0, min(t0 + block, n_tok), out)
    return out
