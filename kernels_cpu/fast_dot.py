"""Fast paths for every quantized type, written as LLVM vector IR.

Numba's auto-vectorizer leaves the integer block dots mostly scalar, so each row's
whole loop over blocks is emitted as IR through `numba.extending.intrinsic`: an
`<8 x float>` accumulator per row, per block u8 x s8 products summed in pairs to i16
(vpmaddubsw), multiplied by the sub-block scales and summed to i32 (vpmaddwd), one
fma per block with the float scales, one horizontal sum per row. Numba only runs
`prange` over rows. The same per-type value extraction also writes float rows for
the prefill GEMM (`dequantize_fast`).

Target CPU: x86 AVX2 intrinsics (pmaddubsw, pmaddwd, psignb, pshufb) are emitted only
when the CPU Numba compiles for has AVX2 (they abort the process elsewhere); other
targets get portable IR for the same arithmetic (no F16C: fp16 scales converted with
integer ops). Loads use align 1: blocks are not aligned (34 bytes for Q8_0).
Pair sums never saturate: each caller bounds them in a comment.

Intrinsics and their callers stay in this file: `cache=True` only tracks the cached
function's own file.
"""
from __future__ import annotations

from types import FunctionType

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .quant_kernels import IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q4_K_X8, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from .threads import get_threads

llvm.initialize_native_asmparser()   # load_f16's one inline `vmovd` needs it

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16T, F32T = ir.HalfType(), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _const_vec(t, n, values):
    return ir.Constant(_vec(t, n), list(values) if hasattr(values, "__iter__") else [values] * n)


def _mask(idx):
    return ir.Constant(_vec(I32, len(idx)), list(idx))


def has_vnni_features(feats: set[str]) -> bool:
    """Whether a CPU with these LLVM features has 256-bit vpdpbusd (AVX512-VNNI with VL, or AVX-VNNI)."""
    return "+avxvnni" in feats or {"+avx512vnni", "+avx512vl"} <= feats


def _as_i8(u: int) -> int:
    """An unsigned byte value (0..255) as the signed i8 constant with the same bits."""
    return ((u + 128) & 255) - 128


class _IR:
    """Small helpers over an IRBuilder."""

    def __init__(self, builder: ir.IRBuilder, feats: set[str]):
        self.b = builder
        self.avx2 = "+avx2" in feats
        self.avx512bw = "+avx512bw" in feats
        self.f16c = "+f16c" in feats
        self.vnni = has_vnni_features(feats)

    def ptr(self, base, off):
        """base (i8*) + off bytes."""
        return self.b.gep(base, [off])

    def load(self, base, off, ty):
        p = self.b.bitcast(self.ptr(base, off), ty.as_pointer())
        return self.b.load(p, align=1)

    def _f16_pair(self, bits32):
        """i32 holding two fp16 -> <4 x float> [lo, hi, 0, 0] (F16C only).

        Moved into the vector register with `vmovd`, which writes all of it: a plain half
        load becomes `vpinsrw` into whatever register LLVM picks, often the row's
        accumulator, chaining each block's scale conversion to the previous block's fma
        (it halved the Q8_0 and Q4_K kernels' speed)."""
        b = self.b
        v = b.asm(ir.FunctionType(_vec(I32, 4), [I32]), "vmovd $1, $0", "=x,r", [bits32], False)
        v8 = b.bitcast(v, _vec(F16T, 8))
        return b.fpext(b.shuffle_vector(v8, v8, _mask(range(4))), _vec(F32T, 4))

    def f16_value(self, v16):
        """An i16 of fp16 bits (a value, not memory) -> float."""
        b = self.b
        if self.f16c:
            return b.fpext(b.bitcast(v16, F16T), F32T)
        ptr = cgutils.alloca_once(b, I16)   # load_f16 reads memory; entry block: promoted
        b.store(v16, ptr)
        return self.load_f16(b.bitcast(ptr, I8.as_pointer()), _c64(0))

    def load_f16(self, base, off):
        if self.f16c:   # vcvtph2ps
            f4 = self._f16_pair(self.b.zext(self.load(base, off, I16), I32))
            return self.b.extract_element(f4, ir.Constant(I32, 0))
        # Without F16C, LLVM would call __extendhfsf2, which Numba's JIT does not provide:
        # convert with integer ops (F. Giesen's half_to_float).
        b = self.b
        h = b.zext(self.load(base, off, I16), I32)
        c = lambda v: ir.Constant(I32, v)  # noqa: E731
        u = b.shl(b.and_(h, c(0x7FFF)), c(13))
        e = b.and_(u, c(0x0F800000))
        u1 = b.add(u, c(112 << 23))
        inf_nan = b.bitcast(b.add(u1, c(112 << 23)), F32T)
        denorm = b.fsub(b.bitcast(b.add(u1, c(1 << 23)), F32T), b.bitcast(c(113 << 23), F32T))
        f = b.select(b.icmp_unsigned("==", e, c(0x0F800000)), inf_nan,
                     b.select(b.icmp_unsigned("==", e, c(0)), denorm, b.bitcast(u1, F32T)))
        sign = b.shl(b.and_(h, c(0x8000)), c(16))
        return b.bitcast(b.or_(b.bitcast(f, I32), sign), F32T)

    def load_f16_splat(self, base, off, n):
        """The fp16 at base+off as float in all n lanes.

        With F16C this is vpbroadcastw + vcvtph2ps, both writing whole registers. A scalar
        half load instead becomes `vpinsrw` into an arbitrary register (often the row's
        accumulator), which chains each block's scale to the previous block's fma.
        """
        if not self.f16c or n != 8:
            return self.splat(self.load_f16(base, off), n)
        b = self.b
        v = self.splat(b.bitcast(self.load(base, off, I16), F16T), 8)
        return b.fpext(v, _vec(F32T, 8))

    def load_f16x2(self, base, off):
        """Two adjacent fp16 at base+off -> <4 x float> [a, b, 0, 0]."""
        b = self.b
        if not self.f16c:
            z = ir.Constant(_vec(F32T, 4), [0.0] * 4)
            z = b.insert_element(z, self.load_f16(base, off), ir.Constant(I32, 0))
            return b.insert_element(z, self.load_f16(base, b.add(off, _c64(2))), ir.Constant(I32, 1))
        return self._f16_pair(self.load(base, off, I32))

    def narrow_i32_i16(self, v):
        """<16 x i32> (each fits i16) -> <16 x i16>, same lane order."""
        b = self.b
        if self.avx2:  # vpackssdw interleaves 128-bit halves; vpermq puts them back
            p = self._x86("llvm.x86.avx2.packssdw", _vec(I16, 16), [self.half(v, 0), self.half(v, 1)])
            q = b.bitcast(p, _vec(I64, 4))
            return b.bitcast(b.shuffle_vector(q, q, _mask([0, 2, 1, 3])), _vec(I16, 16))
        return b.trunc(v, _vec(I16, 16))

    def pick_i16_halves(self, v, j, k):
        """<16 x i16> whose halves both hold the same 8 values -> lane j in the low 8
        lanes, lane k in the high 8 (one vpshufb on AVX2)."""
        b = self.b
        if self.avx2:
            m = _const_vec(I8, 32, [2 * j, 2 * j + 1] * 8 + [2 * k, 2 * k + 1] * 8)
            vb = b.bitcast(v, _vec(I8, 32))
            return b.bitcast(self._x86("llvm.x86.avx2.pshuf.b", _vec(I8, 32), [vb, m]), _vec(I16, 16))
        return b.shuffle_vector(v, v, _mask([j] * 8 + [k + 8] * 8))

    def f16_lanes(self, v16):
        """<8 x i16> fp16 bits -> <8 x float> (one vcvtph2ps with F16C)."""
        b = self.b
        if self.f16c:
            return b.fpext(b.bitcast(v16, _vec(F16T, 8)), _vec(F32T, 8))
        out = ir.Constant(_vec(F32T, 8), [0.0] * 8)
        for k in range(8):  # the integer conversion, lane by lane
            out = b.insert_element(out, self.f16_value(b.extract_element(v16, ir.Constant(I32, k))),
                                   ir.Constant(I32, k))
        return out

    def bcast_u8_as_i16(self, bytes2, j):
        """<32 x i8> (16 bytes repeated in both halves) -> <16 x i16>, every lane byte j
        zero-extended: one vpshufb on AVX2."""
        b = self.b
        if self.avx2:
            m = _const_vec(I8, 32, [j, -128] * 16)    # -128 (0x80): write a zero byte
            return b.bitcast(self._x86("llvm.x86.avx2.pshuf.b", _vec(I8, 32), [bytes2, m]), _vec(I16, 16))
        return b.zext(b.shuffle_vector(bytes2, bytes2, _mask([j] * 16)), _vec(I16, 16))

    def splat(self, scalar, n):
        v = self.b.insert_element(ir.Constant(_vec(scalar.type, 1), ir.Undefined), scalar, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, v, _mask([0] * n))

    def half(self, v, which):
        n = v.type.count // 2
        return self.b.shuffle_vector(v, v, _mask(range(which * n, which * n + n)))

    def pairs(self, v):
        """Add neighbouring lanes: <2n x i32> -> <n x i32> (the pmaddwd shape)."""
        n = v.type.count // 2
        ev = self.b.shuffle_vector(v, v, _mask(range(0, 2 * n, 2)))
        od = self.b.shuffle_vector(v, v, _mask(range(1, 2 * n, 2)))
        return self.b.add(ev, od)

    def _x86(self, name, ret, args):
        mod = self.b.module
        fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ret, [a.type for a in args]), name)
        return self.b.call(fn, args)

    def maddubs(self, a8, x8):
        """<32 x i8> a (unsigned) . <32 x i8> x (signed) -> <16 x i16> pair sums (vpmaddubsw).

        Callers keep |a_even*x_even + a_odd*x_odd| < 2^15, so the AVX2 instruction's
        saturation never triggers and the portable version needs none.
        """
        if self.avx2:
            return self._x86("llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16), [a8, x8])
        b = self.b
        p = b.mul(b.zext(a8, _vec(I16, 32)), b.sext(x8, _vec(I16, 32)))
        ev = b.shuffle_vector(p, p, _mask(range(0, 32, 2)))
        od = b.shuffle_vector(p, p, _mask(range(1, 32, 2)))
        return b.add(ev, od)

    def dpbusd(self, acc, a_u8, x_s8):
        """acc + <32 x i8> unsigned a . <32 x i8> signed x summed in fours -> <8 x i32>
        (one vpdpbusd; only where self.vnni)."""
        b = self.b
        return self._x86("llvm.x86.avx512.vpdpbusd.256", _vec(I32, 8),
                         [acc, b.bitcast(a_u8, _vec(I32, 8)), b.bitcast(x_s8, _vec(I32, 8))])

    def madd_i16(self, s16, m16):
        """<16 x i16> . <16 x i16> -> <8 x i32> pair sums (vpmaddwd)."""
        if self.avx2:
            return self._x86("llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [s16, m16])
        b = self.b
        return self.pairs(b.mul(b.sext(s16, _vec(I32, 16)), b.sext(m16, _vec(I32, 16))))

    def sign_i8(self, x8, w8):
        """x * sign(w) per lane (vpsignb)."""
        if self.avx2:
            return self._x86("llvm.x86.avx2.psign.b", _vec(I8, 32), [x8, w8])
        b = self.b
        zero = _const_vec(I8, 32, 0)
        neg = b.select(b.icmp_signed("<", w8, zero), b.sub(zero, x8), x8)
        return b.select(b.icmp_signed("==", w8, zero), zero, neg)

    def abs_i8(self, w8):
        b = self.b
        zero = _const_vec(I8, 32, 0)
        return b.select(b.icmp_signed("<", w8, zero), b.sub(zero, w8), w8)

    def lut16(self, idx, table):
        """<32 x i8> indices 0..15 -> table[idx] (vpshufb on AVX2; scalar loads elsewhere)."""
        b = self.b
        if self.avx2:
            return self._x86("llvm.x86.avx2.pshuf.b", _vec(I8, 32), [_const_vec(I8, 32, list(table) * 2), idx])
        name = "edgeinfer_lut16_" + "_".join(str(v & 255) for v in table)
        g = b.module.globals.get(name) or cgutils.global_constant(
            b.module, name, ir.Constant(ir.ArrayType(I8, 16), [v & 255 for v in table]))
        out = ir.Constant(_vec(I8, 32), [0] * 32)
        for k in range(32):
            i = b.zext(b.extract_element(idx, ir.Constant(I32, k)), I64)
            v = b.load(b.gep(g, [ir.Constant(I64, 0), i]))
            out = b.insert_element(out, v, ir.Constant(I32, k))
        return out

    def hsum_f32(self, v):
        b = self.b
        while v.type.count > 1:
            v = b.fadd(self.half(v, 0), self.half(v, 1))
        return b.extract_element(v, ir.Constant(I32, 0))

    def prefetch(self, ptr):
        """Read prefetch into all cache levels (llvm.prefetch; a no-op where unsupported)."""
        mod = self.b.module
        fn = mod.globals.get("llvm.prefetch.p0") or ir.Function(
            mod, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0")
        self.b.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])

    def fma(self, a, x, acc):
        mod = self.b.module
        name = f"llvm.fma.v{acc.type.count}f32"
        fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(acc.type, [acc.type] * 3), name)
        return self.b.call(fn, [a, x, acc])


def _target_features(context) -> set[str]:
    """Features of the CPU Numba compiles for (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, else the host).

    x86 AVX2 intrinsics are emitted only where "+avx2" is present (elsewhere they would
    abort the process); Numba keys its on-disk cache by CPU name and this feature string.
    """
    cg = context.codegen()
    feats = getattr(cg, "_tm_features", None)
    if feats is None:
        feats = cg._get_host_cpu_features()
    return set(feats.split(","))


def _array_ptrs(context, builder, sig, args, nrows=1):
    """([rows r, r+step, .. (nrows of them) of w as i8*], xq i8*, xd i8*, xs i8*, nb) from
    (w, r, xq, xd, xs[, step])."""
    w = context.make_array(sig.args[0])(context, builder, args[0])
    r = args[1]
    stride0 = cgutils.unpack_tuple(builder, w.strides)[0]
    base = builder.gep(builder.bitcast(w.data, I8.as_pointer()), [builder.mul(r, stride0)])
    step = builder.mul(args[5], stride0) if len(args) > 5 else stride0   # rows r, r+step, ...
    wrows = [builder.gep(base, [builder.mul(ir.Constant(I64, k), step)]) for k in range(nrows)]
    out = [wrows]
    for k in (2, 3, 4):
        a = context.make_array(sig.args[k])(context, builder, args[k])
        out.append(builder.bitcast(a.data, I8.as_pointer()))
    xd = context.make_array(sig.args[3])(context, builder, args[3])
    nb = cgutils.unpack_tuple(builder, xd.shape)[0]
    return out, nb


def _counted_loop(builder, n, step, inits, body, name):
    """Emit `i = 0; while i < n: accs = body(i, accs); i += step` with the accumulators
    in phis (all at the top of the loop block, as LLVM wants); return their final values
    (inits when n <= 0). body(i, accs) -> new accs, same types."""
    entry = builder.block
    loop = builder.append_basic_block(f"{name}.loop")
    done = builder.append_basic_block(f"{name}.done")
    builder.cbranch(builder.icmp_signed(">", n, ir.Constant(I64, 0)), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    accs = [builder.phi(v.type) for v in inits]
    for a, v in zip(accs, inits):
        a.add_incoming(v, entry)
    new = body(i, accs)
    nxt = builder.add(i, ir.Constant(I64, step))
    end = builder.block
    i.add_incoming(nxt, end)
    for a, v in zip(accs, new):
        a.add_incoming(v, end)
    builder.cbranch(builder.icmp_signed("<", nxt, n), loop, done)
    builder.position_at_end(done)
    outs = []
    for v0, v in zip(inits, new):
        r = builder.phi(v0.type)
        r.add_incoming(v0, entry)
        r.add_incoming(v, end)
        outs.append(r)
    return outs


def _row_loop(context, builder, sig, args, body, with_mins=False, nrows=1, block_bytes=0):
    """Emit `for b in range(nb): acc[k] = body(row k, b, acc[k])` for nrows rows; return
    the rows' horizontal sums.

    Each row keeps one <8 x float> accumulator over the blocks in order, then the AVX
    horizontal sum: llama.cpp's exact float order, so results match it bit for bit.
    Several rows per loop share the activation loads and overlap their fma chains (one
    row's chain of dependent fmas would set the pace for the short-bodied types).
    with_mins: the body also takes and returns a <4 x float> accumulator for the K-quant
    min terms, which llama.cpp keeps apart and adds at the end.
    """
    (wrows, xq, xd, xs), nb = _array_ptrs(context, builder, sig, args, nrows)
    h = _IR(builder, _target_features(context))
    zero = ir.Constant(_vec(F32T, 8), [0.0] * 8)
    zero4 = ir.Constant(_vec(F32T, 4), [0.0] * 4)
    if block_bytes:  # software prefetch, this many bytes ahead in each row's stream
        # (x86 prefetches never fault, so running past the matrix's end is harmless)
        pf_dist = ir.Constant(I64, 4096 if nrows == 1 else 1024)
    width = 2 if with_mins else 1        # accumulators per row, flattened for the loop

    def blocks(i, accs):
        if block_bytes:
            for wrow in wrows:
                h.prefetch(builder.gep(wrow, [builder.add(builder.mul(i, _c64(block_bytes)), pf_dist)]))
        out = []
        for k, wrow in enumerate(wrows):
            if with_mins:
                out += body(h, wrow, xq, xd, xs, i, tuple(accs[2 * k:2 * k + 2]))
            else:
                out.append(body(h, wrow, xq, xd, xs, i, accs[k]))
        return out
    fin = _counted_loop(builder, nb, 1, [zero, zero4][:width] * len(wrows), blocks, "qdot")
    sums = []
    for k in range(len(wrows)):
        hs = [h.hsum_f32(r) for r in fin[width * k:width * k + width]]
        sums.append(builder.fadd(hs[0], hs[1]) if with_mins else hs[0])
    return sums


def _c64(v):
    return ir.Constant(I64, v)


# ----------------------------------------------------------------------------- per-type block bodies

def _body_q8_0(h, wrow, xq, xd, xs, bi, acc):
    b = h.b
    wo = b.mul(bi, _c64(34))
    d = b.fmul(h.load_f16_splat(wrow, wo, 8), h.splat(h.load(xd, b.mul(bi, _c64(4)), F32T), 8))
    wv = h.load(wrow, b.add(wo, _c64(2)), _vec(I8, 32))
    xv = h.load(xq, b.mul(bi, _c64(32)), _vec(I8, 32))
    # |w| (u8) . sign(w)*x (s8): products are the same, and vpmaddubsw takes u8 x s8
    # pairs: |w|*|x| <= 128*127, two of them < 2^15
    s = h.madd_i16(h.maddubs(h.abs_i8(wv), h.sign_i8(xv, wv)), _const_vec(I16, 16, 1))
    return h.fma(d, b.sitofp(s, _vec(F32T, 8)), acc)


def _nibbles32(h, q16):
    """<16 x i8> packed nibbles -> <32 x i8>: low nibbles then high nibbles."""
    b = h.b
    lo = b.and_(q16, _const_vec(I8, 16, 15))
    hi = b.lshr(q16, _const_vec(I8, 16, 4))
    return b.shuffle_vector(lo, hi, _mask(range(32)))


def _qh_bits(h, qh32, value):
    """Bit k of the i32 qh -> `value` in byte k of a <32 x i8> (0 elsewhere)."""
    b = h.b
    if h.avx512bw:   # qh is a mask register already: kmovd + one zero-masked move
        return b.select(b.bitcast(qh32, _vec(ir.IntType(1), 32)), _const_vec(I8, 32, value), _const_vec(I8, 32, 0))
    qb = b.bitcast(qh32, _vec(I8, 4))
    spread = b.shuffle_vector(qb, qb, _mask([k // 8 for k in range(32)]))
    bit = b.and_(spread, _const_vec(I8, 32, [1 << (k % 8) for k in range(32)]))
    return b.select(b.icmp_unsigned("!=", bit, _const_vec(I8, 32, 0)), _const_vec(I8, 32, value),
                    _const_vec(I8, 32, 0))


KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# 32-element block types: (bytes per block, has min m, has 5th bits qh, offset subtracted, non-linear table)
_Q32 = {
    Q4_0: (18, False, False, 8, False), Q4_1: (20, True, False, 0, False),
    Q5_0: (22, False, True, 16, False), Q5_1: (24, True, True, 0, False),
    IQ4_NL: (18, False, False, 0, True),
}


def _q32_values(h, wrow, wo, qt):
    """The 32 quant values of a 32-element block at byte wo as <32 x i8>: unsigned codes
    (value = d * (code - offset) + m), or signed table values for IQ4_NL."""
    b = h.b
    bs, has_min, has_qh, offset, table = _Q32[qt]
    qo = 4 if has_min else 2
    qs = b.add(wo, _c64(qo + (4 if has_qh else 0)))
    q = _nibbles32(h, h.load(wrow, qs, _vec(I8, 16)))
    if has_qh:
        q = b.or_(q, _qh_bits(h, h.load(wrow, b.add(wo, _c64(qo)), I32), 16))
    if table:
        q = h.lut16(q, KVALUES_IQ4NL)
    return q


def _q32_isum_vnni(h, wrow, wo, qt, xv):
    """A 32-element block's <8 x i32> lane sums (products 4i..4i+3) where 256-bit vpdpbusd
    exists: the exact integers of the vpmaddubsw + vpmaddwd path below, with one vpdpbusd
    of unsigned codes (code = weight + offset) started from -offset * (x summed in fours),
    a second vpdpbusd on the activations alone. The two replace abs, sign, vpmaddubsw and
    vpmaddwd (these types run one row a loop: four rows a loop, sharing the start, measured
    faster only for rows of under ~1000 columns and slower above). IQ4_NL's table
    values go in as value + 128 (1..241). Nibbles come from one 16-byte broadcast and a
    per-half word shift; qh's bits through a mask register (_qh_bits)."""
    b = h.b
    bs, has_min, has_qh, offset, table = _Q32[qt]
    qo = 4 if has_min else 2
    raw = h.load(wrow, b.add(wo, _c64(qo + (4 if has_qh else 0))), _vec(I8, 16))
    both = b.bitcast(b.shuffle_vector(raw, raw, _mask(list(range(16)) * 2)), _vec(I16, 16))
    q = b.and_(b.bitcast(b.lshr(both, _const_vec(I16, 16, [0] * 8 + [4] * 8)), _vec(I8, 32)),
               _const_vec(I8, 32, 15))                    # low nibbles, then high ones
    if has_qh:
        q = b.or_(q, _qh_bits(h, h.load(wrow, b.add(wo, _c64(qo)), I32), 16))
    if table:
        q = h.lut16(q, [_as_i8(v + 128) for v in KVALUES_IQ4NL])
        offset = 128
    start = _const_vec(I32, 8, 0)
    if offset:
        start = b.sub(start, h.dpbusd(start, _const_vec(I8, 32, _as_i8(offset)), xv))
    return h.dpbusd(start, q, xv)


def _make_body_q32(qt):
    bs, has_min, has_qh, offset, table = _Q32[qt]

    def body(h, wrow, xq, xd, xs, bi, acc):
        b = h.b
        wo = b.mul(bi, _c64(bs))
        dx = h.load(xd, b.mul(bi, _c64(4)), F32T)
        xv = h.load(xq, b.mul(bi, _c64(32)), _vec(I8, 32))
        if h.vnni and h.f16c:
            # d * dx formed in all lanes (vpbroadcastw + vcvtph2ps): the same product
            d = b.fmul(h.load_f16_splat(wrow, wo, 8), h.splat(dx, 8))
            s = _q32_isum_vnni(h, wrow, wo, qt, xv)
        else:
            d = h.splat(b.fmul(h.load_f16(wrow, wo), dx), 8)
            q = _q32_values(h, wrow, wo, qt)
            if offset:  # the signed value q - offset in each lane, as llama.cpp's tinyBLAS does
                q = b.sub(q, _const_vec(I8, 32, offset))
            if table or offset:  # signed x signed: |q| . sign(q)*x, pairs <= 2*127*127
                p16 = h.maddubs(h.abs_i8(q), h.sign_i8(xv, q))
            else:       # codes <= 31: pairs <= 2*31*128
                p16 = h.maddubs(q, xv)
            s = h.madd_i16(p16, _const_vec(I16, 16, 1))
        if has_min:
            xsum = h.load(xs, b.mul(bi, _c64(4)), I32)
        acc = h.fma(d, b.sitofp(s, _vec(F32T, 8)), acc)
        if has_min:  # + m * dx * sum(x), in lane 0
            mt = b.fmul(b.fmul(h.load_f16(wrow, b.add(wo, _c64(2))), dx), b.sitofp(xsum, F32T))
            acc = b.fadd(acc, b.insert_element(ir.Constant(_vec(F32T, 8), [0.0] * 8), mt, ir.Constant(I32, 0)))
        return acc
    return body


# Q4_K_X8 (repack.py): per group of 8 rows, each block is the 8 rows' 16-byte heads (d,
# dmin, 12 scale bytes), then 8 pieces of 128 bytes, piece t holding qs bytes 16t..16t+16
# of every row. A row's pointer is the group's + 16 * (row % 8); from it, block bi's head
# is at X8_BLOCK * bi and its qs piece t at X8_BLOCK * bi + 128 + 128 * t.
X8_ROWS = 8
X8_BLOCK = X8_ROWS * 144


def _q4k_block_bytes(x8: bool) -> int:
    return X8_BLOCK if x8 else 144


def _q4k_qs32(h, wrow, wo, c, x8):
    """qs bytes 32c..32c+32 of the Q4_K block at wrow + wo, in either layout: <32 x i8>."""
    b = h.b
    if not x8:
        return h.load(wrow, b.add(wo, _c64(16 + 32 * c)), _vec(I8, 32))
    lo = h.load(wrow, b.add(wo, _c64(128 + 256 * c)), _vec(I8, 16))
    hi = h.load(wrow, b.add(wo, _c64(256 + 256 * c)), _vec(I8, 16))
    return b.shuffle_vector(lo, hi, _mask(range(32)))


def _x8_row_ptr(builder, base, stride0, r):
    """Row r's pointer in a Q4_K_X8 matrix at base (i8*) with row stride stride0."""
    k = builder.and_(r, _c64(X8_ROWS - 1))
    group = builder.mul(builder.sub(r, k), stride0)
    return builder.gep(base, [builder.add(group, builder.mul(k, _c64(16)))])


def _q4k_scales_vec(h, wrow, wo):
    """The 12 packed scale bytes -> <16 x i8>: 8 scales, then 8 mins (ggml's utmp trick
    on one <4 x i32> instead of scalar registers)."""
    b = h.b
    v = h.load(wrow, b.add(wo, _c64(4)), _vec(I32, 4))     # u0 u1 u2 (+4 bytes of qs)
    c = lambda x: _const_vec(I32, 4, x)  # noqa: E731
    a = b.and_(v, c(0x3F3F3F3F))                                       # t0 t2 . .
    hi2 = b.shl(b.and_(b.lshr(v, c(6)), c(0x03030303)), c(4))          # from u0, u1
    u2 = b.shuffle_vector(v, v, _mask([2, 2, 2, 2]))
    lo4 = b.and_(b.lshr(u2, _const_vec(I32, 4, [0, 4, 0, 0])), c(0x0F0F0F0F))
    t13 = b.or_(lo4, hi2)                                              # t1 t3 . .
    return b.bitcast(b.shuffle_vector(a, t13, _mask([0, 4, 1, 5])), _vec(I8, 16))


def _q4k_scales(h, wrow, wo):
    """12 packed bytes -> (<8 x i32> scales, <8 x i32> mins)."""
    b = h.b
    sm = _q4k_scales_vec(h, wrow, wo)
    return (b.zext(b.shuffle_vector(sm, sm, _mask(range(8))), _vec(I32, 8)),
            b.zext(b.shuffle_vector(sm, sm, _mask(range(8, 16))), _vec(I32, 8)))


def _q45k_isum(h, wrow, wo, xq, xo, sm, five):
    """Q4_K / Q5_K block: <8 x i32> of sum_j scale_j * (q_j . x_j), sub-block j's 32 products
    pairwise-summed (vpmaddubsw) then scaled and paired (vpmaddwd): the lanes of
    ggml_vec_dot_q4_K / q5_K. sm: _q4k_scales_vec's bytes."""
    b = h.b
    qs0 = 48 if five else 16
    qh = h.load(wrow, b.add(wo, _c64(16)), _vec(I8, 32)) if five else None
    sc2 = b.shuffle_vector(sm, sm, _mask(list(range(16)) * 2))        # scales in both lanes
    isum = ir.Constant(_vec(I32, 8), [0] * 8)
    for c in range(4):
        q = h.load(wrow, b.add(wo, _c64(qs0 + 32 * c)), _vec(I8, 32))
        for hi in range(2):
            j = 2 * c + hi
            v = _k_nibbles(h, q, hi)
            if five:     # bit j of qh[l] is the 5th bit of element l of sub-block j
                hb = b.and_(b.lshr(qh, _const_vec(I8, 32, j)), _const_vec(I8, 32, 1))
                v = b.or_(v, b.shl(hb, _const_vec(I8, 32, 4)))
            xv = h.load(xq, b.add(xo, _c64(32 * j)), _vec(I8, 32))
            p16 = h.maddubs(v, xv)                               # pairs <= 2*31*128
            isum = b.add(isum, h.madd_i16(p16, h.bcast_u8_as_i16(sc2, j)))
    return isum


def _make_body_q45_k(five: bool):
    """Q4_K / Q5_K block dot in ggml_vec_dot's order (Q4_K matrices with rows % 8 == 0
    take `_q4_k_rows4_lanes`)."""
    bs = 176 if five else 144

    def body(h, wrow, xq, xd, xs, bi, acc):
        b = h.b
        wo = b.mul(bi, _c64(bs))
        dx = h.load(xd, b.mul(bi, _c64(4)), F32T)
        d = b.fmul(h.load_f16(wrow, wo), dx)
        dmin = b.fmul(h.load_f16(wrow, b.add(wo, _c64(2))), dx)
        sm = _q4k_scales_vec(h, wrow, wo)
        mn = b.zext(b.shuffle_vector(sm, sm, _mask(range(8, 16))), _vec(I32, 8))
        bs32 = h.pairs(h.load(xs, b.mul(bi, _c64(64)), _vec(I32, 16)))     # per-32 sums of x
        msum = b.mul(mn, bs32)
        isum = _q45k_isum(h, wrow, wo, xq, b.mul(bi, _c64(256)), sm, five)
        if five:
            acc = h.fma(h.splat(d, 8), b.sitofp(isum, _vec(F32T, 8)), acc)
            return h.fma(h.splat(b.fneg(dmin), 8), b.sitofp(msum, _vec(F32T, 8)), acc)
        acc, accm = acc
        # Q4_K as llama.cpp's vec_dot: min terms summed in pairs into a separate <4 x float>
        acc = h.fma(h.splat(d, 8), b.sitofp(isum, _vec(F32T, 8)), acc)
        accm = h.fma(h.splat(b.fneg(dmin), 4), b.sitofp(h.pairs(msum), _vec(F32T, 4)), accm)
        return acc, accm
    return body


def _k_nibbles(h, q, hi):
    b = h.b
    return b.and_(q, _const_vec(I8, 32, 15)) if hi == 0 else b.lshr(q, _const_vec(I8, 32, 4))


def _iq4xs_scale(h, wrow, wo, ib):
    """Signed scale (ls - 32) of sub-block ib of an IQ4_XS block, as i16."""
    b = h.b
    sh = b.zext(h.load(wrow, b.add(wo, _c64(2)), I16), I32)
    sl = b.zext(h.load(wrow, b.add(wo, _c64(4 + ib // 2)), I8), I32)
    lo = b.and_(b.lshr(sl, ir.Constant(I32, 4 * (ib % 2))), ir.Constant(I32, 15))
    hi = b.shl(b.and_(b.lshr(sh, ir.Constant(I32, 2 * ib)), ir.Constant(I32, 3)), ir.Constant(I32, 4))
    return b.trunc(b.sub(b.or_(lo, hi), ir.Constant(I32, 32)), I16)


def _body_iq4_xs(h, wrow, xq, xd, xs, bi, acc):
    b = h.b
    wo = b.mul(bi, _c64(136))
    d = b.fmul(h.load_f16(wrow, wo), h.load(xd, b.mul(bi, _c64(4)), F32T))
    xo = b.mul(bi, _c64(256))
    isum = ir.Constant(_vec(I32, 8), [0] * 8)
    for ib in range(8):
        v = h.lut16(_nibbles32(h, h.load(wrow, b.add(wo, _c64(8 + 16 * ib)), _vec(I8, 16))), KVALUES_IQ4NL)
        xv = h.load(xq, b.add(xo, _c64(32 * ib)), _vec(I8, 32))
        p16 = h.maddubs(h.abs_i8(v), h.sign_i8(xv, v))              # pairs <= 2*127*127
        isum = b.add(isum, h.madd_i16(p16, h.splat(_iq4xs_scale(h, wrow, wo, ib), 16)))
    return h.fma(h.splat(d, 8), b.sitofp(isum, _vec(F32T, 8)), acc)


def _q6_k_values(h, ql0, ql1, qh, gq):
    """Unsigned 6-bit values (0..63) of quarter gq of a Q6_K half-block, as <32 x i8>."""
    b = h.b
    ql = ql0 if gq & 1 == 0 else ql1
    low = b.and_(ql, _const_vec(I8, 32, 15)) if gq < 2 else b.lshr(ql, _const_vec(I8, 32, 4))
    # bits 2gq, 2gq+1 of qh moved to bits 4, 5: one shift and one mask
    sh = 4 - 2 * gq
    hq = qh if sh == 0 else (b.shl(qh, _const_vec(I8, 32, sh)) if sh > 0 else b.lshr(qh, _const_vec(I8, 32, -sh)))
    return b.or_(low, b.and_(hq, _const_vec(I8, 32, 0x30)))


def _q6_k_isum_512(h, wrow, wo, xq, xo, sc16):
    """The scaled products of one Q6_K block, two quarters per 512-bit vector (AVX512-BW):
    <8 x i32> equal to the 256-bit loop's lanes summed (exact integers: the same bits).
    A 64-byte load holds ql for quarters gq and gq + 1; qh is loaded into both halves and
    shifted per half; one word permute gives the four 16-element groups' scales."""
    b = h.b
    v64, v32i16, v16i32 = _vec(I8, 64), _vec(I16, 32), _vec(I32, 16)
    isum = ir.Constant(v16i32, [0] * 16)
    for hh in range(2):
        ql = h.load(wrow, b.add(wo, _c64(64 * hh)), v64)                 # quarters 0, 1 (ql0 ql1)
        qh32 = h.load(wrow, b.add(wo, _c64(128 + 32 * hh)), _vec(I8, 32))
        qh = b.shuffle_vector(qh32, qh32, _mask(list(range(32)) * 2))
        for pq in range(2):                  # quarters 2pq (low half) and 2pq + 1 (high half)
            low = b.and_(ql, _const_vec(I8, 64, 15)) if pq == 0 else b.lshr(ql, _const_vec(I8, 64, 4))
            # bits 2gq, 2gq + 1 of qh to bits 4, 5 (gq = 0..3: shifts 4, 2, 0, -2), in 16-bit
            # lanes (one vpsllvw / vpsrlvw; x86 has no per-byte shift): the bits that cross
            # into the neighbouring byte land outside the 0x30 mask
            qh16 = b.bitcast(qh, v32i16)
            if pq == 0:
                hq = b.shl(qh16, _const_vec(I16, 32, [4] * 16 + [2] * 16))
            else:
                hq = b.lshr(qh16, _const_vec(I16, 32, [0] * 16 + [2] * 16))
            q = b.or_(low, b.and_(b.bitcast(hq, v64), _const_vec(I8, 64, 0x30)))
            xv = h.load(xq, b.add(xo, _c64(hh * 128 + pq * 64)), v64)
            p16 = h._x86("llvm.x86.avx512.pmaddubs.w.512", v32i16, [q, xv])   # pairs <= 2*63*128
            g = 8 * hh + 4 * pq                  # the four groups of 16 in this vector
            sc = b.shuffle_vector(sc16, sc16, _mask([g + k for k in range(4) for _ in range(8)]))
            isum = b.add(isum, h._x86("llvm.x86.avx512.pmaddw.d.512", v16i32, [p16, sc]))
    return b.add(h.half(isum, 0), h.half(isum, 1))


def _body_q6_k(h, wrow, xq, xd, xs, bi, acc):
    b = h.b
    wo = b.mul(bi, _c64(210))
    d = b.fmul(h.load_f16_splat(wrow, b.add(wo, _c64(208)), 8), h.splat(h.load(xd, b.mul(bi, _c64(4)), F32T), 8))
    sc16 = b.sext(h.load(wrow, b.add(wo, _c64(192)), _vec(I8, 16)), _vec(I16, 16))
    bs16 = h.narrow_i32_i16(h.load(xs, b.mul(bi, _c64(64)), _vec(I32, 16)))   # |sums| <= 16*128
    # lane k: 32 * (sc_2k * sum_2k(x) + sc_2k+1 * sum_2k+1(x)), as llama.cpp's q8sclsub
    isum = b.sub(ir.Constant(_vec(I32, 8), [0] * 8), b.shl(h.madd_i16(sc16, bs16), _const_vec(I32, 8, 5)))
    xo = b.mul(bi, _c64(256))
    if h.avx512bw:
        isum = b.add(isum, _q6_k_isum_512(h, wrow, wo, xq, xo, sc16))
        return h.fma(d, b.sitofp(isum, _vec(F32T, 8)), acc)
    # scales as i16 with both 128-bit halves holding the same 8: one vpshufb per group pair
    sc_lo = b.shuffle_vector(sc16, sc16, _mask(list(range(8)) * 2))
    sc_hi = b.shuffle_vector(sc16, sc16, _mask(list(range(8, 16)) * 2))
    for hh in range(2):
        qh = h.load(wrow, b.add(wo, _c64(128 + 32 * hh)), _vec(I8, 32))
        ql0 = h.load(wrow, b.add(wo, _c64(64 * hh)), _vec(I8, 32))
        ql1 = h.load(wrow, b.add(wo, _c64(64 * hh + 32)), _vec(I8, 32))
        src = sc_lo if hh == 0 else sc_hi
        for gq in range(4):
            q = _q6_k_values(h, ql0, ql1, qh, gq)
            xv = h.load(xq, b.add(xo, _c64(hh * 128 + gq * 32)), _vec(I8, 32))
            p16 = h.maddubs(q, xv)              # pairs <= 2*63*128; lanes 0..7: group g, 8..15: g+1
            g = gq * 2                          # within this half's 8 scales
            isum = b.add(isum, h.madd_i16(p16, h.pick_i16_halves(src, g, g + 1)))
    return h.fma(d, b.sitofp(isum, _vec(F32T, 8)), acc)


def _q3k_scales(h, wrow, wo):
    """16 signed 6-bit Q3_K scales from the 12 bytes at wo + 96, as <16 x i32> (ggml's aux trick)."""
    b = h.b
    a0 = h.load(wrow, b.add(wo, _c64(96)), I32)
    a1 = h.load(wrow, b.add(wo, _c64(100)), I32)
    tmp = h.load(wrow, b.add(wo, _c64(104)), I32)
    c = lambda v: ir.Constant(I32, v)  # noqa: E731
    k1, k2 = c(0x03030303), c(0x0F0F0F0F)
    s2 = b.or_(b.and_(b.lshr(a0, c(4)), k2), b.shl(b.and_(b.lshr(tmp, c(4)), k1), c(4)))
    s3 = b.or_(b.and_(b.lshr(a1, c(4)), k2), b.shl(b.and_(b.lshr(tmp, c(6)), k1), c(4)))
    s0 = b.or_(b.and_(a0, k2), b.shl(b.and_(tmp, k1), c(4)))
    s1 = b.or_(b.and_(a1, k2), b.shl(b.and_(b.lshr(tmp, c(2)), k1), c(4)))
    v = ir.Constant(_vec(I32, 4), [0] * 4)
    for i, t in enumerate((s0, s1, s2, s3)):
        v = b.insert_element(v, t, ir.Constant(I32, i))
    return b.sub(b.zext(b.bitcast(v, _vec(I8, 16)), _vec(I32, 16)), _const_vec(I32, 16, 32))


def _q23k_codes(h, wrow, wo, hh, j, three):
    """Unsigned codes of elements hh*128 + j*32 + (0..31): Q2_K 0..3; Q3_K value + 4 (0..7)."""
    b = h.b
    qs0 = 32 if three else 16
    q = h.load(wrow, b.add(wo, _c64(qs0 + 32 * hh)), _vec(I8, 32))
    v = b.and_(b.lshr(q, _const_vec(I8, 32, 2 * j)), _const_vec(I8, 32, 3))
    if three:   # hmask bit set: value = q, else q - 4; code = value + 4
        hm = h.load(wrow, wo, _vec(I8, 32))
        bit = b.and_(b.lshr(hm, _const_vec(I8, 32, 4 * hh + j)), _const_vec(I8, 32, 1))
        v = b.or_(v, b.shl(bit, _const_vec(I8, 32, 2)))
    return v


def _make_body_q23_k(three: bool):
    bs = 110 if three else 84

    def body(h, wrow, xq, xd, xs, bi, acc):
        b = h.b
        wo = b.mul(bi, _c64(bs))
        dx = h.load(xd, b.mul(bi, _c64(4)), F32T)
        bsums = h.load(xs, b.mul(bi, _c64(64)), _vec(I32, 16))
        if three:
            sc = _q3k_scales(h, wrow, wo)
            d = b.fmul(h.load_f16(wrow, b.add(wo, _c64(108))), dx)
            # codes are value + 4: subtract 4 * sc_g * sum_g(x)
            isum = b.sub(ir.Constant(_vec(I32, 8), [0] * 8),
                         b.mul(h.pairs(b.mul(sc, bsums)), _const_vec(I32, 8, 4)))
        else:
            raw = b.zext(h.load(wrow, wo, _vec(I8, 16)), _vec(I32, 16))
            sc = b.and_(raw, _const_vec(I32, 16, 15))
            msum = h.pairs(b.mul(b.lshr(raw, _const_vec(I32, 16, 4)), bsums))
            d = b.fmul(h.load_f16(wrow, b.add(wo, _c64(80))), dx)
            dmin = b.fmul(h.load_f16(wrow, b.add(wo, _c64(82))), dx)
            isum = ir.Constant(_vec(I32, 8), [0] * 8)
        sc16 = b.trunc(sc, _vec(I16, 16))
        xo = b.mul(bi, _c64(256))
        for hh in range(2):
            for j in range(4):
                v = _q23k_codes(h, wrow, wo, hh, j, three)
                xv = h.load(xq, b.add(xo, _c64(hh * 128 + j * 32)), _vec(I8, 32))
                p16 = h.maddubs(v, xv)                     # lanes 0..7: group g, 8..15: group g+1
                g = hh * 8 + j * 2
                isum = b.add(isum, h.madd_i16(p16, b.shuffle_vector(sc16, sc16, _mask([g] * 8 + [g + 1] * 8))))
        acc = h.fma(h.splat(d, 8), b.sitofp(isum, _vec(F32T, 8)), acc)
        if not three:
            acc = h.fma(h.splat(b.fneg(dmin), 8), b.sitofp(msum, _vec(F32T, 8)), acc)
        return acc
    return body


def _make_deq_q23_k(three: bool):
    bs = 110 if three else 84

    def body(h, wrow, yrow, bi):
        b = h.b
        wo = b.mul(bi, _c64(bs))
        if three:
            d = h.load_f16(wrow, b.add(wo, _c64(108)))
            dsc = b.fmul(b.sitofp(_q3k_scales(h, wrow, wo), _vec(F32T, 16)), h.splat(d, 16))
            msc = ir.Constant(_vec(F32T, 16), [0.0] * 16)
            off = 4
        else:
            raw = b.zext(h.load(wrow, wo, _vec(I8, 16)), _vec(I32, 16))
            d = h.load_f16(wrow, b.add(wo, _c64(80)))
            dmin = h.load_f16(wrow, b.add(wo, _c64(82)))
            dsc = b.fmul(b.sitofp(b.and_(raw, _const_vec(I32, 16, 15)), _vec(F32T, 16)), h.splat(d, 16))
            msc = b.fmul(b.sitofp(b.lshr(raw, _const_vec(I32, 16, 4)), _vec(F32T, 16)), h.splat(b.fneg(dmin), 16))
            off = 0
        yo = b.mul(bi, _c64(1024))
        for hh in range(2):
            for j in range(4):
                v = _q23k_codes(h, wrow, wo, hh, j, three)
                f = b.sitofp(b.sub(b.zext(v, _vec(I32, 32)), _const_vec(I32, 32, off)), _vec(F32T, 32))
                g = hh * 8 + j * 2
                m = _mask([g] * 16 + [g + 1] * 16)
                y = h.fma(f, b.shuffle_vector(dsc, dsc, m), b.shuffle_vector(msc, msc, m))
                _store(h, yrow, b.add(yo, _c64(4 * (hh * 128 + j * 32))), y)
    return body


ROWS = 4   # rows per loop of the multi-row kernels (_quartered_rows unpacks 4)


def _make_row_intrinsic(body, with_mins=False, nrows=1, block_bytes=0):
    """row_dot(w, r, xq, xd, xs): row r's dot as float32; with nrows > 1,
    row_dot(w, r, xq, xd, xs, step): the tuple of rows r, r+step, ... r+(nrows-1)*step (the
    caller keeps them inside the matrix). block_bytes > 0 (the type's block size) turns on
    software prefetch."""
    if nrows > 1:
        @intrinsic
        def rows_dot(typingctx, w, r, xq, xd, xs, step):
            sig = types.UniTuple(types.float32, nrows)(w, r, xq, xd, xs, step)

            def codegen(context, builder, sig, args):
                sums = _row_loop(context, builder, sig, args, body, with_mins, nrows, block_bytes)
                return context.make_tuple(builder, sig.return_type, sums)
            return sig, codegen
        return rows_dot

    @intrinsic
    def row_dot(typingctx, w, r, xq, xd, xs):
        sig = types.float32(w, r, xq, xd, xs)

        def codegen(context, builder, sig, args):
            return _row_loop(context, builder, sig, args, body, with_mins, 1, block_bytes)[0]
        return sig, codegen
    return row_dot


# Q8_0 rows prefetch 4 KiB ahead: the Gemma head (262144 x 640) took 7.9 -> 6.8 ms with
# 2 threads, 15.2 -> 11.6 ms with one. The K-quants, compute-bound, lost 10-40% with it.
_row_q8_0 = _make_row_intrinsic(_body_q8_0, block_bytes=34)
_rows_q8_0 = _make_row_intrinsic(_body_q8_0, nrows=ROWS, block_bytes=34)
_rows_q6_k = _make_row_intrinsic(_body_q6_k, nrows=ROWS)    # prefetching lost 50% here
_row_q4_0 = _make_row_intrinsic(_make_body_q32(Q4_0))
_row_q4_1 = _make_row_intrinsic(_make_body_q32(Q4_1))
_row_q5_0 = _make_row_intrinsic(_make_body_q32(Q5_0))
_row_q5_1 = _make_row_intrinsic(_make_body_q32(Q5_1))
_row_iq4_nl = _make_row_intrinsic(_make_body_q32(IQ4_NL))
_row_q4_k = _make_row_intrinsic(_make_body_q45_k(False), with_mins=True)
_row_q5_k = _make_row_intrinsic(_make_body_q45_k(True))
_row_q6_k = _make_row_intrinsic(_body_q6_k)
_row_iq4_xs = _make_row_intrinsic(_body_iq4_xs)
_row_q2_k = _make_row_intrinsic(_make_body_q23_k(False))
_row_q3_k = _make_row_intrinsic(_make_body_q23_k(True))


# ----------------------------------------------------------------------------- dequantization (prefill)

def _deq_loop(context, builder, sig, args, block, body, x8=False):
    """Emit `for b in range(n_cols // block): body(b)` writing row i of y from row r of w
    (x8: w is Q4_K_X8)."""
    w = context.make_array(sig.args[0])(context, builder, args[0])
    y = context.make_array(sig.args[2])(context, builder, args[2])
    r, i = args[1], args[3]
    wbase, wstride = builder.bitcast(w.data, I8.as_pointer()), cgutils.unpack_tuple(builder, w.strides)[0]
    wrow = _x8_row_ptr(builder, wbase, wstride, r) if x8 else builder.gep(wbase, [builder.mul(r, wstride)])
    yrow = builder.gep(builder.bitcast(y.data, I8.as_pointer()),
                       [builder.mul(i, cgutils.unpack_tuple(builder, y.strides)[0])])
    nb = builder.sdiv(cgutils.unpack_tuple(builder, y.shape)[1], ir.Constant(I64, block))
    h = _IR(builder, _target_features(context))
    with cgutils.for_range(builder, nb) as loop:
        body(h, wrow, yrow, loop.index)
    return context.get_dummy_value()


def _store(h, yrow, off, v):
    p = h.b.bitcast(h.ptr(yrow, off), v.type.as_pointer())
    h.b.store(v, p, align=4)


def _deq_q8_0(h, wrow, yrow, bi):
    b = h.b
    wo = b.mul(bi, _c64(34))
    q = b.sitofp(h.load(wrow, b.add(wo, _c64(2)), _vec(I8, 32)), _vec(F32T, 32))
    _store(h, yrow, b.mul(bi, _c64(128)), b.fmul(q, h.splat(h.load_f16(wrow, wo), 32)))


def _make_deq_q32(qt):
    bs, has_min, has_qh, offset, table = _Q32[qt]

    def body(h, wrow, yrow, bi):
        b = h.b
        wo = b.mul(bi, _c64(bs))
        q = _q32_values(h, wrow, wo, qt)
        if table:
            f = b.sitofp(q, _vec(F32T, 32))
        else:
            f = b.sitofp(b.sub(b.zext(q, _vec(I32, 32)), _const_vec(I32, 32, offset)), _vec(F32T, 32))
        d = h.splat(h.load_f16(wrow, wo), 32)
        if has_min:
            y = h.fma(f, d, h.splat(h.load_f16(wrow, b.add(wo, _c64(2))), 32))
        else:
            y = b.fmul(f, d)
        _store(h, yrow, b.mul(bi, _c64(128)), y)
    return body


def _make_deq_q45_k(five: bool, x8: bool = False):
    bs, qs0 = (176, 48) if five else (_q4k_block_bytes(x8), 16)

    def body(h, wrow, yrow, bi):
        b = h.b
        wo = b.mul(bi, _c64(bs))
        d = h.load_f16(wrow, wo)
        dmin = h.load_f16(wrow, b.add(wo, _c64(2)))
        sc, mn = _q4k_scales(h, wrow, wo)
        dsc = b.fmul(b.sitofp(sc, _vec(F32T, 8)), h.splat(d, 8))
        msc = b.fmul(b.sitofp(mn, _vec(F32T, 8)), h.splat(b.fneg(dmin), 8))
        qh = h.load(wrow, b.add(wo, _c64(16)), _vec(I8, 32)) if five else None
        yo = b.mul(bi, _c64(1024))
        for c in range(4):
            if five:
                q = h.load(wrow, b.add(wo, _c64(qs0 + 32 * c)), _vec(I8, 32))
            else:
                q = _q4k_qs32(h, wrow, wo, c, x8)
            for hi in range(2):
                j = 2 * c + hi
                v = _k_nibbles(h, q, hi)
                if five:
                    hb = b.and_(b.lshr(qh, _const_vec(I8, 32, j)), _const_vec(I8, 32, 1))
                    v = b.or_(v, b.shl(hb, _const_vec(I8, 32, 4)))
                f = b.uitofp(v, _vec(F32T, 32))
                ds = b.shuffle_vector(dsc, dsc, _mask([j] * 32))
                ms = b.shuffle_vector(msc, msc, _mask([j] * 32))
                _store(h, yrow, b.add(yo, _c64(128 * j)), h.fma(f, ds, ms))
    return body


def _deq_iq4_xs(h, wrow, yrow, bi):
    b = h.b
    wo = b.mul(bi, _c64(136))
    d = h.load_f16(wrow, wo)
    yo = b.mul(bi, _c64(1024))
    for ib in range(8):
        v = h.lut16(_nibbles32(h, h.load(wrow, b.add(wo, _c64(8 + 16 * ib)), _vec(I8, 16))), KVALUES_IQ4NL)
        dl = b.fmul(d, b.sitofp(_iq4xs_scale(h, wrow, wo, ib), F32T))
        _store(h, yrow, b.add(yo, _c64(128 * ib)), b.fmul(b.sitofp(v, _vec(F32T, 32)), h.splat(dl, 32)))


def _deq_q6_k(h, wrow, yrow, bi):
    b = h.b
    wo = b.mul(bi, _c64(210))
    d = h.load_f16(wrow, b.add(wo, _c64(208)))
    dsc = b.fmul(b.sitofp(h.load(wrow, b.add(wo, _c64(192)), _vec(I8, 16)), _vec(F32T, 16)), h.splat(d, 16))
    yo = b.mul(bi, _c64(1024))
    for hh in range(2):
        qh = h.load(wrow, b.add(wo, _c64(128 + 32 * hh)), _vec(I8, 32))
        ql0 = h.load(wrow, b.add(wo, _c64(64 * hh)), _vec(I8, 32))
        ql1 = h.load(wrow, b.add(wo, _c64(64 * hh + 32)), _vec(I8, 32))
        for gq in range(4):
            q = _q6_k_values(h, ql0, ql1, qh, gq)
            f = b.sitofp(b.sub(b.zext(q, _vec(I32, 32)), _const_vec(I32, 32, 32)), _vec(F32T, 32))
            g = hh * 8 + gq * 2
            ds = b.shuffle_vector(dsc, dsc, _mask([g] * 16 + [g + 1] * 16))
            _store(h, yrow, b.add(yo, _c64(4 * (hh * 128 + gq * 32))), b.fmul(f, ds))


def _make_deq_intrinsic(block, body, x8=False):
    @intrinsic
    def deq_row(typingctx, w, r, y, i):
        sig = types.void(w, r, y, i)

        def codegen(context, builder, sig, args):
            return _deq_loop(context, builder, sig, args, block, body, x8)
        return sig, codegen
    return deq_row


_deq_row_q8_0 = _make_deq_intrinsic(32, _deq_q8_0)
_deq_row_q4_0 = _make_deq_intrinsic(32, _make_deq_q32(Q4_0))
_deq_row_q4_1 = _make_deq_intrinsic(32, _make_deq_q32(Q4_1))
_deq_row_q5_0 = _make_deq_intrinsic(32, _make_deq_q32(Q5_0))
_deq_row_q5_1 = _make_deq_intrinsic(32, _make_deq_q32(Q5_1))
_deq_row_iq4_nl = _make_deq_intrinsic(32, _make_deq_q32(IQ4_NL))
_deq_row_q4_k = _make_deq_intrinsic(256, _make_deq_q45_k(False))
_deq_row_q4_k_x8 = _make_deq_intrinsic(256, _make_deq_q45_k(False, x8=True), x8=True)
_deq_row_q5_k = _make_deq_intrinsic(256, _make_deq_q45_k(True))
_deq_row_q6_k = _make_deq_intrinsic(256, _deq_q6_k)
_deq_row_iq4_xs = _make_deq_intrinsic(256, _deq_iq4_xs)
_deq_row_q2_k = _make_deq_intrinsic(256, _make_deq_q23_k(False))
_deq_row_q3_k = _make_deq_intrinsic(256, _make_deq_q23_k(True))

FAST_TYPES = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)

_JIT = dict(cache=True, nogil=True)

# Which types the dispatching functions below (_dot_rows, _quartered_rows, _deq_row) and
# the kernels calling them handle: every one in these definitions; `kernels_for` copies
# them with some of the flags False, and Numba prunes those branches before typing, so a
# model compiles only its own types' code (see "Kernels per type set" below).
_HAS_Q8_0 = _HAS_Q4_0 = _HAS_Q4_1 = _HAS_Q5_0 = _HAS_Q5_1 = _HAS_IQ4_NL = True
_HAS_Q2_K = _HAS_Q3_K = _HAS_Q4_K = _HAS_Q5_K = _HAS_Q6_K = _HAS_IQ4_XS = _HAS_Q4_K_X8 = True
_TYPE_NAMES = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", IQ4_NL: "IQ4_NL",
               Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", IQ4_XS: "IQ4_XS",
               Q4_K_X8: "Q4_K_X8"}


# ----------------------------------------------------------------------------- Q4_K, 4 rows in lanes

def _reduce_rows4(h, vs):
    """4 x <8 x i32> -> <8 x i32> whose lanes k and k + 4 are the sum of vs[k]'s lanes (exact)."""
    b = h.b

    def hadd(x, y):
        return b.add(b.shuffle_vector(x, y, _mask([0, 2, 8, 10, 4, 6, 12, 14])),
                     b.shuffle_vector(x, y, _mask([1, 3, 9, 11, 5, 7, 13, 15])))
    q = hadd(hadd(vs[0], vs[1]), hadd(vs[2], vs[3]))    # rows 0-3 in each 128-bit half
    return b.add(q, b.shuffle_vector(q, q, _mask([4, 5, 6, 7, 0, 1, 2, 3])))


def _q4_k_rows4_lanes(context, builder, sig, args):
    """Rows r, r+step, r+2*step, r+3*step of a Q4_K matrix with one row per float lane, in
    the order of llama.cpp's repacked 8-row gemv: per block, each row's integer dot I and
    min dot M, then acc += (d*dx) * I and accm += (dmin*(-dx)) * M lane-wise; row k's
    result is acc[k] + accm[k]. (That gemv sums each block's integer dot to one integer
    before a single float fma per block, so its float order differs from
    ggml_vec_dot_q4_K's; the lanes are independent, so 4 rows give its bits as 8 do.)
    The float work runs on 8 lanes, rows 0-3 twice: as cheap as 4 lanes."""
    (wrows, xq, xd, xs), nb = _array_ptrs(context, builder, sig, args, ROWS)
    h = _IR(builder, _target_features(context))
    b = builder
    lanes = 4 if h.avx512bw and h.f16c else 8
    zero = ir.Constant(_vec(F32T, lanes), [0.0] * lanes)

    def block(bi, accs):
        return _q4_k_rows4_block(h, wrows, xq, xd, xs, bi, *accs)
    ra, rm = _counted_loop(b, nb, 1, [zero, zero], block, "q4k4")
    tot = b.fadd(ra, rm)
    return [b.extract_element(tot, ir.Constant(I32, k)) for k in range(ROWS)]


def _q4_k_rows_isums_512(h, wrows, wo, xq, xo, sm):
    """The rows' integer dots sum_j scale_j * (q_j . x_j) of one Q4_K block on 512-bit
    vectors (AVX512-BW): the same products and exact sums as the 256-bit loop in half the
    instructions. A 64-byte load holds qs for c = 2p, 2p + 1: its low nibbles are
    sub-blocks 4p and 4p + 2, its high ones 4p + 1 and 4p + 3. sm: the rows' scale bytes,
    row k's in 128-bit lane k (_q4_k_scales_rows4). Returns <16 x i32> partial sums per row."""
    b = h.b
    v64, v32i16, v16i32 = _vec(I8, 64), _vec(I16, 32), _vec(I32, 16)
    isums = [ir.Constant(v16i32, [0] * 16)] * len(wrows)
    for p in range(2):
        xvs = []
        for hi in range(2):   # activations of sub-blocks 4p + hi and 4p + 2 + hi, side by side
            lo32 = h.load(xq, b.add(xo, _c64(32 * (4 * p + hi))), _vec(I8, 32))
            hi32 = h.load(xq, b.add(xo, _c64(32 * (4 * p + 2 + hi))), _vec(I8, 32))
            xvs.append(b.shuffle_vector(lo32, hi32, _mask(range(64))))
        for k, wrow in enumerate(wrows):
            q = h.load(wrow, b.add(wo, _c64(16 + 64 * p)), v64)
            for hi in range(2):
                nib = b.and_(q, _const_vec(I8, 64, 15)) if hi == 0 else b.lshr(q, _const_vec(I8, 64, 4))
                p16 = h._x86("llvm.x86.avx512.pmaddubs.w.512", v32i16, [nib, xvs[hi]])   # <= 2*15*128
                j0, j1 = 4 * p + hi, 4 * p + 2 + hi     # each half's scale, zero-extended to i16
                # row k's scale bytes (lane k of sm) picked and zero-extended in one byte permute
                pick = [16 * k + j0, 64] * 16 + [16 * k + j1, 64] * 16
                sc = b.bitcast(b.shuffle_vector(sm, _const_vec(I8, 64, 0), _mask(pick)), v32i16)
                isums[k] = b.add(isums[k], h._x86("llvm.x86.avx512.pmaddw.d.512", v16i32, [p16, sc]))
    return isums


def _q4_k_scales_rows4(h, wrows, wo):
    """The 4 rows' 16-byte block heads (d|dmin, 12 scale bytes) in one <16 x i32>, decoded
    at once: (<64 x i8> with row k's 8 scales then 8 mins in 128-bit lane k, <4 x i32> of
    the rows' d | dmin << 16). The decode is _q4k_scales_vec's, on all four rows' lanes."""
    b = h.b
    heads = [h.load(wrow, wo, _vec(I32, 4)) for wrow in wrows]    # dm u0 u1 u2, per row
    return _q4_k_decode_heads4(h, b.shuffle_vector(b.shuffle_vector(heads[0], heads[1], _mask(range(8))),
                                                   b.shuffle_vector(heads[2], heads[3], _mask(range(8))),
                                                   _mask(range(16))))


def _q4_k_decode_heads4(h, v):
    """_q4_k_scales_rows4 on the 4 heads already in one <16 x i32> (row k's in lane k)."""
    b = h.b
    c = lambda x: _const_vec(I32, 16, x)  # noqa: E731
    a = b.and_(v, c(0x3F3F3F3F))                                         # . t0 t2 .
    hi2 = b.shl(b.and_(b.lshr(v, c(6)), c(0x03030303)), c(4))            # . from u0, u1 .
    u2 = b.shuffle_vector(v, v, _mask([4 * k + 3 for k in range(4) for _ in range(4)]))
    lo4 = b.and_(b.lshr(u2, c([0, 0, 4, 0] * 4)), c(0x0F0F0F0F))
    t13 = b.or_(lo4, hi2)                                                # . t1 t3 .
    sm = b.shuffle_vector(a, t13, _mask([i for k in range(4) for i in (4 * k + 1, 17 + 4 * k, 4 * k + 2, 18 + 4 * k)]))
    return b.bitcast(sm, _vec(I8, 64)), b.shuffle_vector(v, v, _mask([0, 4, 8, 12]))


def _sum_rows4_512(h, vs):
    """4 x <16 x i32> -> <4 x i32> of their lane sums (exact): two unpack-and-add rounds
    leave each 128-bit lane holding [s0 s1 s2 s3] partials, then the lanes are added."""
    b = h.b

    def unpack_add(x, y, lo, hi):
        return b.add(b.shuffle_vector(x, y, _mask([16 * (i >= 2) + 4 * l + j for l in range(4) for i, j in enumerate(lo)])),
                     b.shuffle_vector(x, y, _mask([16 * (i >= 2) + 4 * l + j for l in range(4) for i, j in enumerate(hi)])))
    # per lane: [x0 x1 y0 y1] + [x2 x3 y2 y3] = [xa xb ya yb] (x's partial sum is xa + xb)
    t0 = unpack_add(vs[0], vs[1], (0, 1, 0, 1), (2, 3, 2, 3))
    t1 = unpack_add(vs[2], vs[3], (0, 1, 0, 1), (2, 3, 2, 3))
    u = unpack_add(t0, t1, (0, 2, 0, 2), (1, 3, 1, 3))                  # [s0 s1 s2 s3] per lane
    y = b.add(h.half(u, 0), h.half(u, 1))
    return b.add(h.half(y, 0), h.half(y, 1))


def _q4_k_rows4_block_512(h, wrows, xq, xd, xs, bi, acc, accm):
    """_q4_k_rows4_block on 512-bit vectors (AVX512-BW), float work on 4 lanes (one per
    row). The per-block work around the products, done row by row there (scale decode,
    min sums, d/dmin inserts, the cross-row reduction), is done here for the four rows at
    once: it was about half the loop's vector work. Same integers, same float ops per lane:
    the same bits."""
    b = h.b
    wo = b.mul(bi, _c64(144))
    sm, dm = _q4_k_scales_rows4(h, wrows, wo)
    isums = _q4_k_rows_isums_512(h, wrows, wo, xq, b.mul(bi, _c64(256)), sm)
    return _q4_k_rows4_finish_512(h, sm, dm, _sum_rows4_512(h, isums), xd, xs, bi, acc, accm)


def _lane_sums4(h, v):
    """<16 x i32> -> <4 x i32> of each 128-bit lane's sum (exact): two swap-and-add rounds."""
    b = h.b
    v = b.add(v, b.shuffle_vector(v, v, _mask([4 * l + j for l in range(4) for j in (1, 0, 3, 2)])))
    v = b.add(v, b.shuffle_vector(v, v, _mask([4 * l + j for l in range(4) for j in (2, 3, 0, 1)])))
    return b.shuffle_vector(v, v, _mask([0, 4, 8, 12]))


def _q4_k_rows4_finish_512(h, sm, dm, isum4, xd, xs, bi, acc, accm):
    """The float side of one block for 4 rows in 4 lanes: (acc, accm) + the block's terms,
    from the decoded heads (_q4_k_decode_heads4) and the rows' integer dots (<4 x i32>)."""
    b = h.b
    dx = h.load(xd, b.mul(bi, _c64(4)), F32T)
    # min sums: row k's 8 mins (i16, lane k) . the 8 per-32 activation sums (|s| <= 32*128,
    # exact in i16, the same in every lane)
    mins16 = b.bitcast(h._x86("llvm.x86.avx512.pshuf.b.512", _vec(I8, 64),
                              [sm, _const_vec(I8, 64, [v for j in range(8, 16) for v in (j, -128)] * 4)]), _vec(I16, 32))
    bs16 = b.trunc(h.pairs(h.load(xs, b.mul(bi, _c64(64)), _vec(I32, 16))), _vec(I16, 8))
    bs16 = b.shuffle_vector(bs16, bs16, _mask(list(range(8)) * 4))
    mp = h._x86("llvm.x86.avx512.pmaddw.d.512", _vec(I32, 16), [mins16, bs16])   # 4 partials per lane
    tot_m = b.sitofp(_lane_sums4(h, mp), _vec(F32T, 4))
    tot_i = b.sitofp(isum4, _vec(F32T, 4))
    dm16 = b.bitcast(dm, _vec(I16, 8))
    d = b.fpext(b.bitcast(b.shuffle_vector(dm16, dm16, _mask([0, 2, 4, 6])), _vec(F16T, 4)), _vec(F32T, 4))
    dmin = b.fpext(b.bitcast(b.shuffle_vector(dm16, dm16, _mask([1, 3, 5, 7])), _vec(F16T, 4)), _vec(F32T, 4))
    return [h.fma(b.fmul(d, h.splat(dx, 4)), tot_i, acc),
            h.fma(b.fmul(dmin, h.splat(b.fneg(dx), 4)), tot_m, accm)]


def _q4_k_rows4_block(h, wrows, xq, xd, xs, bi, acc, accm, x8=False):
    """One block of _q4_k_rows4_lanes: the new (acc, accm). x8: the rows are Q4_K_X8 row
    pointers (the 256-bit loop only: AVX-512 hosts take _q4_k_x8_block_512)."""
    if h.avx512bw and h.f16c and not x8:
        return _q4_k_rows4_block_512(h, wrows, xq, xd, xs, bi, acc, accm)
    b = h.b
    wo = b.mul(bi, _c64(_q4k_block_bytes(x8)))
    dx = h.load(xd, b.mul(bi, _c64(4)), F32T)
    bs32 = h.pairs(h.load(xs, b.mul(bi, _c64(64)), _vec(I32, 16)))     # per-32 sums of x
    xo = b.mul(bi, _c64(256))
    msums = []
    dm = ir.Constant(_vec(I32, 8), [0] * 8)
    # the 4 rows sub-block by sub-block, each activation vector loaded once for all of
    # them: rows one after another made LLVM keep all 8 activation vectors live (it shares
    # the identical loads) and spill; this order measured 11-15% faster, in L2 and from
    # memory. Integer sums are exact, so the order within a row changes no bit.
    sms = [_q4k_scales_vec(h, wrow, wo) for wrow in wrows]
    sc2s = [b.shuffle_vector(sm, sm, _mask(list(range(16)) * 2)) for sm in sms]   # both lanes
    isums = [ir.Constant(_vec(I32, 8), [0] * 8)] * len(wrows)
    for c in range(4):
        xvs = [h.load(xq, b.add(xo, _c64(64 * c + 32 * hi)), _vec(I8, 32)) for hi in range(2)]
        for k, wrow in enumerate(wrows):
            q = _q4k_qs32(h, wrow, wo, c, x8)
            for hi in range(2):   # sub-block 2c + hi: low nibbles, then high
                p16 = h.maddubs(_k_nibbles(h, q, hi), xvs[hi])             # pairs <= 2*15*128
                isums[k] = b.add(isums[k], h.madd_i16(p16, h.bcast_u8_as_i16(sc2s[k], 2 * c + hi)))
    for k, wrow in enumerate(wrows):
        mn32 = b.zext(b.shuffle_vector(sms[k], sms[k], _mask(range(8, 16))), _vec(I32, 8))
        msums.append(b.mul(mn32, bs32))
        dmk = h.load(wrow, wo, I32)                                     # d | dmin << 16
        dm = b.insert_element(b.insert_element(dm, dmk, ir.Constant(I32, k)), dmk, ir.Constant(I32, k + 4))
    tot_i = b.sitofp(_reduce_rows4(h, isums), _vec(F32T, 8))
    tot_m = b.sitofp(_reduce_rows4(h, msums), _vec(F32T, 8))
    dm16 = b.bitcast(dm, _vec(I16, 16))
    d = h.f16_lanes(b.shuffle_vector(dm16, dm16, _mask(range(0, 16, 2))))
    dmin = h.f16_lanes(b.shuffle_vector(dm16, dm16, _mask(range(1, 16, 2))))
    return [h.fma(b.fmul(d, h.splat(dx, 8)), tot_i, acc),
            h.fma(b.fmul(dmin, h.splat(b.fneg(dx), 8)), tot_m, accm)]


@intrinsic
def _rows4_q4_k(typingctx, w, r, xq, xd, xs, step):
    """Rows r, r+step, r+2*step, r+3*step of a Q4_K matrix as a tuple: see _q4_k_rows4_lanes."""
    sig = types.UniTuple(types.float32, ROWS)(w, r, xq, xd, xs, step)

    def codegen(context, builder, sig, args):
        return context.make_tuple(builder, sig.return_type, _q4_k_rows4_lanes(context, builder, sig, args))
    return sig, codegen


def _q4_k_x8_block_512(h, gbase, xq, xd, xs, bi, acc, accm, half):
    """One block of rows 4 half .. 4 half + 3 of a Q4_K_X8 group (AVX512-BW), row k in
    128-bit lane k: one 64-byte load brings the 4 heads, each 64-byte qs load the same 16
    bytes of all 4 rows. Per lane, the two vpmaddubsw of a sub-block's halves add in i16
    (<= 2 * 2*15*128), then one vpmaddwd with that row's scale (vpshufb picks byte j of
    each lane). Same exact integers as _q4_k_rows4_block_512, same float side: same bits."""
    b = h.b
    v64, v32i16, v16i32 = _vec(I8, 64), _vec(I16, 32), _vec(I32, 16)
    wo = b.add(b.mul(bi, _c64(X8_BLOCK)), _c64(64 * half))
    sm, dm = _q4_k_decode_heads4(h, h.load(gbase, wo, v16i32))
    xo = b.mul(bi, _c64(256))
    isum = ir.Constant(v16i32, [0] * 16)
    for c in range(4):
        s = [None, None]
        for piece in range(2):      # qs bytes 32c + 16 piece ..: piece t = 2c + piece
            q = h.load(gbase, b.add(wo, _c64(X8_ROWS * 16 + 128 * (2 * c + piece))), v64)
            for hi in range(2):     # sub-block 2c + hi: elements 16 piece .. of it
                nib = b.and_(q, _const_vec(I8, 64, 15)) if hi == 0 else b.lshr(q, _const_vec(I8, 64, 4))
                x16 = h.load(xq, b.add(xo, _c64(32 * (2 * c + hi) + 16 * piece)), _vec(I8, 16))
                p = h._x86("llvm.x86.avx512.pmaddubs.w.512", v32i16,
                           [nib, b.shuffle_vector(x16, x16, _mask(list(range(16)) * 4))])
                s[hi] = p if s[hi] is None else b.add(s[hi], p)
        for hi in range(2):
            sc = h._x86("llvm.x86.avx512.pshuf.b.512", v64, [sm, _const_vec(I8, 64, [2 * c + hi, -128] * 32)])
            isum = b.add(isum, h._x86("llvm.x86.avx512.pmaddw.d.512", v16i32, [s[hi], b.bitcast(sc, v32i16)]))
    return _q4_k_rows4_finish_512(h, sm, dm, _lane_sums4(h, isum), xd, xs, bi, acc, accm)


@intrinsic
def _rows8_q4_k_x8(typingctx, w, g, xq, xd, xs):
    """Rows 8g .. 8g + 7 of a Q4_K_X8 matrix as a tuple, each as _q4_k_rows4_lanes computes
    it (llama.cpp's repacked-gemv order): the same bits as the plain layout's kernel."""
    sig = types.UniTuple(types.float32, X8_ROWS)(w, g, xq, xd, xs)

    def codegen(context, builder, sig, args):
        b = builder
        (wrows, xq, xd, xs), nb = _array_ptrs(context, b, sig, [args[0], b.mul(args[1], _c64(X8_ROWS))] + list(args[2:]))
        gbase = wrows[0]
        h = _IR(b, _target_features(context))
        if h.avx512bw and h.f16c:
            zero = ir.Constant(_vec(F32T, 4), [0.0] * 4)

            def block(bi, accs):
                return (_q4_k_x8_block_512(h, gbase, xq, xd, xs, bi, *accs[:2], 0)
                        + _q4_k_x8_block_512(h, gbase, xq, xd, xs, bi, *accs[2:], 1))
        else:
            zero = ir.Constant(_vec(F32T, 8), [0.0] * 8)
            rows = [b.gep(gbase, [_c64(16 * k)]) for k in range(X8_ROWS)]

            def block(bi, accs):
                return (_q4_k_rows4_block(h, rows[:4], xq, xd, xs, bi, *accs[:2], x8=True)
                        + _q4_k_rows4_block(h, rows[4:], xq, xd, xs, bi, *accs[2:], x8=True))
        fin = _counted_loop(b, nb, 1, [zero] * 4, block, "q4kx8")
        vals = []
        for half in range(2):
            tot = b.fadd(fin[2 * half], fin[2 * half + 1])
            vals += [b.extract_element(tot, ir.Constant(I32, k)) for k in range(4)]
        return context.make_tuple(b, sig.return_type, vals)
    return sig, codegen


@intrinsic
def _fetch_add(typingctx, counter, inc):
    """counter[0] += inc atomically; returns the old value (the work-claim counter)."""
    sig = types.int64(counter, inc)

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", builder.bitcast(arr.data, I64.as_pointer()), args[1], "monotonic")
    return sig, codegen


CHUNK = 16   # rows per work item: the type dispatch and call overhead, once per chunk
#              (a multiple of ROWS: a 4-row group never straddles two chunks)


@njit(**_JIT)
def _quartered_rows(w, qt, r0, r1, xq, xd, xs, out):
    """Q8_0, Q6_K and Q4_K (rows % 8 == 0) "rows" r0..r1 in a quartered order: with
    q = n_rows // 4, slot v < 4q is row v // 4 + (v % 4) * q, slots from 4q on are rows
    themselves. Four rows a quarter of the matrix apart run in one loop: four long
    sequential streams for the prefetchers (four adjacent short rows were slower from
    memory, and eight streams a thread slower than four), shared activation loads, and,
    for Q8_0, four independent fma chains (one row's chain sets the pace otherwise).
    Every row keeps its own order: Q8_0 and Q6_K ggml_vec_dot's, Q4_K llama.cpp's
    repacked gemv's, one row per lane (_q4_k_rows4_lanes).
    Measured with 2 threads, old and new loop alternating in one run: Gemma's Q8_0 head
    (262144 x 640) 6.3 -> 5.6 ms against one row a loop; Q6_K 4096 x 14336 16.9 -> 22.8
    GB/s against one row a loop (8 rows spilled: 15.0); Q4_K 4096 x 14336 20.5 -> 24.1
    GB/s against 8 rows an eighth apart in 8 lanes."""
    q = out.shape[0] // ROWS
    v = r0
    while v + ROWS <= min(r1, ROWS * q):   # r0 is a multiple of CHUNK, so of ROWS
        i = v // ROWS
        if _HAS_Q8_0 and qt == Q8_0:
            a, b, c, d = _rows_q8_0(w, i, xq, xd, xs, q)
        elif _HAS_Q6_K and qt == Q6_K:
            a, b, c, d = _rows_q6_k(w, i, xq, xd, xs, q)
        elif _HAS_Q4_K:
            a, b, c, d = _rows4_q4_k(w, i, xq, xd, xs, q)
        else:   # not reached: the callers pass only these three types
            a = b = c = d = np.float32(0.0)
        out[i] = a
        out[i + q] = b
        out[i + 2 * q] = c
        out[i + 3 * q] = d
        v += ROWS
    for r in range(max(v, ROWS * q), r1):   # never for Q4_K (rows % 8 == 0)
        if _HAS_Q8_0 and qt == Q8_0:
            out[r] = _row_q8_0(w, r, xq, xd, xs)
        elif _HAS_Q6_K:
            out[r] = _row_q6_k(w, r, xq, xd, xs)


@njit(**_JIT)
def _dot_rows(w, qt, r0, r1, xq, xd, xs, out):
    """out[r] = row r of w . 8-bit activations for r0 <= r < r1, dispatched on the GGML
    type id once (the row intrinsics inline into each branch's loop)."""
    if _HAS_Q4_K_X8 and qt == Q4_K_X8:   # r0 and r1 are multiples of 8 (CHUNK and the row count are)
        for g in range(r0 // X8_ROWS, r1 // X8_ROWS):
            vals = _rows8_q4_k_x8(w, g, xq, xd, xs)
            for k in range(X8_ROWS):
                out[X8_ROWS * g + k] = vals[k]
    elif _HAS_Q6_K and qt == Q6_K:
        _quartered_rows(w, qt, r0, r1, xq, xd, xs, out)
    elif _HAS_Q8_0 and qt == Q8_0:
        _quartered_rows(w, qt, r0, r1, xq, xd, xs, out)
    elif _HAS_Q4_K and qt == Q4_K and w.shape[0] % 8 == 0:
        _quartered_rows(w, qt, r0, r1, xq, xd, xs, out)
    elif _HAS_Q4_K and qt == Q4_K:   # llama.cpp repacks only matrices with rows % 8 == 0
        for r in range(r0, r1):
            out[r] = _row_q4_k(w, r, xq, xd, xs)
    elif _HAS_Q5_0 and qt == Q5_0:
        for r in range(r0, r1):
            out[r] = _row_q5_0(w, r, xq, xd, xs)
    elif _HAS_Q5_K and qt == Q5_K:
        for r in range(r0, r1):
            out[r] = _row_q5_k(w, r, xq, xd, xs)
    elif _HAS_Q4_0 and qt == Q4_0:
        for r in range(r0, r1):
            out[r] = _row_q4_0(w, r, xq, xd, xs)
    elif _HAS_Q4_1 and qt == Q4_1:
        for r in range(r0, r1):
            out[r] = _row_q4_1(w, r, xq, xd, xs)
    elif _HAS_Q5_1 and qt == Q5_1:
        for r in range(r0, r1):
            out[r] = _row_q5_1(w, r, xq, xd, xs)
    elif _HAS_IQ4_NL and qt == IQ4_NL:
        for r in range(r0, r1):
            out[r] = _row_iq4_nl(w, r, xq, xd, xs)
    elif _HAS_Q3_K and qt == Q3_K:
        for r in range(r0, r1):
            out[r] = _row_q3_k(w, r, xq, xd, xs)
    elif _HAS_Q2_K and qt == Q2_K:
        for r in range(r0, r1):
            out[r] = _row_q2_k(w, r, xq, xd, xs)
    elif _HAS_IQ4_XS and qt == IQ4_XS:
        for r in range(r0, r1):
            out[r] = _row_iq4_xs(w, r, xq, xd, xs)


@njit(**_JIT)
def _n_items(n_rows):
    return (n_rows + CHUNK - 1) // CHUNK


@njit(**_JIT)
def _matvec_item(w, qt, xq, xd, xs, out, g):
    """Work item g (rows g*CHUNK ..) of out = w . x."""
    r0 = g * CHUNK
    _dot_rows(w, qt, r0, min(r0 + CHUNK, out.shape[0]), xq, xd, xs, out)


@njit(**_JIT)
def _deq_row(w, qt, r, y, i):
    """y[i] = dequantized row r of w, dispatched on the GGML type id."""
    if _HAS_Q4_K and qt == Q4_K:
        _deq_row_q4_k(w, r, y, i)
    elif _HAS_Q4_K_X8 and qt == Q4_K_X8:
        _deq_row_q4_k_x8(w, r, y, i)
    elif _HAS_Q6_K and qt == Q6_K:
        _deq_row_q6_k(w, r, y, i)
    elif _HAS_Q8_0 and qt == Q8_0:
        _deq_row_q8_0(w, r, y, i)
    elif _HAS_Q5_0 and qt == Q5_0:
        _deq_row_q5_0(w, r, y, i)
    elif _HAS_Q5_K and qt == Q5_K:
        _deq_row_q5_k(w, r, y, i)
    elif _HAS_Q4_0 and qt == Q4_0:
        _deq_row_q4_0(w, r, y, i)
    elif _HAS_Q4_1 and qt == Q4_1:
        _deq_row_q4_1(w, r, y, i)
    elif _HAS_Q5_1 and qt == Q5_1:
        _deq_row_q5_1(w, r, y, i)
    elif _HAS_IQ4_NL and qt == IQ4_NL:
        _deq_row_iq4_nl(w, r, y, i)
    elif _HAS_Q3_K and qt == Q3_K:
        _deq_row_q3_k(w, r, y, i)
    elif _HAS_Q2_K and qt == Q2_K:
        _deq_row_q2_k(w, r, y, i)
    elif _HAS_IQ4_XS and qt == IQ4_XS:
        _deq_row_iq4_xs(w, r, y, i)


# Decode matvecs share their work items out by claims on an atomic counter, not by a
# static split of the rows: a thread whose core is slowed (a busy SMT sibling, another
# process) takes fewer claims. On a shared 2-vCPU host whose cores' speeds drift apart
# by up to 25%, 2-thread matvecs measured 3-16% faster in medians than the static split,
# and more so in their slow tails. Each row is computed as before: the same bits.
CLAIMS_PER_THREAD = 8   # the last claim leaves at most ~1/8 of a share unbalanced


@njit(**_JIT)
def _claimed_items(claims, n_threads, w1, q1, o1, w2, q2, o2, w3, q3, o3, xq, xd, xs):
    """On one thread: claim runs of work items from claims[0] until none are left. Items
    number o1's rows, then o2's, then o3's (all on the same activations; o2 and o3 may be
    empty)."""
    n1 = _n_items(o1.shape[0])
    n12 = n1 + _n_items(o2.shape[0])
    n = n12 + _n_items(o3.shape[0])
    step = max(1, n // (CLAIMS_PER_THREAD * n_threads))
    g0 = _fetch_add(claims, step)
    while g0 < n:
        g1 = min(g0 + step, n)
        _claimed_rows(w1, q1, o1, g0, g1, xq, xd, xs)
        _claimed_rows(w2, q2, o2, g0 - n1, g1 - n1, xq, xd, xs)
        _claimed_rows(w3, q3, o3, g0 - n12, g1 - n12, xq, xd, xs)
        g0 = _fetch_add(claims, step)


@njit(**_JIT)
def _claimed_rows(w, qt, out, g0, g1, xq, xd, xs):
    """The rows of out's work items g0..g1 (numbered from this matrix's first; those
    outside it skipped) in one _dot_rows call: one type dispatch a claim, not an item."""
    a = max(g0, 0)
    b = min(g1, _n_items(out.shape[0]))
    if a < b:
        _dot_rows(w, qt, a * CHUNK, min(b * CHUNK, out.shape[0]), xq, xd, xs, out)


@njit(parallel=True, **_JIT)
def _matvec_kernel(w1, q1, w2, q2, w3, q3, xq, xd, xs, o1, o2, o3, nt):
    # up to three matrices on the same activations in one parallel region (Q, K, V;
    # gate + up): o2 and o3 may be empty. nt: the thread count, passed in (numba's
    # get_num_threads inside a kernel would keep it out of the on-disk cache)
    claims = np.zeros(1, np.int64)
    for _ in prange(nt):   # one iteration per thread
        _claimed_items(claims, nt, w1, q1, o1, w2, q2, o2, w3, q3, o3, xq, xd, xs)


_NO_OUT = np.empty(0, np.float32)


@njit(parallel=True, **_JIT)
def _matmul_kernel(w, qt, xq, xd, xs, out):
    # each group of weight rows is read once (it stays in L1/L2) for all tokens
    for g in prange(_n_items(w.shape[0])):
        for t in range(xq.shape[0]):
            _matvec_item(w, qt, xq[t], xd[t], xs[t], out[t], g)


@njit(parallel=True, **_JIT)
def _dequant_kernel(w, qt, start, y):
    for i in prange(y.shape[0]):
        _deq_row(w, qt, start + i, y, i)


@njit(**_JIT)
def _dequant_kernel_serial(w, qt, start, y):
    # for callers that run their own threads (the prefill GEMM splits rows across threads)
    for i in range(y.shape[0]):
        _deq_row(w, qt, start + i, y, i)


@njit(parallel=True, **_JIT)
def _dequant_rows_kernel(w, qt, rows, y):
    for i in prange(y.shape[0]):
        _deq_row(w, qt, rows[i], y, i)


# ----------------------------------------------------------------------------- kernels per type set
# A kernel dispatching on the type id at run time compiles every type's code: ~14 s of a
# first start for all of them, where a model uses 3-5. `kernels_for(types)` copies the
# dispatching functions and the kernels above with the flags of the other types False
# (Python function copies reading their own globals; each named after its types, so each
# has its own file in Numba's on-disk cache), made once per type set and process. The
# code of a type is the one definition above, whichever copies contain it: the same bits.

_SPECIALISED = ("_quartered_rows", "_dot_rows", "_deq_row", "_matvec_item", "_claimed_rows",
                "_claimed_items", "_matvec_kernel", "_matmul_kernel", "_dequant_kernel",
                "_dequant_kernel_serial", "_dequant_rows_kernel")   # callees before callers
_SETS: dict = {}         # type set (sorted tuple) -> its kernels
_MODEL_SETS: list = []   # sets registered by use_types, the latest first
_FOR_CALL: dict = {}     # the types of one call -> the kernels that serve it


class KernelSet:
    """The kernels of fast_dot for a set of type ids (attributes named as the generic ones)."""

    def __init__(self, qts: tuple) -> None:
        self.types = qts
        g = dict(globals())
        g.update({f"_HAS_{name}": qt in qts for qt, name in _TYPE_NAMES.items()})
        suffix = "_" + "_".join(_TYPE_NAMES[qt] for qt in qts)
        for name in _SPECIALISED:
            generic = globals()[name]
            f = generic.py_func
            copy = FunctionType(f.__code__, g, name + suffix, f.__defaults__, f.__closure__)
            copy.__qualname__, copy.__module__, copy.__doc__ = name + suffix, f.__module__, f.__doc__
            opts = {k: v for k, v in generic.targetoptions.items() if k in ("parallel", "nogil")}
            g[name] = njit(cache=True, **opts)(copy)
            setattr(self, name, g[name])

    def forward_kernels(self) -> list:
        """The kernels a short prompt and a decoded token compile (matvec, the 8-bit
        matmul, the row lookup), for compile_progress.warm_up's check."""
        return [self._matvec_kernel, self._matmul_kernel, self._dequant_rows_kernel]


def kernel_set(qts) -> KernelSet:
    """The kernels for exactly these type ids (made on first use)."""
    key = tuple(sorted({int(t) for t in qts}))
    if not all(has_fast_path(t) for t in key):
        raise ValueError(f"no fast path for type ids {key}")
    got = _SETS.get(key)
    if got is None:
        got = _SETS[key] = KernelSet(key)
    return got


def use_types(qts) -> KernelSet | None:
    """Register the fast-path types of a model (as the kernels see them: repacked ids):
    calls on these types use one kernel set for all of them. Returns it (None when the
    model has no fast-path type)."""
    key = tuple(sorted({int(t) for t in qts if has_fast_path(int(t))}))
    if not key:
        return None
    if key in _MODEL_SETS:
        _MODEL_SETS.remove(key)
    _MODEL_SETS.insert(0, key)
    _FOR_CALL.clear()
    return kernel_set(key)


def kernels_for(*qts: int) -> KernelSet:
    """The kernel set serving a call on these types: the latest registered model set that
    holds them all, else the set of exactly these types."""
    got = _FOR_CALL.get(qts)
    if got is None:
        need = set(qts)
        key = next((s for s in _MODEL_SETS if need <= set(s)), tuple(sorted(need)))
        got = _FOR_CALL[qts] = kernel_set(key)
    return got


def has_fast_path(qt: int) -> bool:
    return qt in FAST_TYPES or qt == Q4_K_X8


def matvec_fast(w_raw: np.ndarray, qt: int, xq, xd, xs, out) -> None:
    """out[r] = row r . activations (quantized by matvec.quantize_activations) for a fast-path type."""
    kernels_for(qt)._matvec_kernel(w_raw, qt, w_raw, qt, w_raw, qt, xq, xd, xs, out, _NO_OUT, _NO_OUT,
                                   get_threads())


def matmul_int(w_raw: np.ndarray, qt: int, xq, xd, xs, out) -> None:
    """out[t, r] = row r . token t's 8-bit activations (xq/xd/xs with one row per token)."""
    kernels_for(qt)._matmul_kernel(w_raw, qt, xq, xd, xs, out)


def dequantize_fast(w_raw: np.ndarray, qt: int, start: int, y: np.ndarray) -> None:
    """y[i] = dequantized row start + i of w, for a fast-path type; y float32 (n, n_cols) C-contiguous."""
    kernels_for(qt)._dequant_kernel(w_raw, qt, start, y)


def dequantize_fast_serial(w_raw: np.ndarray, qt: int, start: int, y: np.ndarray) -> None:
    """dequantize_fast on the calling thread only (no parallel region; releases the GIL)."""
    kernels_for(qt)._dequant_kernel_serial(w_raw, qt, start, y)


def dequantize_rows_fast(w_raw: np.ndarray, qt: int, rows: np.ndarray, y: np.ndarray) -> None:
    """y[i] = dequantized row rows[i] of w (int64 ids, validated by the caller)."""
    kernels_for(qt)._dequant_rows_kernel(w_raw, qt, rows, y)


def matvec_fast_many(ws: list, qts: list, xq, xd, xs, outs: list) -> None:
    """matvec_fast for 2 or 3 matrices sharing the quantized activations, in one call."""
    if len(ws) == 2:
        kernels_for(*qts)._matvec_kernel(ws[0], qts[0], ws[1], qts[1], ws[1], qts[1], xq, xd, xs, outs[0], outs[1],
                                         _NO_OUT, get_threads())
    elif len(ws) == 3:
        kernels_for(*qts)._matvec_kernel(ws[0], qts[0], ws[1], qts[1], ws[2], qts[2], xq, xd, xs, outs[0], outs[1],
                                         outs[2], get_threads())
    else:
        for w, qt, out in zip(ws, qts, outs):
            matvec_fast(w, qt, xq, xd, xs, out)
