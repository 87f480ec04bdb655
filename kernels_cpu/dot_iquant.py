"""Row dots and row dequantization for the i-quants: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS and IQ3_S (256-value blocks of lattice-grid indices; tables in iq_tables.py).

Per 32 values of a block: the grid entries are looked up (one 64-bit load per 8 values,
one 32-bit load per 4 for the IQ3 grids), the signs applied to the 8-bit activations, the
pair products summed (vpmaddubsw) and scaled by the odd multipliers of each 16 values
(vpmaddwd) into 8 i32 lanes; then one fma a block with d * dx, and the type's constant
after the horizontal sum: ggml's AVX2 ggml_vec_dot_iq*_q8_K, bit for bit (the integer
lanes are exact; only the per-lane fma and the final sum round). iquant_ref.py is the
numpy statement of the same order.

Pair sums never saturate: grid values are at most 43 (IQ2), 62 (IQ3) or 1 (IQ1), so a
pair is at most 2 * 62 * 127.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from . import iq_tables as tb
from .ir_helpers import (F32T, I8, I16, I32, I64, IRHelpers, array_ptrs, c64, const_vec, counted_loop,
                         make_deq_intrinsic, make_sums_intrinsic, mask, store, target_features, vec)
from .quant_kernels import IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS

BLOCK_BYTES = {IQ2_XXS: 66, IQ2_XS: 74, IQ2_S: 82, IQ3_XXS: 98, IQ3_S: 110, IQ1_S: 50, IQ1_M: 56}
# what ggml's vec_dot multiplies the lanes' sum by
FACTOR = {IQ2_XXS: 0.125, IQ2_XS: 0.125, IQ2_S: 0.125, IQ3_XXS: 0.25, IQ3_S: 1.0, IQ1_S: 1.0, IQ1_M: 1.0}
_DELTA = 0.125   # IQ1S_DELTA, IQ1M_DELTA


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _even_signs() -> list:
    """ksigns_iq2xs as 8 bytes of +1 / -1 each (bit j of entry i -> byte j): psignb operands."""
    out = []
    for s in tb.KSIGNS_IQ2XS.tolist():
        out.append(sum(((0xFF if s >> j & 1 else 0x01) << (8 * j)) for j in range(8)))
    return out


_TABLES = {   # name -> (element type, values)
    "iq2xxs": (I64, tb.IQ2XXS_GRID.tolist()), "iq2xs": (I64, tb.IQ2XS_GRID.tolist()),
    "iq2s": (I64, tb.IQ2S_GRID.tolist()), "iq1s": (I64, tb.IQ1S_GRID.tolist()),
    "iq3xxs": (I32, tb.IQ3XXS_GRID.tolist()), "iq3s": (I32, tb.IQ3S_GRID.tolist()),
    "signs": (I64, _even_signs()),
}


def _table(h, name):
    """The module's global constant copy of a table (made on first use in each module)."""
    mod = h.b.module
    gname = "edgeinfer_iq_" + name
    g = mod.globals.get(gname)
    if g is None:
        ty, values = _TABLES[name]
        vals = [_signed64(int(v)) if ty is I64 else (int(v) - (1 << 32) if v >= 1 << 31 else int(v)) for v in values]
        g = cgutils.global_constant(mod, gname, ir.Constant(ir.ArrayType(ty, len(vals)), vals))
    return g


def _look(h, name, idx):
    """table[idx] (idx: an integer of any width)."""
    b = h.b
    return b.load(b.gep(_table(h, name), [ir.Constant(I64, 0), b.zext(idx, I64) if idx.type.width < 64 else idx]))


def _gather(h, name, idxs):
    """Entries of a 64-bit (4 indices) or 32-bit (8 indices) table as <32 x i8>."""
    b = h.b
    vals = [_look(h, name, i) for i in idxs]
    v = ir.Constant(vec(vals[0].type, len(vals)), ir.Undefined)
    for k, x in enumerate(vals):
        v = b.insert_element(v, x, ir.Constant(I32, k))
    return b.bitcast(v, vec(I8, 32))


def _u(h, wrow, off, ty=I8):
    """An unsigned field at wrow + off, widened to i32."""
    return h.b.zext(h.load(wrow, off, ty), I32)


def _i(v):
    return ir.Constant(I32, v)


def _bytes(h, wrow, off, n):
    """n (4 or 8) consecutive index bytes as i32 values, from one load: IQ3_XXS's eight a
    32-value group taken out of one register rather than loaded one by one (its kernel
    is bound by the load ports: a load per grid entry already; 2.00 -> 1.75 ms a 2048 x 8192
    matrix on one Zen 3 core; IQ2_XXS and IQ3_S measured slower this way), each with one
    bextr (h.bits) where the CPU has BMI: 1.06-1.10x the kernel on Zen 3."""
    b = h.b
    v = h.load(wrow, off, I32 if n == 4 else I64)
    return [b.trunc(h.bits(v, 8 * k, 8), I32) for k in range(n)]


def _bits_to_signs(h, four):
    """An i32 of 4 sign bytes (bit j of byte k: value 8k + j negative) -> <32 x i8> of +1 / -1."""
    b = h.b
    v = b.bitcast(h.splat(four, 8), vec(I8, 32))
    sel = b.shuffle_vector(v, v, mask([k // 8 for k in range(32)]))
    bit = const_vec(I8, 32, [1 << (k % 8) if k % 8 < 7 else -128 for k in range(32)])
    neg = b.icmp_unsigned("==", b.and_(sel, bit), bit)
    return b.select(neg, const_vec(I8, 32, -1), const_vec(I8, 32, 1))


def _group_signs(h, negs):
    """4 i1 (one per 8 values) -> <32 x i8> of +1 / -1."""
    b = h.b
    v = ir.Constant(vec(ir.IntType(1), 4), ir.Undefined)
    for k, n in enumerate(negs):
        v = b.insert_element(v, n, _i(k))
    wide = b.shuffle_vector(v, v, mask([k // 8 for k in range(32)]))
    return b.select(wide, const_vec(I8, 32, -1), const_vec(I8, 32, 1))


# ----------------------------------------------------------------------------- one 32-value group
# _sub_<type>(h, wrow, wo, ib) -> (grid <32 x i8>, signs <32 x i8> of +-1 or None (IQ1: the
# grid is signed), scale of values 0-15, of values 16-31 (the raw field, as i32), IQ1 shift
# signs <32 x i8> or None)

def _sub_iq2_xxs(h, wrow, wo, ib):
    b = h.b
    base = b.add(wo, c64(2 + 8 * ib))
    grid = _gather(h, "iq2xxs", [h.load(wrow, b.add(base, c64(k)), I8) for k in range(4)])
    aux = h.load(wrow, b.add(base, c64(4)), I32)
    signs = _gather(h, "signs", [b.and_(b.lshr(aux, _i(7 * k)), _i(127)) for k in range(4)])
    ls = b.lshr(aux, _i(28))
    return grid, signs, ls, ls, None


def _sub_iq2_xs(h, wrow, wo, ib):
    b = h.b
    q = [_u(h, wrow, b.add(wo, c64(2 + 8 * ib + 2 * k)), I16) for k in range(4)]
    grid = _gather(h, "iq2xs", [b.and_(v, _i(511)) for v in q])
    signs = _gather(h, "signs", [b.lshr(v, _i(9)) for v in q])
    sc = _u(h, wrow, b.add(wo, c64(66 + ib)))
    return grid, signs, b.and_(sc, _i(15)), b.lshr(sc, _i(4)), None


def _sub_iq2_s(h, wrow, wo, ib):
    b = h.b
    qh = _u(h, wrow, b.add(wo, c64(66 + ib)))
    idx = [b.or_(_u(h, wrow, b.add(wo, c64(2 + 4 * ib + k))), b.and_(b.shl(qh, _i(8 - 2 * k)), _i(0x300)))
           for k in range(4)]
    grid = _gather(h, "iq2s", idx)
    signs = _bits_to_signs(h, h.load(wrow, b.add(wo, c64(34 + 4 * ib)), I32))
    sc = _u(h, wrow, b.add(wo, c64(74 + ib)))
    return grid, signs, b.and_(sc, _i(15)), b.lshr(sc, _i(4)), None


def _sub_iq3_xxs(h, wrow, wo, ib):
    b = h.b
    grid = _gather(h, "iq3xxs", _bytes(h, wrow, b.add(wo, c64(2 + 8 * ib)), 8))
    aux = h.load(wrow, b.add(wo, c64(66 + 4 * ib)), I32)
    signs = _gather(h, "signs", [b.and_(b.lshr(aux, _i(7 * k)), _i(127)) for k in range(4)])
    ls = b.lshr(aux, _i(28))
    return grid, signs, ls, ls, None


def _sub_iq3_s(h, wrow, wo, ib):
    b = h.b
    qh = _u(h, wrow, b.add(wo, c64(66 + ib)))
    idx = []
    for k in range(8):   # value group k: its high index bit is bit k of qh
        sh = 8 - k
        hi = b.and_(b.shl(qh, _i(sh)) if sh >= 0 else b.lshr(qh, _i(-sh)), _i(256))
        idx.append(b.or_(_u(h, wrow, b.add(wo, c64(2 + 8 * ib + k))), hi))
    grid = _gather(h, "iq3s", idx)
    signs = _bits_to_signs(h, h.load(wrow, b.add(wo, c64(74 + 4 * ib)), I32))
    ls = b.and_(b.lshr(_u(h, wrow, b.add(wo, c64(106 + ib // 2))), _i(4 * (ib % 2))), _i(15))
    return grid, signs, ls, ls, None


def _sub_iq1_s(h, wrow, wo, ib):
    b = h.b
    qh = _u(h, wrow, b.add(wo, c64(34 + 2 * ib)), I16)
    idx = [b.or_(_u(h, wrow, b.add(wo, c64(2 + 4 * ib + k))), b.shl(b.and_(b.lshr(qh, _i(3 * k)), _i(7)), _i(8)))
           for k in range(4)]
    grid = _gather(h, "iq1s", idx)
    ls = b.and_(b.lshr(qh, _i(12)), _i(7))
    neg = b.icmp_unsigned("!=", b.and_(qh, _i(0x8000)), _i(0))
    return grid, None, ls, ls, _group_signs(h, [neg] * 4)


def _sub_iq1_m(h, wrow, wo, ib):
    b = h.b
    qh0 = _u(h, wrow, b.add(wo, c64(32 + 2 * ib)))
    qh1 = _u(h, wrow, b.add(wo, c64(33 + 2 * ib)))
    his = [b.shl(qh0, _i(8)), b.shl(qh0, _i(4)), b.shl(qh1, _i(8)), b.shl(qh1, _i(4))]
    idx = [b.or_(_u(h, wrow, b.add(wo, c64(4 * ib + k))), b.and_(his[k], _i(0x700))) for k in range(4)]
    grid = _gather(h, "iq1s", idx)
    sc = _u(h, wrow, b.add(wo, c64(48 + 2 * (ib // 2))), I16)
    s0 = 6 * (ib % 2)
    lo = b.and_(b.lshr(sc, _i(s0)), _i(7))
    hi = b.and_(b.lshr(sc, _i(s0 + 3)), _i(7))
    negs = [b.icmp_unsigned("!=", b.and_(q, _i(m)), _i(0)) for q, m in ((qh0, 8), (qh0, 0x80), (qh1, 8), (qh1, 0x80))]
    return grid, None, lo, hi, _group_signs(h, negs)


SUB = {IQ2_XXS: _sub_iq2_xxs, IQ2_XS: _sub_iq2_xs, IQ2_S: _sub_iq2_s, IQ3_XXS: _sub_iq3_xxs, IQ3_S: _sub_iq3_s,
        IQ1_S: _sub_iq1_s, IQ1_M: _sub_iq1_m}


def _block_d(h, wrow, wo, qt):
    """The block's scale as float: its fp16 field, IQ1_M's assembled from the scales' top nibbles."""
    if qt != IQ1_M:
        return h.load_f16(wrow, wo)
    b = h.b
    sc = [_u(h, wrow, b.add(wo, c64(48 + 2 * k)), I16) for k in range(4)]
    bits = b.or_(b.or_(b.lshr(sc[0], _i(12)), b.and_(b.lshr(sc[1], _i(8)), _i(0xF0))),
                 b.or_(b.and_(b.lshr(sc[2], _i(4)), _i(0xF00)), b.and_(sc[3], _i(0xF000))))
    return h.f16_value(b.trunc(bits, I16))


def odd(h, ls):
    """2 * ls + 1 as i16."""
    b = h.b
    return b.trunc(b.add(b.shl(ls, _i(1)), _i(1)), I16)


def _mult16(h, lo, hi):
    """<16 x i16>: lo for the pair sums of values 0-15, hi for 16-31."""
    b = h.b
    v = ir.Constant(vec(I16, 2), ir.Undefined)
    v = b.insert_element(b.insert_element(v, lo, _i(0)), hi, _i(1))
    return b.shuffle_vector(v, v, mask([0] * 8 + [1] * 8))


# ----------------------------------------------------------------------------- row dots

def _block_dot(h, qt, wrow, wo, xq, xs, bi, accs):
    """One block of one row: accs (acc <8 x f32>, [IQ1_M: acc2 <8 x f32> | IQ1_S: acc1 f32]) updated."""
    b = h.b
    dx = h.load(xs[0], b.mul(bi, c64(4)), F32T)
    d = b.fmul(_block_d(h, wrow, wo, qt), dx)
    xo = b.mul(bi, c64(256))
    zero = ir.Constant(vec(I32, 8), [0] * 8)
    isum, isum2, s1 = zero, zero, _i(0)
    for ib in range(8):
        grid, signs, lo, hi, shift = SUB[qt](h, wrow, wo, ib)
        x8 = h.load(xq, b.add(xo, c64(32 * ib)), vec(I8, 32))
        m16 = _mult16(h, odd(h, lo), odd(h, hi))
        if signs is not None:
            p16 = h.maddubs(grid, h.sign_i8(x8, signs))
        else:
            p16 = h.maddubs(h.abs_i8(grid), h.sign_i8(x8, grid))
        isum = b.add(isum, h.madd_i16(p16, m16))
        if qt == IQ1_M:
            p2 = h.maddubs(const_vec(I8, 32, 1), h.sign_i8(x8, shift))
            isum2 = b.add(isum2, h.madd_i16(p2, m16))
        elif qt == IQ1_S:   # the shift term from the activations' per-16 sums, as ggml
            bs = b.add(h.load(xs[1], b.add(b.mul(bi, c64(64)), c64(8 * ib)), I32),
                       h.load(xs[1], b.add(b.mul(bi, c64(64)), c64(8 * ib + 4)), I32))
            t = b.mul(bs, b.zext(odd(h, lo), I32))
            neg = b.icmp_signed("<", b.extract_element(shift, _i(0)), ir.Constant(I8, 0))
            s1 = b.add(s1, b.select(neg, b.sub(_i(0), t), t))
    out = [h.fma(h.splat(d, 8), b.sitofp(isum, vec(F32T, 8)), accs[0])]
    if qt == IQ1_M:
        out.append(h.fma(h.splat(d, 8), b.sitofp(isum2, vec(F32T, 8)), accs[1]))
    elif qt == IQ1_S:
        out.append(_fma1(h, d, b.sitofp(s1, F32T), accs[1]))
    return out


def _fma1(h, a, x, acc):
    mod = h.b.module
    fn = mod.globals.get("llvm.fma.f32") or ir.Function(mod, ir.FunctionType(F32T, [F32T] * 3), "llvm.fma.f32")
    return h.b.call(fn, [a, x, acc])


def _finish(h, qt, accs):
    b = h.b
    s = h.hsum_f32(accs[0])
    if qt == IQ1_M:
        return b.fadd(s, b.fmul(ir.Constant(F32T, _DELTA), h.hsum_f32(accs[1])))
    if qt == IQ1_S:
        return b.fadd(s, b.fmul(ir.Constant(F32T, _DELTA), accs[1]))
    return s if FACTOR[qt] == 1.0 else b.fmul(ir.Constant(F32T, FACTOR[qt]), s)


def _inits(qt):
    z8 = ir.Constant(vec(F32T, 8), [0.0] * 8)
    if qt == IQ1_M:
        return [z8, z8]
    if qt == IQ1_S:
        return [z8, ir.Constant(F32T, 0.0)]
    return [z8]


def _row_sums(context, builder, sig, args, qt, nrows):
    (wrows, xq, xd, xs), nb = array_ptrs(context, builder, sig, args, nrows)
    h = IRHelpers(builder, target_features(context))
    width = len(_inits(qt))
    bb = BLOCK_BYTES[qt]

    def blocks(i, accs):
        wo = builder.mul(i, c64(bb))
        out = []
        for k, wrow in enumerate(wrows):
            out += _block_dot(h, qt, wrow, wo, xq, (xd, xs), i, accs[width * k:width * k + width])
        return out
    fin = counted_loop(builder, nb, 1, _inits(qt) * nrows, blocks, "iqdot")
    return [_finish(h, qt, fin[width * k:width * k + width]) for k in range(nrows)]


def make_row(qt):
    """row_dot(w, r, xq, xd, xs) -> float32 for this type."""
    def sums(context, builder, sig, args, nrows):
        return _row_sums(context, builder, sig, args, qt, nrows)
    return make_sums_intrinsic(sums)


# ----------------------------------------------------------------------------- dequantization

def _make_deq(qt):
    bb = BLOCK_BYTES[qt]

    def body(h, wrow, yrow, bi):
        b = h.b
        wo = b.mul(bi, c64(bb))
        d = _block_d(h, wrow, wo, qt)
        yo = b.mul(bi, c64(1024))
        for ib in range(8):
            grid, signs, lo, hi, shift = SUB[qt](h, wrow, wo, ib)
            dbs = []
            for ls in (lo, hi):
                if qt in (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS):   # d * (0.5 + ls) * (1/4 | 1/2), as ggml
                    db = b.fmul(d, b.fadd(ir.Constant(F32T, 0.5), b.uitofp(ls, F32T)))
                    dbs.append(b.fmul(db, ir.Constant(F32T, 0.5 if qt == IQ3_XXS else 0.25)))
                else:                                         # d * (2 ls + 1)
                    dbs.append(b.fmul(d, b.sitofp(odd(h, ls), F32T)))
            dv = ir.Constant(vec(F32T, 2), ir.Undefined)
            dv = b.insert_element(b.insert_element(dv, dbs[0], _i(0)), dbs[1], _i(1))
            db32 = b.shuffle_vector(dv, dv, mask([0] * 16 + [1] * 16))
            if signs is not None:
                v = b.sitofp(h.sign_i8(grid, signs), vec(F32T, 32))
            else:   # IQ1: value + shift, the shift +-1/8 per 8 values
                sh = b.fmul(b.sitofp(shift, vec(F32T, 32)), const_vec(F32T, 32, _DELTA))
                v = b.fadd(b.sitofp(grid, vec(F32T, 32)), sh)
            store(h, yrow, b.add(yo, c64(128 * ib)), b.fmul(db32, v))
    return body


row_iq2_xxs, row_iq2_xs, row_iq2_s = make_row(IQ2_XXS), make_row(IQ2_XS), make_row(IQ2_S)
row_iq3_xxs, row_iq3_s = make_row(IQ3_XXS), make_row(IQ3_S)
row_iq1_s, row_iq1_m = make_row(IQ1_S), make_row(IQ1_M)
deq_row_iq2_xxs, deq_row_iq2_xs = make_deq_intrinsic(256, _make_deq(IQ2_XXS)), make_deq_intrinsic(256, _make_deq(IQ2_XS))
deq_row_iq2_s = make_deq_intrinsic(256, _make_deq(IQ2_S))
deq_row_iq3_xxs, deq_row_iq3_s = make_deq_intrinsic(256, _make_deq(IQ3_XXS)), make_deq_intrinsic(256, _make_deq(IQ3_S))
deq_row_iq1_s, deq_row_iq1_m = make_deq_intrinsic(256, _make_deq(IQ1_S)), make_deq_intrinsic(256, _make_deq(IQ1_M))
