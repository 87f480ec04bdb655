"""LLVM-IR helpers the CPU kernels are written with: vector types, an IRBuilder toolkit, row loops.

Numba's auto-vectorizer leaves the integer block dots mostly scalar, so each row's whole
loop over blocks is emitted as IR through `numba.extending.intrinsic` (dot_q32.py,
dot_kquant.py, dot_q4k_x8.py; dispatch.py runs `prange` over rows). This file holds what
they share: `IRHelpers` over an IRBuilder (loads, fp16 conversion, the x86 integer
products), the row and dequantization loops, and the Q4_K_X8 layout's pointers.

Target CPU: x86 AVX2 intrinsics (pmaddubsw, pmaddwd, psignb, pshufb) are emitted only
when the CPU Numba compiles for has AVX2 (they abort the process elsewhere); other
targets get portable IR for the same arithmetic (no F16C: fp16 scales converted with
integer ops). Loads use align 1: blocks are not aligned (34 bytes for Q8_0).
Pair sums never saturate: each caller bounds them in a comment.

Kernels in other files are built from these helpers; Numba's cache is keyed to every
source here (cache_dir.py), so a change of a helper recompiles them.
"""
from __future__ import annotations

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

llvm.initialize_native_asmparser()   # load_f16's one inline `vmovd` needs it

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16T, F32T = ir.HalfType(), ir.FloatType()


def vec(t, n):
    return ir.VectorType(t, n)


def const_vec(t, n, values):
    return ir.Constant(vec(t, n), list(values) if hasattr(values, "__iter__") else [values] * n)


def mask(idx):
    return ir.Constant(vec(I32, len(idx)), list(idx))


def has_vnni_features(feats: set[str]) -> bool:
    """Whether a CPU with these LLVM features has 256-bit vpdpbusd (AVX512-VNNI with VL, or AVX-VNNI)."""
    return "+avxvnni" in feats or {"+avx512vnni", "+avx512vl"} <= feats


def as_i8(u: int) -> int:
    """An unsigned byte value (0..255) as the signed i8 constant with the same bits."""
    return ((u + 128) & 255) - 128


class IRHelpers:
    """Small helpers over an IRBuilder."""

    def __init__(self, builder: ir.IRBuilder, feats: set[str]):
        self.b = builder
        self.avx2 = "+avx2" in feats
        self.avx512bw = "+avx512bw" in feats
        self.f16c = "+f16c" in feats
        self.vnni = has_vnni_features(feats)
        self.bmi = "+bmi" in feats

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
        v = b.asm(ir.FunctionType(vec(I32, 4), [I32]), "vmovd $1, $0", "=x,r", [bits32], False)
        v8 = b.bitcast(v, vec(F16T, 8))
        return b.fpext(b.shuffle_vector(v8, v8, mask(range(4))), vec(F32T, 4))

    def f16_value(self, v16):
        """An i16 of fp16 bits (a value, not memory) -> float."""
        b = self.b
        if self.f16c:
            return b.fpext(b.bitcast(v16, F16T), F32T)
        ptr = cgutils.alloca_once(b, I16)   # load_f16 reads memory; entry block: promoted
        b.store(v16, ptr)
        return self.load_f16(b.bitcast(ptr, I8.as_pointer()), c64(0))

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
        return b.fpext(v, vec(F32T, 8))

    def load_f16x2(self, base, off):
        """Two adjacent fp16 at base+off -> <4 x float> [a, b, 0, 0]."""
        b = self.b
        if not self.f16c:
            z = ir.Constant(vec(F32T, 4), [0.0] * 4)
            z = b.insert_element(z, self.load_f16(base, off), ir.Constant(I32, 0))
            return b.insert_element(z, self.load_f16(base, b.add(off, c64(2))), ir.Constant(I32, 1))
        return self._f16_pair(self.load(base, off, I32))

    def narrow_i32_i16(self, v):
        """<16 x i32> (each fits i16) -> <16 x i16>, same lane order."""
        b = self.b
        if self.avx2:  # vpackssdw interleaves 128-bit halves; vpermq puts them back
            p = self.x86("llvm.x86.avx2.packssdw", vec(I16, 16), [self.half(v, 0), self.half(v, 1)])
            q = b.bitcast(p, vec(I64, 4))
            return b.bitcast(b.shuffle_vector(q, q, mask([0, 2, 1, 3])), vec(I16, 16))
        return b.trunc(v, vec(I16, 16))

    def pick_i16_halves(self, v, j, k):
        """<16 x i16> whose halves both hold the same 8 values -> lane j in the low 8
        lanes, lane k in the high 8 (one vpshufb on AVX2)."""
        b = self.b
        if self.avx2:
            m = const_vec(I8, 32, [2 * j, 2 * j + 1] * 8 + [2 * k, 2 * k + 1] * 8)
            vb = b.bitcast(v, vec(I8, 32))
            return b.bitcast(self.x86("llvm.x86.avx2.pshuf.b", vec(I8, 32), [vb, m]), vec(I16, 16))
        return b.shuffle_vector(v, v, mask([j] * 8 + [k + 8] * 8))

    def f16_lanes(self, v16):
        """<n x i16> fp16 bits -> <n x float> (one vcvtph2ps with F16C; elsewhere lane by
        lane in integer ops: LLVM's own fpext would call __extendhfsf2, which Numba's JIT lacks)."""
        b, n = self.b, v16.type.count
        if self.f16c:
            return b.fpext(b.bitcast(v16, vec(F16T, n)), vec(F32T, n))
        out = ir.Constant(vec(F32T, n), [0.0] * n)
        for k in range(n):  # the integer conversion, lane by lane
            out = b.insert_element(out, self.f16_value(b.extract_element(v16, ir.Constant(I32, k))),
                                   ir.Constant(I32, k))
        return out

    def bcast_u8_as_i16(self, bytes2, j):
        """<32 x i8> (16 bytes repeated in both halves) -> <16 x i16>, every lane byte j
        zero-extended: one vpshufb on AVX2."""
        b = self.b
        if self.avx2:
            m = const_vec(I8, 32, [j, -128] * 16)    # -128 (0x80): write a zero byte
            return b.bitcast(self.x86("llvm.x86.avx2.pshuf.b", vec(I8, 32), [bytes2, m]), vec(I16, 16))
        return b.zext(b.shuffle_vector(bytes2, bytes2, mask([j] * 16)), vec(I16, 16))

    def splat(self, scalar, n):
        v = self.b.insert_element(ir.Constant(vec(scalar.type, 1), ir.Undefined), scalar, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, v, mask([0] * n))

    def half(self, v, which):
        n = v.type.count // 2
        return self.b.shuffle_vector(v, v, mask(range(which * n, which * n + n)))

    def pairs(self, v):
        """Add neighbouring lanes: <2n x i32> -> <n x i32> (the pmaddwd shape)."""
        n = v.type.count // 2
        ev = self.b.shuffle_vector(v, v, mask(range(0, 2 * n, 2)))
        od = self.b.shuffle_vector(v, v, mask(range(1, 2 * n, 2)))
        return self.b.add(ev, od)

    def bits(self, v, shift: int, width: int):
        """(v >> shift) & (2^width - 1) for an i32 or i64 v: one bextr where the CPU has BMI
        and shift > 0 (LLVM lowers the shift-and of a 64-bit value to mov + shr + movzbl,
        three instructions, where a kernel extracts one byte index after another; with no
        shift the and alone is as short)."""
        ty = v.type
        if self.bmi and shift:
            return self.x86(f"llvm.x86.bmi.bextr.{ty.width}", ty, [v, ir.Constant(ty, (width << 8) | shift)])
        b = self.b
        return b.and_(b.lshr(v, ir.Constant(ty, shift)), ir.Constant(ty, (1 << width) - 1))

    def x86(self, name, ret, args):
        mod = self.b.module
        fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ret, [a.type for a in args]), name)
        return self.b.call(fn, args)

    def maddubs(self, a8, x8):
        """<32 x i8> a (unsigned) . <32 x i8> x (signed) -> <16 x i16> pair sums (vpmaddubsw).

        Callers keep |a_even*x_even + a_odd*x_odd| < 2^15, so the AVX2 instruction's
        saturation never triggers and the portable version needs none.
        """
        if self.avx2:
            return self.x86("llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [a8, x8])
        b = self.b
        p = b.mul(b.zext(a8, vec(I16, 32)), b.sext(x8, vec(I16, 32)))
        ev = b.shuffle_vector(p, p, mask(range(0, 32, 2)))
        od = b.shuffle_vector(p, p, mask(range(1, 32, 2)))
        return b.add(ev, od)

    def dpbusd(self, acc, a_u8, x_s8):
        """acc + <32 x i8> unsigned a . <32 x i8> signed x summed in fours -> <8 x i32>
        (one vpdpbusd; only where self.vnni)."""
        b = self.b
        return self.x86("llvm.x86.avx512.vpdpbusd.256", vec(I32, 8),
                         [acc, b.bitcast(a_u8, vec(I32, 8)), b.bitcast(x_s8, vec(I32, 8))])

    def madd_i16(self, s16, m16):
        """<16 x i16> . <16 x i16> -> <8 x i32> pair sums (vpmaddwd)."""
        if self.avx2:
            return self.x86("llvm.x86.avx2.pmadd.wd", vec(I32, 8), [s16, m16])
        b = self.b
        return self.pairs(b.mul(b.sext(s16, vec(I32, 16)), b.sext(m16, vec(I32, 16))))

    def sign_i8(self, x8, w8):
        """x * sign(w) per lane (vpsignb)."""
        if self.avx2:
            return self.x86("llvm.x86.avx2.psign.b", vec(I8, 32), [x8, w8])
        b = self.b
        zero = const_vec(I8, 32, 0)
        neg = b.select(b.icmp_signed("<", w8, zero), b.sub(zero, x8), x8)
        return b.select(b.icmp_signed("==", w8, zero), zero, neg)

    def abs_i8(self, w8):
        b = self.b
        zero = const_vec(I8, 32, 0)
        return b.select(b.icmp_signed("<", w8, zero), b.sub(zero, w8), w8)

    def lut16(self, idx, table):
        """<32 x i8> indices 0..15 -> table[idx] (vpshufb on AVX2; scalar loads elsewhere)."""
        b = self.b
        if self.avx2:
            return self.x86("llvm.x86.avx2.pshuf.b", vec(I8, 32), [const_vec(I8, 32, list(table) * 2), idx])
        name = "edgeinfer_lut16_" + "_".join(str(v & 255) for v in table)
        g = b.module.globals.get(name) or cgutils.global_constant(
            b.module, name, ir.Constant(ir.ArrayType(I8, 16), [v & 255 for v in table]))
        out = ir.Constant(vec(I8, 32), [0] * 32)
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


def reduce_f32x8(b, accs):
    """GGML_F32x8_REDUCE of four <8 x float> accumulators (ggml_vec_dot_f32/f16 on AVX2):
    (x0 + x2) + (x1 + x3), the halves added, then two horizontal adds."""
    x = b.fadd(b.fadd(accs[0], accs[2]), b.fadd(accs[1], accs[3]))
    t = b.fadd(b.shuffle_vector(x, x, mask(range(4))), b.shuffle_vector(x, x, mask(range(4, 8))))
    e = [b.extract_element(t, ir.Constant(I32, k)) for k in range(4)]
    return b.fadd(b.fadd(e[0], e[1]), b.fadd(e[2], e[3]))


def target_features(context) -> set[str]:
    """Features of the CPU Numba compiles for (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, else the host).

    x86 AVX2 intrinsics are emitted only where "+avx2" is present (elsewhere they would
    abort the process); Numba keys its on-disk cache by CPU name and this feature string.
    """
    cg = context.codegen()
    feats = getattr(cg, "_tm_features", None)
    if feats is None:
        feats = cg._get_host_cpu_features()
    return set(feats.split(","))


def array_ptrs(context, builder, sig, args, nrows=1):
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


def counted_loop(builder, n, step, inits, body, name):
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


def row_loop(context, builder, sig, args, body, with_mins=False, nrows=1, block_bytes=0):
    """Emit `for b in range(nb): acc[k] = body(row k, b, acc[k])` for nrows rows; return
    the rows' horizontal sums.

    Each row keeps one <8 x float> accumulator over the blocks in order, then the AVX
    horizontal sum: llama.cpp's exact float order, so results match it bit for bit.
    Several rows per loop share the activation loads and overlap their fma chains (one
    row's chain of dependent fmas would set the pace for the short-bodied types).
    with_mins: the body also takes and returns a <4 x float> accumulator for the K-quant
    min terms, which llama.cpp keeps apart and adds at the end.
    """
    (wrows, xq, xd, xs), nb = array_ptrs(context, builder, sig, args, nrows)
    h = IRHelpers(builder, target_features(context))
    return _dots_loop(builder, h, [(wrow, xq, xd, xs) for wrow in wrows], nb, body, with_mins,
                      wrows, block_bytes)


def prefetch_lines(h, streams, bi, block_bytes, dist):
    """Prefetch every cache line of block bi + dist bytes in each stream (row pointers)."""
    b = h.b
    ahead = b.add(b.mul(bi, c64(block_bytes)), c64(dist))
    for wrow in streams:
        for line in range(0, block_bytes, 64):
            h.prefetch(b.gep(wrow, [b.add(ahead, c64(line))]))


def prefetch_row_streams(h, streams, bi, block_bytes):
    """A row loop's software prefetch of block bi's lines ahead in each of its row streams
    (x86 prefetches never fault, so running past the matrix's end is harmless): 4 KiB ahead
    in a lone stream, 1 KiB in each of several. Blocks of more than a line (the K-quants)
    prefetch on AVX-512 hosts only: measured there (Xeon, Q6_K 4096 x 14336 from memory:
    23-27 -> 32-36 GB/s); on Zen 3 one line a block had lost."""
    if block_bytes > 64 and not h.avx512bw:
        return
    prefetch_lines(h, streams, bi, block_bytes, 4096 if len(streams) == 1 else 1024)


def _dots_loop(builder, h, pairs, nb, body, with_mins, streams, block_bytes, block_scales=False):
    """`for b in range(nb): acc[k] = body(pairs[k]..., b, acc[k])` over (wrow, xq, xd, xs)
    pairs (several rows against one token: row_loop; one row against several tokens:
    token_row_loop), each pair with its own accumulators; returns each pair's horizontal
    sum. block_bytes > 0: prefetch_row_streams on `streams`. block_scales (32-element
    types whose block starts with its fp16 scale, F16C hosts): the loop runs SCALE_GROUP
    blocks a step and hands the body each block's d = weight scale * activation scale
    from group_scales, the remainder blocks one a step as before."""
    zero = ir.Constant(vec(F32T, 8), [0.0] * 8)
    zero4 = ir.Constant(vec(F32T, 4), [0.0] * 4)
    width = 2 if with_mins else 1        # accumulators per pair, flattened for the loop

    def blocks(i, accs, ds=None):
        if block_bytes:
            prefetch_row_streams(h, streams, i, block_bytes)
        out = []
        for k, (wrow, xq, xd, xs) in enumerate(pairs):
            given = {} if ds is None else {"d": ds[k]}
            if with_mins:
                out += body(h, wrow, xq, xd, xs, i, tuple(accs[2 * k:2 * k + 2]), **given)
            else:
                out.append(body(h, wrow, xq, xd, xs, i, accs[k], **given))
        return out

    def group(i, accs):
        ds = [group_scales(h, wrow, xd, i, block_bytes) for wrow, _, xd, _ in pairs]
        for k in range(SCALE_GROUP):
            accs = blocks(builder.add(i, c64(k)), accs, [builder.shuffle_vector(d, d, mask([k] * 8)) for d in ds])
        return accs
    inits = [zero, zero4][:width] * len(pairs)
    if block_scales and h.f16c:
        n_grouped = builder.mul(builder.sdiv(nb, c64(SCALE_GROUP)), c64(SCALE_GROUP))
        mid = counted_loop(builder, n_grouped, SCALE_GROUP, inits, group, "qdot4")
        fin = counted_loop(builder, builder.sub(nb, n_grouped), 1, mid,
                           lambda i, accs: blocks(builder.add(i, n_grouped), accs), "qdot")
    else:
        fin = counted_loop(builder, nb, 1, inits, blocks, "qdot")
    sums = []
    for k in range(len(pairs)):
        hs = [h.hsum_f32(r) for r in fin[width * k:width * k + width]]
        sums.append(builder.fadd(hs[0], hs[1]) if with_mins else hs[0])
    return sums


# Blocks whose scale products group_scales forms in one multiply. Per block and token the
# 32-element bodies spend 6 vector ops on AVX2 (the scale product one of them), all on the
# same two ports of an Intel core; one multiply for four blocks and a lane broadcast (another
# port) take the product off them.
SCALE_GROUP = 4


def group_scales(h, wrow, xd, bi, block_bytes):
    """d of blocks bi..bi + 3 as <4 x float>: each block's leading fp16 scale times its
    activation scale, lane by lane the float products the bodies form one at a time. The
    scales go in one by one from a zero vector (vpinsrw into a register of its own)."""
    b = h.b
    v = ir.Constant(vec(I16, SCALE_GROUP), [0] * SCALE_GROUP)
    for k in range(SCALE_GROUP):
        v = b.insert_element(v, h.load(wrow, b.mul(b.add(bi, c64(k)), c64(block_bytes)), I16), ir.Constant(I32, k))
    dw = b.fpext(b.bitcast(v, vec(F16T, SCALE_GROUP)), vec(F32T, SCALE_GROUP))
    return b.fmul(dw, h.load(xd, b.mul(bi, c64(4)), vec(F32T, SCALE_GROUP)))


def c64(v):
    return ir.Constant(I64, v)


def arithmetic_fence(builder, v):
    """v (float32, or a vector of them) through llvm.arithmetic.fence: LLVM fuses a product
    into the add that consumes it (an fma) even without fast-math flags; a product passed
    through this keeps its own rounding, as a C compiler's separate vmulps then vaddss."""
    name = "llvm.arithmetic.fence." + (f"v{v.type.count}f32" if isinstance(v.type, ir.VectorType) else "f32")
    fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(v.type, [v.type]), name)
    return builder.call(fn, [v])


# Q4_K_X8 (repack.py): per group of 8 rows, each block is the 8 rows' 16-byte heads (d,
# dmin, 12 scale bytes), then 8 pieces of 128 bytes, piece t holding qs bytes 16t..16t+16
# of every row. A row's pointer is the group's + 16 * (row % 8); from it, block bi's head
# is at X8_BLOCK * bi and its qs piece t at X8_BLOCK * bi + 128 + 128 * t.
X8_ROWS = 8
X8_BLOCK = X8_ROWS * 144


def x8_row_ptr(builder, base, stride0, r):
    """Row r's pointer in a Q4_K_X8 matrix at base (i8*) with row stride stride0."""
    k = builder.and_(r, c64(X8_ROWS - 1))
    group = builder.mul(builder.sub(r, k), stride0)
    return builder.gep(base, [builder.add(group, builder.mul(k, c64(16)))])


def row_ptrs(builder, arr, first, n, x8=False):
    """i8* to rows first..first+n-1 of a Numba array struct (context.make_array's), by its
    first stride; x8: rows of a Q4_K_X8 matrix (x8_row_ptr)."""
    stride = cgutils.unpack_tuple(builder, arr.strides)[0]
    base = builder.bitcast(arr.data, I8.as_pointer())
    rows = [builder.add(first, c64(k)) for k in range(n)]
    if x8:
        return [x8_row_ptr(builder, base, stride, r) for r in rows]
    return [builder.gep(base, [builder.mul(r, stride)]) for r in rows]


def row_pointer(builder, arr, block=None):
    """t -> i8* to row t of a Numba array struct (context.make_array's): arr[t], or with
    `block` (an i64) arr[block, t] of a block-major array."""
    strides = cgutils.unpack_tuple(builder, arr.strides)
    base = builder.bitcast(arr.data, I8.as_pointer())
    if block is not None:
        base = builder.gep(base, [builder.mul(block, strides[0])])
    stride = strides[0] if block is None else strides[1]
    return lambda t: builder.gep(base, [builder.mul(t, stride)])

ROWS = 4   # rows per loop of the multi-row kernels (_quartered_rows unpacks 4)


def make_sums_intrinsic(sums, nrows=1):
    """An intrinsic over `sums(context, builder, sig, args, nrows)`, which emits the dots of
    nrows rows and returns them: row_dot(w, r, xq, xd, xs) -> float32; with nrows > 1,
    rows_dot(w, r, xq, xd, xs, step) -> the tuple of rows r, r+step, ... r+(nrows-1)*step (the
    caller keeps them inside the matrix)."""
    if nrows > 1:
        @intrinsic
        def rows_dot(typingctx, w, r, xq, xd, xs, step):
            sig = types.UniTuple(types.float32, nrows)(w, r, xq, xd, xs, step)

            def codegen(context, builder, sig, args):
                return context.make_tuple(builder, sig.return_type, sums(context, builder, sig, args, nrows))
            return sig, codegen
        return rows_dot

    @intrinsic
    def row_dot(typingctx, w, r, xq, xd, xs):
        sig = types.float32(w, r, xq, xd, xs)

        def codegen(context, builder, sig, args):
            return sums(context, builder, sig, args, 1)[0]
        return sig, codegen
    return row_dot


def make_row_intrinsic(body, with_mins=False, nrows=1, block_bytes=0):
    """make_sums_intrinsic over `row_loop` with this block body; block_bytes > 0 (the type's
    block size) turns on software prefetch."""
    def sums(context, builder, sig, args, n):
        return row_loop(context, builder, sig, args, body, with_mins, n, block_bytes)
    return make_sums_intrinsic(sums, nrows)



TOKENS_A_ROW = 4   # most tokens a row loop of make_tokens_intrinsic serves (by default)
# the 32-element types' loops hold 8 tokens' accumulators on AVX2 (a block's values are one
# register): a 5- to 8-token batch (a speculative draft checked, the lm head of every
# verified token) reads and unpacks each block once, not twice
WIDE_TOKENS_A_ROW = 8


def token_row_loop(context, builder, sig, args, body, with_mins=False, ntok=TOKENS_A_ROW, block_bytes=0,
                   block_scales=False):
    """row_loop for one row against ntok tokens (args: w, r, xq, xd, xs with a row per
    token, t0): tokens t0..t0 + ntok - 1. Each (row, token) pair keeps its own
    accumulators and the body's operations, so each sum has the bits of row_loop on that
    token alone; the weight loads and unpacking, the same IR for every token, are emitted
    once (LLVM merges them), so a short batch decodes each block once, not per token.
    block_bytes > 0: software prefetch 4 KiB ahead in the row, as row_loop's."""
    w = context.make_array(sig.args[0])(context, builder, args[0])
    stride0 = cgutils.unpack_tuple(builder, w.strides)[0]
    wrow = builder.gep(builder.bitcast(w.data, I8.as_pointer()), [builder.mul(args[1], stride0)])
    arrs = [context.make_array(sig.args[k])(context, builder, args[k]) for k in (2, 3, 4)]
    rows = [row_pointer(builder, a) for a in arrs]   # each token's xq, xd, xs
    tokens = [builder.add(args[5], c64(j)) for j in range(ntok)]
    pairs = [(wrow, *(row(t) for row in rows)) for t in tokens]
    nb = cgutils.unpack_tuple(builder, arrs[1].shape)[1]
    h = IRHelpers(builder, target_features(context))
    return _dots_loop(builder, h, pairs, nb, body, with_mins, [wrow], block_bytes, block_scales)


def _store_token_dots(context, builder, sig, args, body, with_mins, block_bytes, block_scales, most):
    """out[t0 + j, r] = row r's dot with token t0 + j, j < m (2 <= m <= most):
    token_row_loop unrolled for each m, the one for this m run."""
    r, t0, m = args[1], args[5], args[6]
    out = context.make_array(sig.args[7])(context, builder, args[7])
    o_row, o_col = cgutils.unpack_tuple(builder, out.strides)
    base = builder.bitcast(out.data, I8.as_pointer())
    col = builder.mul(r, o_col)

    def run(ntok):
        for j, s in enumerate(token_row_loop(context, builder, sig, args, body, with_mins, ntok, block_bytes,
                                             block_scales)):
            at = builder.gep(base, [builder.add(builder.mul(builder.add(t0, c64(j)), o_row), col)])
            builder.store(s, builder.bitcast(at, F32T.as_pointer()))

    emit_for_count(builder, m, 2, most, run)


def emit_for_count(builder, m, lo, hi, emit):
    """Emit emit(n) for each n in lo..hi, run for the runtime count m (an i64; hi when m is
    none of lo..hi - 1): a loop unrolled for each count, one intrinsic for all of them."""
    if lo == hi:
        emit(hi)
        return
    with builder.if_else(builder.icmp_signed("==", m, c64(lo))) as (this, more):
        with this:
            emit(lo)
        with more:
            emit_for_count(builder, m, lo + 1, hi, emit)


def make_tokens_intrinsic(body, with_mins=False, block_bytes=0, block_scales=False, most=TOKENS_A_ROW):
    """row_tokens(w, r, xq, xd, xs, t0, m, out): out[t0 + j, r] = row r's dot with token
    t0 + j for j < m, 2 <= m <= most (token_row_loop; xq, xd, xs and out 2-D
    with a row per token). One intrinsic for every m: the type dispatch stays one chain."""
    @intrinsic
    def row_tokens(typingctx, w, r, xq, xd, xs, t0, m, out):
        sig = types.void(w, r, xq, xd, xs, t0, m, out)

        def codegen(context, builder, sig, args):
            _store_token_dots(context, builder, sig, args, body, with_mins, block_bytes, block_scales, most)
            return context.get_dummy_value()
        return sig, codegen
    return row_tokens

# ----------------------------------------------------------------------------- dequantization (prefill)

def deq_loop(context, builder, sig, args, block, body, x8=False):
    """Emit `for b in range(n_cols // block): body(b)` writing row i of y from row r of w
    (x8: w is Q4_K_X8)."""
    w = context.make_array(sig.args[0])(context, builder, args[0])
    y = context.make_array(sig.args[2])(context, builder, args[2])
    r, i = args[1], args[3]
    wbase, wstride = builder.bitcast(w.data, I8.as_pointer()), cgutils.unpack_tuple(builder, w.strides)[0]
    wrow = x8_row_ptr(builder, wbase, wstride, r) if x8 else builder.gep(wbase, [builder.mul(r, wstride)])
    yrow = builder.gep(builder.bitcast(y.data, I8.as_pointer()),
                       [builder.mul(i, cgutils.unpack_tuple(builder, y.strides)[0])])
    nb = builder.sdiv(cgutils.unpack_tuple(builder, y.shape)[1], ir.Constant(I64, block))
    h = IRHelpers(builder, target_features(context))
    with cgutils.for_range(builder, nb) as loop:
        body(h, wrow, yrow, loop.index)
    return context.get_dummy_value()


def store(h, yrow, off, v):
    p = h.b.bitcast(h.ptr(yrow, off), v.type.as_pointer())
    h.b.store(v, p, align=4)


def make_deq_intrinsic(block, body, x8=False):
    @intrinsic
    def deq_row(typingctx, w, r, y, i):
        sig = types.void(w, r, y, i)

        def codegen(context, builder, sig, args):
            return deq_loop(context, builder, sig, args, block, body, x8)
        return sig, codegen
    return deq_row
