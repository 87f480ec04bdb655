"""Causal GQA attention over an F16 KV cache, in llama.cpp's exact floating-point order.

Why the exact order: small models such as Gemma 3 270M turn a last-bit difference in one
attention output into a different greedy token a few steps later, so matching llama.cpp
token for token needs the same roundings in the same order, not just "close" math.
llama.cpp's CPU decode path (no flash attention) computes, per query row and head:

1. KQ = K (F16) . Q rounded to F16, one `ggml_vec_dot_f16` per key: 32 float32 slots, slot
   e % 32 accumulates element e in order (the F16 x F16 products are exact in float32),
   then the fixed AVX reduction of the 32 slots (`reduce32`) into a double; elements past
   the last multiple of 32 are added in double.
2. Softmax over the keys: w = KQ * kq_scale, masked keys -inf, minus the row max,
   exp by `ggml_v_expf` (a polynomial, not libm's expf) 8 keys at a time; each group of 8
   is summed in float32 (`hsum8`) and the group sums in double; the weights are scaled
   by float32(1 / sum).
3. Out = V^T (F16) . weights rounded to F16, again `ggml_vec_dot_f16` over the keys: key
   j goes to slot j % 32, where j is the key's slot in the cache (its position in a fresh
   sequence; llama.cpp pads the key count to 256, so there are no leftovers).

A masked key contributes exactly zero everywhere, so the kernels skip it. The numpy
reference of the same math is `edgeinfer.backend.Backend.attention`; the tests require
the two to agree bit for bit.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import compile_progress
from .f16 import f16_round, f16_to_f32, round_f16
from .f16 import f16_value as _f16
from .fast_dot import _IR, _counted_loop, _target_features
from .threads import apply_threads, get_threads, worker_pool

_JIT = dict(cache=True, nogil=True)  # no fastmath: the order of every float op matters here

# ggml_v_expf's constants, as written there in hexadecimal
_R = np.float32(float.fromhex("0x1.8p23"))
_LOG2E = np.float32(float.fromhex("0x1.715476p+0"))
_LN2_HI = np.float32(float.fromhex("0x1.62e4p-1"))
_LN2_LO = np.float32(float.fromhex("0x1.7f7d1cp-20"))
_C5 = np.float32(float.fromhex("0x1.0e4020p-7"))
_C4 = np.float32(float.fromhex("0x1.573e2ep-5"))
_C3 = np.float32(float.fromhex("0x1.555e66p-3"))
_C2 = np.float32(float.fromhex("0x1.fffdb6p-2"))
_C1 = np.float32(float.fromhex("0x1.ffffecp-1"))



@njit(inline="always", **_JIT)
def _fma(a, b, c):
    # float32 FMA: a*b of two float32 is exact in float64, so only the final roundings
    # remain (float64 then float32; they differ from one rounding with probability ~2^-29)
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


@njit(inline="always", **_JIT)
def _expf_parts(x):
    """ggml_v_expf's exponent n and polynomial j: exp(x) ~ 2^n * (1 + j)."""
    z = _fma(x, _LOG2E, _R)
    n = np.float32(z - _R)
    b = _fma(-n, _LN2_LO, _fma(-n, _LN2_HI, x))
    u = np.float32(b * b)
    j = _fma(_fma(_fma(_C5, b, _C4), u, _fma(_C3, b, _C2)), u, np.float32(_C1 * b))
    return n, j


@intrinsic
def _pow2_f64(typingctx, n):
    """2.0 ** n for an int64 -1022 <= n <= 1023, from the exponent bits (vectorizes)."""
    sig = types.float64(types.int64)

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        e = builder.shl(builder.add(args[0], ir.Constant(i64, 1023)), ir.Constant(i64, 52))
        return builder.bitcast(e, ir.DoubleType())
    return sig, codegen


@njit(inline="always", **_JIT)
def ggml_expf_any(x):
    """ggml_v_expf (AVX2) for any finite float32 x, its three ranges: |n| <= 126,
    fma(j, k, k) with k = 2^n, one rounding of 2^n * (1 + j) (exact in float64);
    126 < |n| <= 192, two power-of-two factors, 1 + j rounded to float32 first and the
    last product rounding again (to a subnormal, or to inf); beyond, 0 or inf.
    Branch-free, so loops over it vectorize."""
    n, j = _expf_parts(x)
    one_j = np.float64(j) + 1.0 if abs(n) <= 126.0 else np.float64(np.float32(j + np.float32(1.0)))
    k = _pow2_f64(np.int64(min(max(n, np.float32(-193.0)), np.float32(193.0))))
    r = np.float32(one_j * k)
    return np.float32(0.0) if n < -192.0 else (np.float32(np.inf) if n > 192.0 else r)


@njit(inline="always", **_JIT)
def _hsum8(a0, a1, a2, a3, a4, a5, a6, a7):
    # _mm256 -> _mm_add_ps(hi, lo) -> movehl add -> movehdup add_ss
    t0 = np.float32(a0 + a4)
    t1 = np.float32(a1 + a5)
    t2 = np.float32(a2 + a6)
    t3 = np.float32(a3 + a7)
    return np.float32(np.float32(t0 + t2) + np.float32(t1 + t3))


def _has_f16c() -> bool:
    """Whether the CPU Numba compiles for has F16C: the host's, unless NUMBA_CPU_NAME /
    NUMBA_CPU_FEATURES name another target (then only an explicit +f16c counts)."""
    from numba.core import config
    from llvmlite import binding

    if config.CPU_FEATURES is not None:
        return "+f16c" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME is not None and config.CPU_NAME != "host":
        return False
    return binding.get_host_cpu_features().get("f16c", False)


_VECTOR_F16 = _has_f16c()


@intrinsic
def _dot_f16_32(typingctx, k_row, q, n):
    """ggml_vec_dot_f16 of F16 bits k_row (1-D uint16, C) with float32 q over the first n
    elements (a multiple of 32), in its exact order: four <8 x float> accumulators fed in
    turn, then GGML_F32x8_REDUCE. Emitted only where the CPU has F16C (vcvtph2ps)."""
    sig = types.float32(k_row, q, n)

    def codegen(context, builder, sig, args):
        f32, i64 = ir.FloatType(), ir.IntType(64)
        v8f = ir.VectorType(f32, 8)
        ka = context.make_array(sig.args[0])(context, builder, args[0])
        qa = context.make_array(sig.args[1])(context, builder, args[1])
        kp = builder.bitcast(ka.data, ir.IntType(16).as_pointer())
        qp = builder.bitcast(qa.data, f32.as_pointer())
        n = args[2]
        zero = ir.Constant(v8f, [0.0] * 8)

        def step(i, accs):
            new = []
            for j, a in enumerate(accs):
                off = builder.add(i, ir.Constant(i64, 8 * j))
                kv = builder.load(builder.bitcast(builder.gep(kp, [off]), ir.VectorType(ir.IntType(16), 8).as_pointer()), align=2)
                kf = builder.fpext(builder.bitcast(kv, ir.VectorType(ir.HalfType(), 8)), v8f)
                qv = builder.load(builder.bitcast(builder.gep(qp, [off]), v8f.as_pointer()), align=4)
                new.append(builder.fadd(a, builder.fmul(kf, qv)))  # F16 x F16 products are exact: = fma
            return new
        fin = _counted_loop(builder, n, 32, [zero] * 4, step, "dot16")
        x0 = builder.fadd(builder.fadd(fin[0], fin[2]), builder.fadd(fin[1], fin[3]))

        def lane(v, k):
            return builder.extract_element(v, ir.Constant(ir.IntType(32), k))
        t = [builder.fadd(lane(x0, k), lane(x0, k + 4)) for k in range(4)]
        return builder.fadd(builder.fadd(t[0], t[1]), builder.fadd(t[2], t[3]))
    return sig, codegen


@intrinsic
def _via_f16(typingctx, x):
    """float32 -> nearest F16 -> float32 (vcvtps2ph, round to nearest even; F16C only)."""
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


# The softmax passes below run serially: attention_blas parallelises over query blocks
# on the worker pool, and a Numba parallel region entered from a second Python thread
# gives that thread its own OpenMP team. libgomp then has more threads than cores and
# stops spinning between regions, which made every later decode step ~1.8x slower.
@njit(**_JIT)
def _mask_and_center(scores, kpos, qpos, window):
    """In place over scores (rows, keys), row r belonging to query r % len(qpos): x - row max
    over the keys the query sees (causal, sliding window), -inf for the others."""
    n = qpos.shape[0]
    for r in range(scores.shape[0]):
        row = scores[r]
        p = qpos[r % n]
        mx = np.float32(-np.inf)
        for j in range(row.shape[0]):
            if kpos[j] <= p and (window <= 0 or p - kpos[j] < window) and row[j] > mx:
                mx = row[j]
        for j in range(row.shape[0]):
            if kpos[j] <= p and (window <= 0 or p - kpos[j] < window):
                row[j] = row[j] - mx
            else:
                row[j] = -np.inf


@njit(**_JIT)
def _normalize_f16(probs):
    """In place: each row divided by its sum (taken in double), rounded to F16."""
    for r in range(probs.shape[0]):
        row = probs[r]
        total = 0.0
        for j in range(row.shape[0]):
            total += row[j]
        inv = np.float32(1.0 / total)
        for j in range(row.shape[0]):
            if _VECTOR_F16:
                row[j] = _via_f16(np.float32(row[j] * inv))
            else:
                row[j] = _round_f16(np.float32(row[j] * inv))


def _softmax_rows_f16(scores, kpos, qpos, window):
    """Masked softmax of each row in place, weights rounded to F16 (the cache type). exp is
    numpy's (vectorized); the compiled passes around it do what numpy did slowly (its F16
    cast of tiny weights alone took 10x the matmuls)."""
    _mask_and_center(scores, kpos, qpos, window)
    np.exp(scores, out=scores)
    _normalize_f16(scores)


@njit(**_JIT)
def dot_f16_scalar(k_row, q16, n_vec, acc, n_slots):
    """_dot_f16_32 without F16C: the same order, element by element."""
    acc[:] = 0.0
    for c in range(0, n_vec, n_slots):
        for lane in range(n_slots):
            acc[lane] += _f16(k_row[c + lane]) * q16[c + lane]
    return reduce32(acc)


@njit(**_JIT)
def dot_f16_vector(k_row, q16, n_vec):
    return _dot_f16_32(k_row, q16, n_vec)


@njit(inline="always", **_JIT)
def reduce32(acc):
    """GGML_F32x8_REDUCE of 4 x <8 x float>: (s0+s2) + (s1+s3), then the 128-bit halves,
    then two horizontal adds."""
    x = np.empty(8, np.float32)
    for i in range(8):
        x[i] = np.float32(np.float32(acc[i] + acc[16 + i]) + np.float32(acc[8 + i] + acc[24 + i]))
    t0 = np.float32(x[0] + x[4])
    t1 = np.float32(x[1] + x[5])
    t2 = np.float32(x[2] + x[6])
    t3 = np.float32(x[3] + x[7])
    return np.float32(np.float32(t0 + t1) + np.float32(t2 + t3))


@njit(inline="always", **_JIT)
def _round_f16(x):
    """The float32 value of x rounded to the nearest float16 (ties to even)."""
    a = abs(np.float64(x))
    if a >= 65520.0:
        r = np.inf
    else:
        if a < 6.103515625e-05:  # F16 subnormal range: a fixed quantum of 2^-24
            quantum = 5.9604644775390625e-08
        else:
            m, e = math.frexp(a)
            quantum = 2.0 ** (e - 11)
        magic = 1.5 * quantum * 4503599627370496.0  # adding it rounds to a multiple of quantum
        r = (a + magic) - magic
    return np.float32(-r if x < 0 else r)


@njit(**_JIT)
def _allowed(kp, qp, window):
    return kp <= qp and (window <= 0 or qp - kp < window)


@njit(**_JIT)
def _scores_and_weights(q16, k_bits, g, kpos, qp, window, kq_scale, w, n_slots=32):
    """Fill w[:S] with the F16-rounded softmax weights of one query row (q16: F16 values),
    a key at a time (CPUs without F16C, head sizes without the 16-key kernels)."""
    hd = q16.shape[0]
    n_vec = hd - hd % 32
    acc = np.zeros(32, np.float32)
    for j in range(k_bits.shape[0]):
        if not _allowed(kpos[j], qp, window):
            continue   # _softmax_f16 gives it weight 0 whatever w[j] holds
        if _VECTOR_F16:
            dot = np.float64(_dot_f16_32(k_bits[j, g], q16, n_vec))
        else:
            dot = np.float64(dot_f16_scalar(k_bits[j, g], q16, n_vec, acc, n_slots))
        for d in range(n_vec, hd):  # leftovers, in double
            dot += np.float64(_f16(k_bits[j, g, d])) * np.float64(q16[d])
        w[j] = np.float32(dot)
    _softmax_f16(w, kpos, qp, window, kq_scale)


@njit(**_JIT)
def _weighted_values(w, v_bits, g, out):
    """out[d] = sum_j w[j] * V[j, d] as ggml_vec_dot_f16 over the keys (key j in slot j % 32).
    Keys outer, dims inner (vectorized): each (slot, dim) still sums its keys in order."""
    n_keys, hdv = v_bits.shape[0], v_bits.shape[2]
    acc = np.zeros((32, hdv), np.float32)
    for j in range(n_keys):
        wj = w[j]
        if wj != 0.0:  # a zero weight adds exactly +0
            row = acc[j & 31]
            for d in range(hdv):
                row[d] += _f16(v_bits[j, g, d]) * wj
    _reduce_slots(acc, out)


@njit(inline="always", **_JIT)
def _slot_pair_sums(acc, i, d):
    """reduce32's first step for slot group i of dim d: (s_i + s_16+i) + (s_8+i + s_24+i)."""
    return np.float32(np.float32(acc[i, d] + acc[16 + i, d]) + np.float32(acc[8 + i, d] + acc[24 + i, d]))


@njit(**_JIT)
def _reduce_slots(acc, out):
    """reduce32 of the 32 slot rows for every dim at once (lane-wise over the dims): one
    loop over the dims with the whole reduction inside (eight loops over the dims, one per
    slot group, made LLVM emit eight vectorized copies: a quarter of the kernel's IR)."""
    for d in range(out.shape[0]):
        t0 = np.float32(_slot_pair_sums(acc, 0, d) + _slot_pair_sums(acc, 4, d))
        t1 = np.float32(_slot_pair_sums(acc, 1, d) + _slot_pair_sums(acc, 5, d))
        t2 = np.float32(_slot_pair_sums(acc, 2, d) + _slot_pair_sums(acc, 6, d))
        t3 = np.float32(_slot_pair_sums(acc, 3, d) + _slot_pair_sums(acc, 7, d))
        out[d] = np.float32(np.float32(t0 + t1) + np.float32(t2 + t3))


# ----------------------------------------------------------------------------- decode, 16 keys a step
# The same numbers as _scores_and_weights / _weighted_values (which stay for CPUs without
# F16C and other head sizes), without their per-key scalar work: each key's dot ends in
# reduce32, a horizontal sum, done here for 16 keys at once by shuffles that also
# transpose (key k in lane k); the softmax passes are branch-free loops that vectorize;
# the weighted values convert and fma 16 dims an instruction. One head of a Llama-1B
# shape (hd 64, 1024 keys), one thread: KQ + softmax 19 -> 7.2 ns a key, weighted values
# 10.7 -> 3.7 ns. A whole decode call (32 heads, 1024 keys, 2 threads): 694 -> 260 us.

KEYS = 16   # keys a step of _kq_dots
KEY_STEP = 4   # of which are written out at once: a loop over the 16 keys, 4 a turn, keeps
#                the IR (compile time) a quarter of sixteen copies and four dots in flight


def _f16_vec(b, ptr, n):
    """n F16 values at ptr (i8*) as <n x float> (vcvtph2ps with F16C)."""
    i16v = ir.VectorType(ir.IntType(16), n)
    raw = b.load(b.bitcast(ptr, i16v.as_pointer()), align=2)
    return b.fpext(b.bitcast(raw, ir.VectorType(ir.HalfType(), n)), ir.VectorType(ir.FloatType(), n))


def _fma_ir(b, x, y, acc):
    fn = b.module.globals.get(f"llvm.fma.v{acc.type.count}f32") or ir.Function(
        b.module, ir.FunctionType(acc.type, [acc.type] * 3), f"llvm.fma.v{acc.type.count}f32")
    return b.call(fn, [x, y, acc])


def _shuf(b, x, y, idx):
    return b.shuffle_vector(x, y, ir.Constant(ir.VectorType(ir.IntType(32), len(idx)), list(idx)))


def _dot_lanes(b, kptr, qs):
    """One key's ggml_vec_dot_f16 with q (hd/32 vectors <32 x float>) up to its last step:
    the 32 slots summed over the chunks in order, then slots l and 16 + l added: the
    <16 x float> whose lanes reduce32 finishes (_reduce16_keys)."""
    f32 = ir.FloatType()
    acc = ir.Constant(ir.VectorType(f32, 32), [0.0] * 32)
    for c, qc in enumerate(qs):
        kf = _f16_vec(b, b.gep(kptr, [ir.Constant(ir.IntType(64), 64 * c)]), 32)
        # F16 x F16 products are exact in float32, so an fma rounds as the add alone; the
        # first add from zero stays (0 + -0 is +0)
        acc = b.fadd(acc, b.fmul(kf, qc)) if c == 0 else _fma_ir(b, kf, qc, acc)
    return b.fadd(_shuf(b, acc, acc, range(16)), _shuf(b, acc, acc, range(16, 32)))


def _reduce16_keys(b, ys):
    """16 keys' _dot_lanes vectors -> <16 x float> of their dots, key k in lane k, each
    lane by reduce32's own adds: x_i = y_i + y_{8+i}, t_k = x_k + x_{k+4},
    (t0 + t1) + (t2 + t3). Each round pairs two vectors, so it also transposes."""
    def rounds(vs, lo, hi):
        return [b.fadd(_shuf(b, x, y, lo), _shuf(b, x, y, hi)) for x, y in zip(vs[0::2], vs[1::2])]
    u = rounds(ys, [*range(8), *range(16, 24)], [*range(8, 16), *range(24, 32)])        # x of 2 keys
    v = rounds(u, [i + 8 * q for q in range(4) for i in range(4)], [i + 4 + 8 * q for q in range(4) for i in range(4)])
    w = rounds(v, list(range(0, 32, 2)), list(range(1, 32, 2)))                          # t0+t1, t2+t3
    return rounds(w, list(range(0, 32, 2)), list(range(1, 32, 2)))[0]


def _kv_head(context, b, ty, val, g):
    """(i8* to KV head g of slot 0, the slot stride) of a (S, n_kv, d) F16-bits cache array."""
    a = context.make_array(ty)(context, b, val)
    strides = cgutils.unpack_tuple(b, a.strides)
    return b.gep(b.bitcast(a.data, ir.IntType(8).as_pointer()), [b.mul(g, strides[1])]), strides[0]


def _f32_ptr(context, b, ty, val):
    return b.bitcast(context.make_array(ty)(context, b, val).data, ir.FloatType().as_pointer())


def _make_kq_dots(n_chunks):
    @intrinsic
    def kq_dots(typingctx, q16, k_bits, g, n_blocks, w):
        """w[j] = the reduce32 dot of key j (KV head g of k_bits, (S, n_kv, 32 * n_chunks)
        F16 bits) with q16 (F16 values as float32) for j < KEYS * n_blocks: for each key
        exactly what _dot_f16_32 returns, 16 keys a step."""
        sig = types.void(q16, k_bits, g, n_blocks, w)

        def codegen(context, b, sig, args):
            f32, i64 = ir.FloatType(), ir.IntType(64)
            kbase, kstride = _kv_head(context, b, sig.args[1], args[1], args[2])
            v32 = ir.VectorType(f32, 32)
            qp, wp = _f32_ptr(context, b, sig.args[0], args[0]), _f32_ptr(context, b, sig.args[4], args[4])
            qs = [b.load(b.bitcast(b.gep(qp, [ir.Constant(i64, 32 * c)]), v32.as_pointer()), align=4)
                  for c in range(n_chunks)]

            v16 = ir.VectorType(f32, 16)
            ybuf = cgutils.alloca_once(b, v16, size=KEYS)   # the 16 keys' _dot_lanes vectors

            def block(i, accs):
                j0 = b.mul(i, ir.Constant(i64, KEYS))

                def keys(m, _):
                    for k in range(KEY_STEP):
                        mk = b.add(m, ir.Constant(i64, k))
                        b.store(_dot_lanes(b, b.gep(kbase, [b.mul(b.add(j0, mk), kstride)]), qs),
                                b.gep(ybuf, [mk]), align=4)
                    return []
                _counted_loop(b, ir.Constant(i64, KEYS), KEY_STEP, [], keys, "kqkeys")
                ys = [b.load(b.gep(ybuf, [ir.Constant(i64, k)]), align=4) for k in range(KEYS)]
                out = b.bitcast(b.gep(wp, [j0]), ir.VectorType(f32, KEYS).as_pointer())
                b.store(_reduce16_keys(b, ys), out, align=4)
                return []
            _counted_loop(b, args[3], 1, [], block, "kq")
            return context.get_dummy_value()
        return sig, codegen
    return kq_dots


def _make_weighted_slots(n_vchunks):
    @intrinsic
    def weighted_slots(typingctx, w, lo, hi, v_bits, g, acc):
        """acc[j % 32, :] += w[j] * V[j] for keys lo <= j < hi in order (KV head g of v_bits,
        (S, n_kv, 16 * n_vchunks) F16 bits), zero weights skipped: the 32 slots of
        _weighted_values, whose other keys have weight 0. acc (32, hd_v) starts zeroed.
        Keys in order: V streams from memory in order (slot by slot it was 32 rows apart)."""
        sig = types.void(w, lo, hi, v_bits, g, acc)

        def codegen(context, b, sig, args):
            f32, i64 = ir.FloatType(), ir.IntType(64)
            vbase, vstride = _kv_head(context, b, sig.args[3], args[3], args[4])
            wp = _f32_ptr(context, b, sig.args[0], args[0])
            aa = context.make_array(sig.args[5])(context, b, args[5])
            abase = b.bitcast(aa.data, ir.IntType(8).as_pointer())
            astride = cgutils.unpack_tuple(b, aa.strides)[0]
            v16 = ir.VectorType(f32, 16)
            lo, hi = args[1], args[2]

            def key(m, accs):
                j = b.add(lo, m)
                wj = b.load(b.gep(wp, [j]), align=4)
                with b.if_then(b.fcmp_unordered("!=", wj, ir.Constant(f32, 0.0))):
                    wv = b.shuffle_vector(b.insert_element(ir.Constant(v16, None), wj, ir.Constant(ir.IntType(32), 0)),
                                          ir.Constant(v16, None), ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))
                    vrow = b.gep(vbase, [b.mul(j, vstride)])
                    arow = b.gep(abase, [b.mul(b.and_(j, ir.Constant(i64, 31)), astride)])
                    for c in range(n_vchunks):
                        ap = b.bitcast(b.gep(arow, [ir.Constant(i64, 64 * c)]), v16.as_pointer())
                        vf = _f16_vec(b, b.gep(vrow, [ir.Constant(i64, 32 * c)]), 16)
                        # the product of two F16 values is exact: fma rounds as the add alone
                        b.store(_fma_ir(b, vf, wv, b.load(ap, align=4)), ap, align=4)
                return []
            _counted_loop(b, b.sub(hi, lo), 1, [], key, "vkey")
            return context.get_dummy_value()
        return sig, codegen
    return weighted_slots


_kq_dots_1, _kq_dots_2, _kq_dots_4, _kq_dots_8 = (_make_kq_dots(c) for c in (1, 2, 4, 8))
_wslots_2, _wslots_4, _wslots_8, _wslots_16 = (_make_weighted_slots(c) for c in (2, 4, 8, 16))


@njit(inline="always", **_JIT)
def _kq_blocks(q16, k_bits, g, n_blocks, w, hd):
    """_make_kq_dots' kernel for head size hd (a constant where inlined: one branch stays)."""
    if hd == 64:
        _kq_dots_2(q16, k_bits, g, n_blocks, w)
    elif hd == 128:
        _kq_dots_4(q16, k_bits, g, n_blocks, w)
    elif hd == 256:
        _kq_dots_8(q16, k_bits, g, n_blocks, w)
    else:
        _kq_dots_1(q16, k_bits, g, n_blocks, w)


@njit(inline="always", **_JIT)
def _weighted_blocks(w, lo, hi, v_bits, g, acc, hdv):
    """_make_weighted_slots' kernel for value size hdv (a constant where inlined)."""
    if hdv == 64:
        _wslots_4(w, lo, hi, v_bits, g, acc)
    elif hdv == 128:
        _wslots_8(w, lo, hi, v_bits, g, acc)
    elif hdv == 256:
        _wslots_16(w, lo, hi, v_bits, g, acc)
    else:
        _wslots_2(w, lo, hi, v_bits, g, acc)


@njit(**_JIT)
def _seen_slots(kpos, qpos, window):
    """(n_tok, 2): for each query, the slots from the first to the last key it sees, lo..hi
    (a sliding window sees a short run of a long cache); lo = hi where it sees none. lo is
    rounded down to a multiple of 8: the softmax sums its weights in groups of 8 slots
    counted from slot 0, and groups counted from elsewhere round differently."""
    seen = np.zeros((qpos.shape[0], 2), np.int64)
    for t in range(qpos.shape[0]):
        lo, hi = kpos.shape[0], 0
        for j in range(kpos.shape[0]):
            if _allowed(kpos[j], qpos[t], window):
                lo = min(lo, j)
                hi = j + 1
        lo = min(lo, hi)
        seen[t, 0], seen[t, 1] = lo - lo % 8, hi
    return seen


@njit(inline="always", **_JIT)
def _attend_one(q16, k_bits, v_bits, g, kpos, qp, window, kq_scale, lo, hi, w, out, hd, hdv):
    """out = attention of one query row and head, the numbers of _scores_and_weights and
    _weighted_values, computing only the slots lo..hi (_seen_slots): the others have weight
    0. w: scratch for a weight per slot. hd, hdv: the head sizes, constants of the kernel
    it is inlined into (only their 16-key kernels are compiled)."""
    if hi <= lo:
        out[:] = 0.0
        return
    nb = (hi - lo) // KEYS
    _kq_blocks(q16, k_bits[lo:], g, nb, w[lo:], hd)
    for j in range(lo + nb * KEYS, hi):
        w[j] = _dot_f16_32(k_bits[j, g], q16, q16.shape[0])
    _softmax_f16(w[lo:hi], kpos[lo:hi], qp, window, kq_scale)
    acc = np.zeros((32, v_bits.shape[2]), np.float32)
    _weighted_blocks(w, lo, hi, v_bits, g, acc, hdv)
    _reduce_slots(acc, out)


@njit(**_JIT)
def _softmax_f16(w, kpos, qp, window, kq_scale):
    """In place: w[j] = key j's dot (float32) -> its softmax weight rounded to F16, steps
    2 and 3a of the module docstring, in passes that vectorize (the exp branch-free:
    below 2^-126 it is 0, as ggml's). Masked keys get 0 whatever w[j] held."""
    n = w.shape[0]
    neg_inf = np.float32(-np.inf)
    mx = neg_inf
    for j in range(n):
        if _allowed(kpos[j], qp, window):
            s = np.float32(w[j] * kq_scale)
            w[j] = s
            if s > mx:
                mx = s
        else:
            w[j] = neg_inf
    for j in range(n):
        nn, jj = _expf_parts(np.float32(w[j] - mx))
        k = _pow2_f64(np.int64(max(nn, np.float32(-127.0))))
        e = np.float32(np.float64(np.float32(jj + np.float32(1.0))) * k)
        w[j] = np.float32(0.0) if nn < -126.0 else e
    total = 0.0
    n8 = n - n % 8
    for c in range(0, n8, 8):
        total += np.float64(_hsum8(w[c], w[c + 1], w[c + 2], w[c + 3], w[c + 4], w[c + 5], w[c + 6], w[c + 7]))
    if n8 < n:
        e = np.zeros(8, np.float32)
        for lane in range(n - n8):
            e[lane] = w[n8 + lane]
        total += np.float64(_hsum8(e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]))
    inv = np.float32(1.0 / total)
    for j in range(n):
        if _VECTOR_F16:
            w[j] = _via_f16(np.float32(w[j] * inv))
        else:
            w[j] = f16_round(np.float32(w[j] * inv))


_SLOTS = 32  # ggml_vec_dot_f16's 4 x 8 accumulators, passed at run time (see the KQ loop)


def _make_attention_rows(hd: int, hdv: int):
    """The attention kernel for heads of hd (K) and hdv (V) elements: the 16-key kernels
    for those sizes where they exist (32, 64, 128, 256; with F16C), else the per-key loops
    (hd = hdv = 0). One kernel per head size, compiled on first use: a model compiles only
    its own (hd, hdv are closure constants, so the other sizes' branches are pruned before
    typing; Numba's cache keys a closure by their values)."""
    HD, HDV = hd, hdv

    @njit(parallel=True, **_JIT)
    def attention_rows(q16, k_bits, v_bits, kpos, qpos, window, kq_scale, out, n_slots):
        """One job per (query row, head): many queries (prefill) keep every thread busy."""
        n_tok, n_head, _ = q16.shape
        group = n_head // k_bits.shape[1]
        seen = _seen_slots(kpos, qpos, window)
        for job in prange(n_tok * n_head):
            t = job // n_head
            h = job % n_head
            w = np.empty(k_bits.shape[0], np.float32)
            if HD > 0:
                _attend_one(q16[t, h], k_bits, v_bits, h // group, kpos, qpos[t], window, kq_scale,
                            seen[t, 0], seen[t, 1], w, out[t, h], HD, HDV)
            else:
                _scores_and_weights(q16[t, h], k_bits, h // group, kpos, qpos[t], window, kq_scale, w, n_slots)
                _weighted_values(w, v_bits, h // group, out[t, h])
    return attention_rows


_ROWS_KERNELS: dict = {}
_FAST_HEAD_SIZES = (32, 64, 128, 256)


def attention_kernel(hd: int, hdv: int):
    """The compiled attention kernel for these head sizes (made on first use)."""
    key = (hd, hdv) if _VECTOR_F16 and hd in _FAST_HEAD_SIZES and hdv in _FAST_HEAD_SIZES else (0, 0)
    kernel = _ROWS_KERNELS.get(key)
    if kernel is None:
        kernel = _ROWS_KERNELS[key] = _make_attention_rows(*key)
        compile_progress.compile_elsewhere(kernel, lambda: _compile_in_process(hd, hdv))
    return kernel


def _compile_in_process(hd: int, hdv: int) -> subprocess.Popen:
    """Start a Python process that compiles the attention kernel for these head sizes into
    Numba's on-disk cache (compile_progress: a cold start's second process)."""
    from numba.core import config

    env = dict(os.environ)
    if config.CACHE_DIR:
        env["NUMBA_CACHE_DIR"] = config.CACHE_DIR
    code = f"from edgeinfer.kernels_cpu import kv_attention; kv_attention.compile_here({int(hd)}, {int(hdv)})"
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def compile_here(hd: int, hdv: int) -> None:
    """Compile (or load) the attention kernel for these head sizes with the signature
    `attention` calls it with, on a few dummy rows."""
    n_slots = 32
    q = np.ones((2, 2, hd), np.float32)
    k, v = np.ones((n_slots, 1, hd), np.float16), np.ones((n_slots, 1, hdv), np.float16)
    attention(q, k, v, np.arange(n_slots), np.array([n_slots - 2, n_slots - 1]), 1.0, 0)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, kpos: np.ndarray, qpos: np.ndarray,
              kq_scale: float, window: int = 0) -> np.ndarray:
    """Causal GQA attention -> (n_tok, n_head, hd_v) float32.

    q (n_tok, n_head, hd) float32; k (S, n_kv_head, hd) and v (S, n_kv_head, hd_v) float16
    (the cache's layer view, slot order); kpos (S,) the keys' positions, qpos (n_tok,) the
    queries'. A query at p sees keys with kpos <= p and, with window > 0, p - kpos < window.
    """
    if k.dtype != np.float16 or v.dtype != np.float16:
        raise TypeError(f"attention reads an F16 cache, got K {k.dtype} and V {v.dtype}")
    apply_threads()
    q16 = round_f16(q)
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), np.float32)
    kernel = attention_kernel(q.shape[2], v.shape[2])
    if compile_progress._pending:
        compile_progress.wait_for(kernel)
    kernel(q16, np.ascontiguousarray(k).view(np.uint16), np.ascontiguousarray(v).view(np.uint16),
           np.ascontiguousarray(kpos, dtype=np.int64), np.ascontiguousarray(qpos, dtype=np.int64), int(window),
           np.float32(kq_scale), out, _SLOTS)
    return out


# Above this many query rows (long prefill chunks) the exact per-key loops cost more than
# they are worth: llama.cpp itself switches to other kernels for batches, so there is no
# bit-exact target there. `attention_blas` does the same math with matrix products.
EXACT_MAX_QUERIES = 64


_BLAS_QUERY_BLOCK = 64  # query rows per block: each block multiplies only the keys it sees


def attention_blas(q: np.ndarray, k: np.ndarray, v: np.ndarray, kpos: np.ndarray, qpos: np.ndarray,
                   kq_scale: float, window: int = 0) -> np.ndarray:
    """`attention` through BLAS matrix products: same roundings at the boundaries (Q and
    the weights in F16, sums in double), float order of the BLAS library inside.

    The queries go in blocks of _BLAS_QUERY_BLOCK rows, each against only the keys it can
    see (causal and window bounds of its positions): a prefill chunk does about half the
    products of the full square. With -t > 1 the blocks are shared out across the worker
    threads by their cost (BLAS itself runs single-threaded beside Numba; numpy releases
    the GIL in every large op here)."""
    qpos = np.asarray(qpos)
    kpos = np.asarray(kpos)
    if window:  # a sliding-window layer never looks further back than its window
        keep = kpos > np.min(qpos) - window
        if not keep.all():
            k, v, kpos = k[keep], v[keep], kpos[keep]
    # once for all threads: (n_kv, hd, S) and (n_kv, S, hd_v) float32, Q rounded to F16
    k = f16_to_f32(k).transpose(1, 2, 0)
    v = f16_to_f32(v).transpose(1, 0, 2)
    q = round_f16(q)
    n = q.shape[0]
    out = np.empty((n, q.shape[1], v.shape[2]), np.float32)
    blocks = []  # (first row, end row, the keys' slots: a slice or an index array)
    for a in range(0, n, _BLAS_QUERY_BLOCK):
        b = min(a + _BLAS_QUERY_BLOCK, n)
        seen = kpos <= qpos[a:b].max()
        if window:
            seen &= kpos > qpos[a:b].min() - window
        blocks.append((a, b, _as_slice(np.flatnonzero(seen))))

    def run(mine):
        for a, b, keys in mine:
            out[a:b] = _attention_blas_rows(q[a:b], k[:, :, keys], v[:, keys], kpos[keys], qpos[a:b],
                                            kq_scale, window)

    n_threads = get_threads()
    if n_threads > 1 and len(blocks) > 1:
        list(worker_pool(n_threads).map(run, _share_out(blocks, n_threads)))
    else:
        run(blocks)
    return out


def _as_slice(idx: np.ndarray):
    """A run of consecutive slots as a slice (a view, no copy); else the index array."""
    if idx.size and idx[-1] - idx[0] + 1 == idx.size:
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _share_out(blocks: list, n_parts: int) -> list[list]:
    """Blocks into n_parts lists of about equal cost (rows x keys), largest first to the
    least loaded."""
    def cost(blk):
        keys = blk[2]
        return (blk[1] - blk[0]) * (keys.stop - keys.start if isinstance(keys, slice) else len(keys))
    parts: list[list] = [[] for _ in range(n_parts)]
    load = [0] * n_parts
    for blk in sorted(blocks, key=cost, reverse=True):
        i = load.index(min(load))
        parts[i].append(blk)
        load[i] += cost(blk)
    return [p for p in parts if p]


def _attention_blas_rows(q, k, v, kpos, qpos, kq_scale, window):
    # q (n, n_head, hd) already F16-rounded; k (n_kv, hd, S), v (n_kv, S, hd_v) float32
    n, n_head, hd = q.shape
    n_kv = k.shape[0]
    group = n_head // n_kv
    # one GEMM per KV head for its whole group of query heads: rows (head in group, query)
    qg = np.ascontiguousarray(q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3)).reshape(n_kv, group * n, hd)
    scores = qg @ k  # (n_kv, group * n, S)
    if kq_scale != 1.0:
        scores *= np.float32(kq_scale)
    _softmax_rows_f16(scores.reshape(-1, scores.shape[-1]), np.ascontiguousarray(kpos, dtype=np.int64),
                      np.ascontiguousarray(qpos, dtype=np.int64), int(window))
    out = (scores @ v).reshape(n_head, n, -1)  # rows were (KV head, head in group, query)
    return np.ascontiguousarray(out.transpose(1, 0, 2), dtype=np.float32)
