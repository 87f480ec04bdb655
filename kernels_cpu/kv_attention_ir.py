"""The decode attention's LLVM-IR intrinsics: ggml_vec_dot_f16 in its exact order, 16 keys a step.

kv_attention.py's kernels call these; the order of every float op is llama.cpp's (see
kv_attention.py's docstring), so each intrinsic states the sums it keeps. On AVX-512 CPUs
they keep the order of llama.cpp's AVX-512 build (ggml_math.AVX512): ggml_vec_dot_f16's
four accumulators are 16 lanes wide (64 slots) and end in _mm512_reduce_add_ps.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .ggml_math import AVX512, SLOTS
from .ir_helpers import counted_loop


@intrinsic
def dot_f16_32(typingctx, k_row, q, n):
    """ggml_vec_dot_f16 of F16 bits k_row (1-D uint16, C) with float32 q over the first n
    elements (a multiple of SLOTS), in its exact order: four <8 x float> accumulators fed in
    turn, then GGML_F32x8_REDUCE (AVX-512: four <16 x float>, GGML_F32x16_REDUCE). Emitted
    only where the CPU has F16C (vcvtph2ps)."""
    sig = types.float32(k_row, q, n)

    def codegen(context, builder, sig, args):
        f32, i64 = ir.FloatType(), ir.IntType(64)
        lanes = SLOTS // 4
        v8f = ir.VectorType(f32, lanes)
        ka = context.make_array(sig.args[0])(context, builder, args[0])
        qa = context.make_array(sig.args[1])(context, builder, args[1])
        kp = builder.bitcast(ka.data, ir.IntType(16).as_pointer())
        qp = builder.bitcast(qa.data, f32.as_pointer())
        n = args[2]
        zero = ir.Constant(v8f, [0.0] * lanes)

        def step(i, accs):
            new = []
            for j, a in enumerate(accs):
                off = builder.add(i, ir.Constant(i64, lanes * j))
                kv = builder.load(builder.bitcast(builder.gep(kp, [off]), ir.VectorType(ir.IntType(16), lanes).as_pointer()), align=2)
                kf = builder.fpext(builder.bitcast(kv, ir.VectorType(ir.HalfType(), lanes)), v8f)
                qv = builder.load(builder.bitcast(builder.gep(qp, [off]), v8f.as_pointer()), align=4)
                new.append(builder.fadd(a, builder.fmul(kf, qv)))  # F16 x F16 products are exact: = fma
            return new
        fin = counted_loop(builder, n, SLOTS, [zero] * 4, step, "dot16")
        x0 = builder.fadd(builder.fadd(fin[0], fin[2]), builder.fadd(fin[1], fin[3]))

        def lane(v, k):
            return builder.extract_element(v, ir.Constant(ir.IntType(32), k))
        if AVX512:   # _mm512_reduce_add_ps: the 256-bit halves, the 128-bit ones, (0 + 2) + (1 + 3)
            h = [builder.fadd(builder.fadd(lane(x0, k), lane(x0, k + 8)), builder.fadd(lane(x0, k + 4), lane(x0, k + 12)))
                 for k in range(4)]
            return builder.fadd(builder.fadd(h[0], h[2]), builder.fadd(h[1], h[3]))
        t = [builder.fadd(lane(x0, k), lane(x0, k + 4)) for k in range(4)]
        return builder.fadd(builder.fadd(t[0], t[1]), builder.fadd(t[2], t[3]))
    return sig, codegen


@intrinsic
def via_f16(typingctx, x):
    """float32 -> nearest F16 -> float32 (vcvtps2ph, round to nearest even; F16C only)."""
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


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
    """One key's ggml_vec_dot_f16 with q (hd/SLOTS vectors <SLOTS x float>) up to its last
    steps: the slots summed over the chunks in order, then slots l and SLOTS/2 + l added
    (AVX-512: then lanes l and 16 + l, GGML_F32x16_REDUCE's (x0 + x2) + (x1 + x3)): the
    <16 x float> whose lanes _reduce16_keys finishes."""
    f32 = ir.FloatType()
    acc = ir.Constant(ir.VectorType(f32, SLOTS), [0.0] * SLOTS)
    for c, qc in enumerate(qs):
        kf = _f16_vec(b, b.gep(kptr, [ir.Constant(ir.IntType(64), 2 * SLOTS * c)]), SLOTS)
        # F16 x F16 products are exact in float32, so an fma rounds as the add alone; the
        # first add from zero stays (0 + -0 is +0)
        acc = b.fadd(acc, b.fmul(kf, qc)) if c == 0 else _fma_ir(b, kf, qc, acc)
    half = SLOTS // 2
    y = b.fadd(_shuf(b, acc, acc, range(half)), _shuf(b, acc, acc, range(half, SLOTS)))
    if AVX512:
        return b.fadd(_shuf(b, y, y, range(16)), _shuf(b, y, y, range(16, 32)))
    return y


def _reduce16_keys(b, ys):
    """16 keys' _dot_lanes vectors -> <16 x float> of their dots, key k in lane k, each
    lane by the reduction's own adds. AVX2 (reduce32): x_i = y_i + y_{8+i},
    t_k = x_k + x_{k+4}, (t0 + t1) + (t2 + t3); AVX-512 (_mm512_reduce_add_ps of y):
    h_i = y_i + y_{8+i}, g_k = h_k + h_{k+4}, (g0 + g2) + (g1 + g3). Each round pairs two
    vectors, so it also transposes."""
    def rounds(vs, lo, hi):
        return [b.fadd(_shuf(b, x, y, lo), _shuf(b, x, y, hi)) for x, y in zip(vs[0::2], vs[1::2])]
    u = rounds(ys, [*range(8), *range(16, 24)], [*range(8, 16), *range(24, 32)])        # x of 2 keys
    v = rounds(u, [i + 8 * q for q in range(4) for i in range(4)], [i + 4 + 8 * q for q in range(4) for i in range(4)])
    if AVX512:   # 4 lanes a key: (0 + 2), (1 + 3), then their sum
        w = rounds(v, [4 * q + i for q in range(8) for i in (0, 1)], [4 * q + i for q in range(8) for i in (2, 3)])
    else:
        w = rounds(v, list(range(0, 32, 2)), list(range(1, 32, 2)))                      # t0+t1, t2+t3
    return rounds(w, list(range(0, 32, 2)), list(range(1, 32, 2)))[0]


def _kv_head(context, b, ty, val, g):
    """(i8* to KV head g of slot 0, the slot stride) of a (S, n_kv, d) F16-bits cache array."""
    a = context.make_array(ty)(context, b, val)
    strides = cgutils.unpack_tuple(b, a.strides)
    return b.gep(b.bitcast(a.data, ir.IntType(8).as_pointer()), [b.mul(g, strides[1])]), strides[0]


def _f32_ptr(context, b, ty, val):
    return b.bitcast(context.make_array(ty)(context, b, val).data, ir.FloatType().as_pointer())


def _make_kq_dots(hd):
    n_chunks = hd // SLOTS

    @intrinsic
    def kq_dots(typingctx, q16, k_bits, g, n_blocks, w):
        """w[j] = the ggml_vec_dot_f16 of key j (KV head g of k_bits, (S, n_kv, hd) F16 bits,
        hd a multiple of SLOTS) with q16 (F16 values as float32) for j < KEYS * n_blocks:
        for each key exactly what dot_f16_32 returns, 16 keys a step."""
        sig = types.void(q16, k_bits, g, n_blocks, w)

        def codegen(context, b, sig, args):
            f32, i64 = ir.FloatType(), ir.IntType(64)
            kbase, kstride = _kv_head(context, b, sig.args[1], args[1], args[2])
            v32 = ir.VectorType(f32, SLOTS)
            qp, wp = _f32_ptr(context, b, sig.args[0], args[0]), _f32_ptr(context, b, sig.args[4], args[4])
            qs = [b.load(b.bitcast(b.gep(qp, [ir.Constant(i64, SLOTS * c)]), v32.as_pointer()), align=4)
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
                counted_loop(b, ir.Constant(i64, KEYS), KEY_STEP, [], keys, "kqkeys")
                ys = [b.load(b.gep(ybuf, [ir.Constant(i64, k)]), align=4) for k in range(KEYS)]
                out = b.bitcast(b.gep(wp, [j0]), ir.VectorType(f32, KEYS).as_pointer())
                b.store(_reduce16_keys(b, ys), out, align=4)
                return []
            counted_loop(b, args[3], 1, [], block, "kq")
            return context.get_dummy_value()
        return sig, codegen
    return kq_dots


def _make_weighted_slots(n_vchunks):
    @intrinsic
    def weighted_slots(typingctx, w, lo, hi, v_bits, g, acc):
        """acc[j % SLOTS, :] += w[j] * V[j] for keys lo <= j < hi in order (KV head g of v_bits,
        (S, n_kv, 16 * n_vchunks) F16 bits), zero weights skipped: the slots of
        _weighted_values, whose other keys have weight 0. acc (SLOTS, hd_v) starts zeroed.
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
                    arow = b.gep(abase, [b.mul(b.and_(j, ir.Constant(i64, SLOTS - 1)), astride)])
                    for c in range(n_vchunks):
                        ap = b.bitcast(b.gep(arow, [ir.Constant(i64, 64 * c)]), v16.as_pointer())
                        vf = _f16_vec(b, b.gep(vrow, [ir.Constant(i64, 32 * c)]), 16)
                        # the product of two F16 values is exact: fma rounds as the add alone
                        b.store(_fma_ir(b, vf, wv, b.load(ap, align=4)), ap, align=4)
                return []
            counted_loop(b, b.sub(hi, lo), 1, [], key, "vkey")
            return context.get_dummy_value()
        return sig, codegen
    return weighted_slots


# the head sizes with 16-key kernels: multiples of SLOTS (AVX-512: hd 32 takes the per-key loop)
KQ_HEAD_SIZES = tuple(hd for hd in (32, 64, 128, 256) if hd % SLOTS == 0)
kq_dots_32, kq_dots_64, kq_dots_128, kq_dots_256 = (_make_kq_dots(hd) if hd % SLOTS == 0 else None
                                                    for hd in (32, 64, 128, 256))
wslots_2, wslots_4, wslots_8, wslots_16 = (_make_weighted_slots(c) for c in (2, 4, 8, 16))


# ----------------------------------------------------------------------------- long prompts' softmax
@intrinsic
def scale_and_max16(typingctx, row, scale, seen, n):
    """row[:n] *= scale in place (n a multiple of 16); returns the maximum of the scaled
    values where seen[j] (bools), -inf if none. 16 lanes of vmaxps: Numba leaves a float
    max loop scalar, whatever its fastmath flags (3-4x slower)."""
    sig = types.float32(row, scale, seen, n)

    def codegen(context, builder, sig, args):
        b = builder
        f32, i8 = ir.FloatType(), ir.IntType(8)
        v16f, v16b = ir.VectorType(f32, 16), ir.VectorType(i8, 16)
        rp = b.bitcast(context.make_array(sig.args[0])(context, b, args[0]).data, f32.as_pointer())
        sp = b.bitcast(context.make_array(sig.args[2])(context, b, args[2]).data, i8.as_pointer())
        ninf = ir.Constant(v16f, [float("-inf")] * 16)
        scale16 = b.shuffle_vector(b.insert_element(ir.Constant(v16f, ir.Undefined), args[1], ir.Constant(ir.IntType(32), 0)),
                                   ir.Constant(v16f, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))
        mod = b.module
        vmax = mod.globals.get("llvm.maxnum.v16f32") or ir.Function(mod, ir.FunctionType(v16f, [v16f, v16f]),
                                                                   "llvm.maxnum.v16f32")

        def step(i, accs):
            p = b.bitcast(b.gep(rp, [i]), v16f.as_pointer())
            v = b.fmul(b.load(p, align=4), scale16)
            b.store(v, p, align=4)
            s = b.load(b.bitcast(b.gep(sp, [i]), v16b.as_pointer()), align=1)
            keep = b.icmp_unsigned("!=", s, ir.Constant(v16b, [0] * 16))
            return [b.call(vmax, [accs[0], b.select(keep, v, ninf)])]
        acc = counted_loop(b, args[3], 16, [ninf], step, "smax")[0]
        m = b.extract_element(acc, ir.Constant(ir.IntType(32), 0))
        for lane in range(1, 16):   # maxnum: the order of a maximum does not matter
            e = b.extract_element(acc, ir.Constant(ir.IntType(32), lane))
            m = b.select(b.fcmp_ordered(">", e, m), e, m)
        return m
    return sig, codegen
