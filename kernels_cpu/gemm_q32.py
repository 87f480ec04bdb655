"""Short and long prompts on the 32-element block types without VNNI: 8 rows in lanes, tokens broadcast.

gemm_kquant's design for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and MXFP4. The row kernels these
types had for a
prompt ran decode's dot once per (row, token): every token unpacked every weight block
again and paid an abs, a sign, a vpmaddubsw and a vpmaddwd per 32 products, ~12-20 GMAC/s
on 2 Zen 3 cores. Here:
- For each group of 8 rows and run of NBLK blocks, the rows are staged once into a small
  scratch (`_stage`): a block's values as bytes laid out [step k][row r][4 bytes], so
  one 32-byte load holds elements 4k..4k+3 of the block for all 8 rows, one row a 32-bit
  lane; the rows' scales as 8 floats a block. Staging is paid once per block for every
  token of the tile.
- Per token (4 at a time), bytes 4k..4k+3 of its block are broadcast to all lanes from
  memory (a load, no shuffle) against the staged bytes: lane r sums row r's products.
  Unsigned codes (Q4_0: 0..15, Q5_0: 0..31) add their vpmaddubsw results in i16 while they
  fit (8 and 4 of them: <= 8 * 2 * 15 * 127, 4 * 2 * 31 * 127), then one vpmaddwd against
  ones; the offset (value = code - 8 or - 16) comes off as offset * the token's block sum.
  Q4_1 and Q5_1 add m * dx * (the token's block sum). Signed values (Q8_0, the table
  values of IQ4_NL and MXFP4) go in as |w| . sign(x, w): MXFP4's |w| <= 12 adds 8 in i16,
  the others one.
- Per block and token one float fma: acc += (d_row d_x) * I, blocks in order, so the
  result does not depend on how the tokens or rows were split. That is not decode's
  order (8 float lanes per row, summed at the end): a prompt's products differ from a
  decoded token's in the last bits, as the BLAS path they replace did.
The activations are the Q8_0 rows the decode path quantizes, stored block-major.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from . import gemm_parallel, gemm_kquant_wide, gemm_q32_wide as wide
from .dot_mxfp4 import e8m0_half, mxfp4_values
from .dot_q32 import q32_values
from .gemm_kquant import GROUP_ROWS, TOKENS, _bcast, _store, _store_d, _transpose8
from .ir_helpers import (F32T, I8, I16, I32, IRHelpers, c64, const_vec, counted_loop, row_pointer, row_ptrs,
                         target_features, vec)
from .quant_kernels import IQ4_NL, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0

GEMM_TYPES = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4)
NBLK = 8                 # blocks staged at once (a row's tail runs one block at a time)
_BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, IQ4_NL: 18, MXFP4: 17}
_OFFSET = {Q4_0: 8, Q5_0: 16}          # unsigned codes: value = code - offset
_MIN = (Q4_1, Q5_1)                    # unsigned codes: value = d * code + m
# vpmaddubsw results an i16 sum takes: codes <= 15 (8 * 2 * 15 * 127 < 2^15), <= 31 (4),
# MXFP4's |w| <= 12 (8), Q8_0's and IQ4_NL's |w| <= 127 (1)
_I16_STEPS = {Q4_0: 8, Q4_1: 8, Q5_0: 4, Q5_1: 4, MXFP4: 8, Q8_0: 1, IQ4_NL: 1}
# scratch per staged block: the bytes (signed types: |w| then w), then 8 row scales (and
# for Q4_1/Q5_1 8 row mins)
_CODE_BYTES = 256
_SIGNED = (Q8_0, MXFP4, IQ4_NL)
_PER_BLOCK = {qt: (2 if qt in _SIGNED else 1) * _CODE_BYTES + (64 if qt in _MIN else 32) for qt in GEMM_TYPES}
SCRATCH_BYTES = NBLK * max(_PER_BLOCK.values())
_TYPE_NAMES = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", IQ4_NL: "IQ4_NL", MXFP4: "MXFP4"}
# _run's branches: every type in this module's own functions (matmul_rows); the drivers'
# copies keep only theirs (gemm_parallel.Drivers)
_HAS_Q8_0 = _HAS_Q4_0 = _HAS_Q4_1 = _HAS_Q5_0 = _HAS_Q5_1 = _HAS_IQ4_NL = _HAS_MXFP4 = True
TILE_TOKENS = 256        # tokens a staged run serves (a multiple of TOKENS)
_JIT = dict(cache=True, nogil=True)
# 512-bit VNNI hosts: four row groups at a time take gemm_q32_wide's 32-row products (the
# same bits; gemm_kquant_wide.enabled)
_WIDE = gemm_kquant_wide.enabled()
WIDE_TILE_TOKENS = 128   # tokens a wide staged run serves (acc: 128 bytes a token)
_WIDE_GROUPS, _WIDE_ROWS = gemm_kquant_wide.GROUPS, gemm_kquant_wide.ROWS
_WIDE_SCRATCH = wide.scratch_bytes(NBLK)


def _values(h, row, wo, qt):
    """A block's 32 bytes as the kernel multiplies them: unsigned codes, or signed values."""
    if qt == Q8_0:
        return h.load(row, h.b.add(wo, c64(2)), vec(I8, 32))
    if qt == MXFP4:
        return mxfp4_values(h, row, wo)
    return q32_values(h, row, wo, qt)   # IQ4_NL: its signed table values


def _stage(h, qt, rows, bi, j, sbase):
    """Block bi + j of the 8 rows into staged block j (see the module doc)."""
    b = h.b
    blk = b.add(bi, c64(j))
    wo = b.mul(blk, c64(_BLOCK_BYTES[qt]))
    base = _PER_BLOCK[qt] * j
    vals = [_values(h, row, wo, qt) for row in rows]
    planes = [[h.abs_i8(v) for v in vals], vals] if qt in _SIGNED else [vals]
    for p, per_row in enumerate(planes):
        t = _transpose8(b, [b.bitcast(v, vec(I32, 8)) for v in per_row])
        for k in range(8):
            _store(h, sbase, base + _CODE_BYTES * p + 32 * k, t[k])
    at = base + _CODE_BYTES * len(planes)
    if qt == MXFP4:
        d = ir.Constant(vec(F32T, 8), ir.Undefined)
        for k, row in enumerate(rows):
            d = b.insert_element(d, e8m0_half(h, row, wo), ir.Constant(I32, k))
        _store(h, sbase, at, d)
    else:
        _store_d(h, sbase, rows, wo, at)
    if qt in _MIN:
        _store_d(h, sbase, rows, b.add(wo, c64(2)), at + 32)


def _block_isums(h, qt, sbase, j, xs, bs, blk):
    """Staged block j against 4 tokens' block `blk` (xs/bs: their activation and sum
    pointers for block 0 of the run): the exact integer dots, <8 x i32> a token."""
    b = h.b
    base = _PER_BLOCK[qt] * j
    ones = const_vec(I16, 16, 1)
    n16 = _I16_STEPS[qt]
    isum = [ir.Constant(vec(I32, 8), [0] * 8)] * TOKENS
    for k0 in range(0, 8, n16):
        s16 = [None] * TOKENS
        for k in range(k0, k0 + n16):
            wv = h.load(sbase, c64(base + 32 * k), vec(I8, 32))
            sw = h.load(sbase, c64(base + _CODE_BYTES + 32 * k), vec(I8, 32)) if qt in _SIGNED else None
            for ti in range(TOKENS):
                x = _bcast(h, xs[ti], 32 * blk + 4 * k, I8)
                p = h.maddubs(wv, h.sign_i8(x, sw) if sw is not None else x)
                s16[ti] = p if s16[ti] is None else b.add(s16[ti], p)
        isum = [b.add(isum[ti], h.madd_i16(s16[ti], ones)) for ti in range(TOKENS)]
    if qt in _OFFSET:   # minus offset * the token's block sum
        shift = const_vec(I32, 8, _OFFSET[qt].bit_length() - 1)
        isum = [b.sub(isum[ti], b.shl(h.splat(h.load(bs[ti], c64(4 * blk), I32), 8), shift))
                for ti in range(TOKENS)]
    return isum


def _make_tokens(qt, nblk):
    def codegen(context, builder, sig, args):
        s, xq, xd, xs, acc = (context.make_array(ty)(context, builder, a)
                              for ty, a in zip((sig.args[0], sig.args[1], sig.args[2], sig.args[3], sig.args[5]),
                                               (args[0], args[1], args[2], args[3], args[5])))
        t_lo, t_hi = args[4], args[6]
        b = builder
        h = IRHelpers(b, target_features(context))
        i8p = I8.as_pointer()
        sbase = b.bitcast(s.data, i8p)

        # token-major activations: token t's row at t * stride0, its blocks in order
        xrow, drow, srow, arow = (row_pointer(b, a) for a in (xq, xd, xs, acc))
        scale_at = [_PER_BLOCK[qt] * j + _CODE_BYTES * (2 if qt in _SIGNED else 1) for j in range(nblk)]
        d_rows = [h.load(sbase, c64(at), vec(F32T, 8)) for at in scale_at]
        m_rows = [h.load(sbase, c64(at + 32), vec(F32T, 8)) for at in scale_at] if qt in _MIN else None

        def quad(i, _):
            ts = [b.add(b.add(t_lo, i), c64(ti)) for ti in range(TOKENS)]
            xs_, ds_, bs_ = [xrow(t) for t in ts], [drow(t) for t in ts], [srow(t) for t in ts]
            accs = [h.load(arow(t), c64(0), vec(F32T, 8)) for t in ts]
            for j in range(nblk):
                isum = _block_isums(h, qt, sbase, j, xs_, bs_, j)
                for ti in range(TOKENS):
                    dx = h.load(ds_[ti], c64(4 * j), F32T)
                    dxv = h.splat(dx, 8)
                    accs[ti] = h.fma(b.fmul(d_rows[j], dxv), b.sitofp(isum[ti], vec(F32T, 8)), accs[ti])
                    if m_rows is not None:   # + m dx sum(x)
                        xsum = h.splat(b.sitofp(h.load(bs_[ti], c64(4 * j), I32), F32T), 8)
                        accs[ti] = h.fma(b.fmul(m_rows[j], dxv), xsum, accs[ti])
            for t, a in zip(ts, accs):
                _store(h, arow(t), 0, a)
            return []
        counted_loop(b, b.sub(t_hi, t_lo), TOKENS, [], quad, "q32_tok")
        return context.get_dummy_value()

    @intrinsic
    def tokens(typingctx, s, xq, xd, xs, t_lo, acc, t_hi):
        """For tokens t_lo..t_hi (a multiple of TOKENS apart): acc[t] += the nblk staged
        blocks . token t's blocks (xq/xd/xs: views starting at the run's first block)."""
        return types.void(s, xq, xd, xs, t_lo, acc, t_hi), codegen
    return tokens


def _make_stage(qt, nblk):
    def codegen(context, builder, sig, args):
        w = context.make_array(sig.args[0])(context, builder, args[0])
        rows = row_ptrs(builder, w, builder.mul(args[1], c64(GROUP_ROWS)), GROUP_ROWS)
        s = context.make_array(sig.args[3])(context, builder, args[3])
        h, sbase = IRHelpers(builder, target_features(context)), builder.bitcast(s.data, I8.as_pointer())
        for j in range(nblk):
            _stage(h, qt, rows, args[2], j, sbase)
        return context.get_dummy_value()

    @intrinsic
    def stage(typingctx, w, g, bi, s):
        """Stage blocks bi..bi+nblk-1 of rows 8g..8g+7 into the scratch s."""
        return types.void(w, g, bi, s), codegen
    return stage


_KERNELS = {qt: (_make_stage(qt, NBLK), _make_tokens(qt, NBLK), _make_stage(qt, 1), _make_tokens(qt, 1))
            for qt in GEMM_TYPES}
_st8_q8_0, _tk8_q8_0, _st1_q8_0, _tk1_q8_0 = _KERNELS[Q8_0]
_st8_q4_0, _tk8_q4_0, _st1_q4_0, _tk1_q4_0 = _KERNELS[Q4_0]
_st8_q4_1, _tk8_q4_1, _st1_q4_1, _tk1_q4_1 = _KERNELS[Q4_1]
_st8_q5_0, _tk8_q5_0, _st1_q5_0, _tk1_q5_0 = _KERNELS[Q5_0]
_st8_q5_1, _tk8_q5_1, _st1_q5_1, _tk1_q5_1 = _KERNELS[Q5_1]
_st8_iq4_nl, _tk8_iq4_nl, _st1_iq4_nl, _tk1_iq4_nl = _KERNELS[IQ4_NL]
_st8_mxfp4, _tk8_mxfp4, _st1_mxfp4, _tk1_mxfp4 = _KERNELS[MXFP4]


def _wide_kernels(qt):
    """(merge, tokens) for a full run of NBLK blocks, then for one block (a row's tail)."""
    args = (_PER_BLOCK[qt], _CODE_BYTES, qt in _SIGNED, SCRATCH_BYTES)
    return (wide.make_merge(qt, NBLK, *args), wide.make_tokens(qt, NBLK),
            wide.make_merge(qt, 1, *args), wide.make_tokens(qt, 1))


_wm8_q8_0, _wt8_q8_0, _wm1_q8_0, _wt1_q8_0 = _wide_kernels(Q8_0)
_wm8_q4_0, _wt8_q4_0, _wm1_q4_0, _wt1_q4_0 = _wide_kernels(Q4_0)
_wm8_q4_1, _wt8_q4_1, _wm1_q4_1, _wt1_q4_1 = _wide_kernels(Q4_1)
_wm8_q5_0, _wt8_q5_0, _wm1_q5_0, _wt1_q5_0 = _wide_kernels(Q5_0)
_wm8_q5_1, _wt8_q5_1, _wm1_q5_1, _wt1_q5_1 = _wide_kernels(Q5_1)
_wm8_iq4_nl, _wt8_iq4_nl, _wm1_iq4_nl, _wt1_iq4_nl = _wide_kernels(IQ4_NL)
_wm8_mxfp4, _wt8_mxfp4, _wm1_mxfp4, _wt1_mxfp4 = _wide_kernels(MXFP4)


@njit(**_JIT)
def _run_wide(w, qt, g, bi, n, s4, sw, xq, xd, xs, t0, acc, t1):
    """_run for row groups g..g + 3 (gemm_q32_wide): stage each, merge, multiply."""
    x, d, m = xq[:, 32 * bi:], xd[:, bi:], xs[:, bi:]
    full = n == NBLK
    if _WIDE and _HAS_Q8_0 and qt == Q8_0:
        if full:
            for q in range(_WIDE_GROUPS):
                _st8_q8_0(w, g + q, bi, s4[q])
            _wm8_q8_0(s4, sw)
            _wt8_q8_0(sw, x, d, m, t0, acc, t1)
        else:
            for q in range(_WIDE_GROUPS):
                _st1_q8_0(w, g + q, bi, s4[q])
            _wm1_q8_0(s4, sw)
            _wt1_q8_0(sw, x, d, m, t0, acc, t1)
    elif _WIDE and _HAS_Q4_0 and qt == Q4_0:
        if full:
            for q in range(_WIDE_GROUPS):
                _st8_q4_0(w, g + q, bi, s4[q])
            _wm8_q4_0(s4, sw)
            _wt8_q4_0(sw, x, d, m, t0, acc, t1)
        else:
            for q in range(_WIDE_GROUPS):
                _st1_q4_0(w, g + q, bi, s4[q])
            _wm1_q4_0(s4, sw)
            _wt1_q4_0(sw, x, d, m, t0, acc, t1)
    elif _WIDE and _HAS_Q4_1 and qt == Q4_1:
        if full:
            for q in range(_WIDE_GROUPS):
                _st8_q4_1(w, g + q, bi, s4[q])
            _wm8_q4_1(s4, sw)
            _wt8_q4_1(sw, x, d, m, t0, acc, t1)
        else:
            for q in range(_WIDE_GROUPS):
                _st1_q4_1(w, g + q, bi, s4[q])
            _wm1_q4_1(s4, sw)
            _wt1_q4_1(sw, x, d, m, t0, acc, t1)
    elif _WIDE and _HAS_Q5_0 and qt == Q5_0:
        if full:
            for q in range(_WIDE_GROUPS):
                _st8_q5_0(w, g + q, bi, s4[q])
            _wm8_q5_0(s4, sw)
            _wt8_q5_0(sw, x, d, m, t0, acc, t1)
        else:
            for q in range(_WIDE_GROUPS):
                _st1_q5_0(w, g + q, bi, s4[q])
            _wm1_q5_0(s4, sw)
            _wt1_q5_0(sw, x, d, m, t0, acc, t1)
    elif _WIDE and _HAS_Q5_1 and qt == Q5_1:
        if full:
            for q in range(_WIDE_GROUPS):
                _st8_q5_1(w, g + q, bi, s4[q])
            _wm8_q5_1(s4, sw)
            _wt8_q5_1(sw, x, d, m, t0, acc, t1)
        else:
            for q in range(_WIDE_GROUPS):
                _st1_q5_1(w, g + q, bi, s4[q])
            _wm1_q5_1(s4, sw)
            _wt1_q5_1(sw, x, d, m, t0, acc, t1)
    elif _WIDE and _HAS_IQ4_NL and qt == IQ4_NL:
        if full:
            for q in range(_WIDE_GROUPS):
                _st8_iq4_nl(w, g + q, bi, s4[q])
            _wm8_iq4_nl(s4, sw)
            _wt8_iq4_nl(sw, x, d, m, t0, acc, t1)
        else:
            for q in range(_WIDE_GROUPS):
                _st1_iq4_nl(w, g + q, bi, s4[q])
            _wm1_iq4_nl(s4, sw)
            _wt1_iq4_nl(sw, x, d, m, t0, acc, t1)
    elif _WIDE and _HAS_MXFP4 and qt == MXFP4:
        if full:
            for q in range(_WIDE_GROUPS):
                _st8_mxfp4(w, g + q, bi, s4[q])
            _wm8_mxfp4(s4, sw)
            _wt8_mxfp4(sw, x, d, m, t0, acc, t1)
        else:
            for q in range(_WIDE_GROUPS):
                _st1_mxfp4(w, g + q, bi, s4[q])
            _wm1_mxfp4(s4, sw)
            _wt1_mxfp4(sw, x, d, m, t0, acc, t1)


@njit(**_JIT)
def _gemm_wide(w, qt, g0, g1, xq, xd, xs, out):
    """_gemm_rows' groups g0..g1 in fours with the 32-row kernels where this CPU has them;
    returns the first group left for the 8-row kernel."""
    if not _WIDE:
        return g0
    n_tok = out.shape[0]
    n_pad, nb = xd.shape
    s4 = np.empty((_WIDE_GROUPS, SCRATCH_BYTES), np.uint8)
    sw = np.empty(_WIDE_SCRATCH, np.uint8)
    acc = np.empty((n_pad, _WIDE_ROWS), np.float32)
    n_full = nb - nb % NBLK
    g = g0
    while g + _WIDE_GROUPS <= g1:
        for t0 in range(0, n_pad, WIDE_TILE_TOKENS):
            t1 = min(t0 + WIDE_TILE_TOKENS, n_pad)
            acc[t0:t1] = 0.0
            for bi in range(0, n_full, NBLK):
                _run_wide(w, qt, g, bi, NBLK, s4, sw, xq, xd, xs, t0, acc, t1)
            for bi in range(n_full, nb):
                _run_wide(w, qt, g, bi, 1, s4, sw, xq, xd, xs, t0, acc, t1)
            for t in range(t0, min(t1, n_tok)):
                for k in range(_WIDE_ROWS):
                    out[t, GROUP_ROWS * g + k] = acc[t, k]
        g += _WIDE_GROUPS
    return g


@njit(**_JIT)
def _run(w, qt, g, bi, n, s, xq, xd, xs, t0, acc, t1):
    """Blocks bi..bi+n (n: NBLK or 1) of row group g against tokens t0..t1."""
    x, d, m = xq[:, 32 * bi:], xd[:, bi:], xs[:, bi:]
    full = n == NBLK
    if _HAS_Q8_0 and qt == Q8_0:
        if full:
            _st8_q8_0(w, g, bi, s)
            _tk8_q8_0(s, x, d, m, t0, acc, t1)
        else:
            _st1_q8_0(w, g, bi, s)
            _tk1_q8_0(s, x, d, m, t0, acc, t1)
    elif _HAS_Q4_0 and qt == Q4_0:
        if full:
            _st8_q4_0(w, g, bi, s)
            _tk8_q4_0(s, x, d, m, t0, acc, t1)
        else:
            _st1_q4_0(w, g, bi, s)
            _tk1_q4_0(s, x, d, m, t0, acc, t1)
    elif _HAS_Q4_1 and qt == Q4_1:
        if full:
            _st8_q4_1(w, g, bi, s)
            _tk8_q4_1(s, x, d, m, t0, acc, t1)
        else:
            _st1_q4_1(w, g, bi, s)
            _tk1_q4_1(s, x, d, m, t0, acc, t1)
    elif _HAS_Q5_0 and qt == Q5_0:
        if full:
            _st8_q5_0(w, g, bi, s)
            _tk8_q5_0(s, x, d, m, t0, acc, t1)
        else:
            _st1_q5_0(w, g, bi, s)
            _tk1_q5_0(s, x, d, m, t0, acc, t1)
    elif _HAS_Q5_1 and qt == Q5_1:
        if full:
            _st8_q5_1(w, g, bi, s)
            _tk8_q5_1(s, x, d, m, t0, acc, t1)
        else:
            _st1_q5_1(w, g, bi, s)
            _tk1_q5_1(s, x, d, m, t0, acc, t1)
    elif _HAS_IQ4_NL and qt == IQ4_NL:
        if full:
            _st8_iq4_nl(w, g, bi, s)
            _tk8_iq4_nl(s, x, d, m, t0, acc, t1)
        else:
            _st1_iq4_nl(w, g, bi, s)
            _tk1_iq4_nl(s, x, d, m, t0, acc, t1)
    elif _HAS_MXFP4:
        if full:
            _st8_mxfp4(w, g, bi, s)
            _tk8_mxfp4(s, x, d, m, t0, acc, t1)
        else:
            _st1_mxfp4(w, g, bi, s)
            _tk1_mxfp4(s, x, d, m, t0, acc, t1)


@njit(**_JIT)
def _gemm_rows(w, qt, g0, g1, xq, xd, xs, tile, out):
    """out[t, 8g + k] for row groups g0 <= g < g1 and every token of out, `tile` tokens at
    a time (each staged run serves that many; their accumulators stay in L1)."""
    g0 = _gemm_wide(w, qt, g0, g1, xq, xd, xs, out)
    n_tok = out.shape[0]
    n_pad, nb = xd.shape
    s = np.empty(SCRATCH_BYTES, np.uint8)
    acc = np.empty((n_pad, GROUP_ROWS), np.float32)
    n_full = nb - nb % NBLK
    for t0 in range(0, n_pad, tile):
        t1 = min(t0 + tile, n_pad)
        for g in range(g0, g1):
            acc[t0:t1] = 0.0
            for bi in range(0, n_full, NBLK):
                _run(w, qt, g, bi, NBLK, s, xq, xd, xs, t0, acc, t1)
            for bi in range(n_full, nb):
                _run(w, qt, g, bi, 1, s, xq, xd, xs, t0, acc, t1)
            for t in range(t0, min(t1, n_tok)):
                for k in range(GROUP_ROWS):
                    out[t, GROUP_ROWS * g + k] = acc[t, k]


def pack_activations(xq: np.ndarray, xd: np.ndarray, xs: np.ndarray):
    """Q8_0 rows (quantize_activation_rows for a 32-block type: xq (n, K) int8, xd (n, K/32)
    scales, xs (n, K/32) block sums) padded with zero tokens to a multiple of TOKENS."""
    n = xq.shape[0]
    if n % TOKENS == 0:
        return (np.ascontiguousarray(xq), np.ascontiguousarray(xd, np.float32),
                np.ascontiguousarray(xs, np.int32))
    return pack_segments(xq, xd, xs, [n])[0]


def pack_segments(xq: np.ndarray, xd: np.ndarray, xs: np.ndarray, counts):
    """Q8_0 rows in consecutive segments (counts[j] rows each: an expert's tokens), each
    segment padded with zero tokens to a multiple of TOKENS: returns ((xq, xd, xs), seg)
    with segment j in packed rows seg[j]..seg[j + 1]."""
    seg, which, pos = gemm_parallel.segment_layout(counts)
    dest = seg[which] + pos
    out = []
    for a, dt in ((xq, np.int8), (xd, np.float32), (xs, np.int32)):
        p = np.zeros((int(seg[-1]), a.shape[1]), dt)
        p[dest] = a
        out.append(p)
    return tuple(out), seg


@njit(inline="always", **_JIT)
def _segment(xq, xd, xs, p0, p1):
    """Packed rows p0..p1 of `pack_segments` output."""
    return xq[p0:p1], xd[p0:p1], xs[p0:p1]


def matmul_rows(w_raw: np.ndarray, qt: int, g0: int, g1: int, packed, out: np.ndarray) -> None:
    """Row groups g0..g1 (rows 8 g0 .. 8 g1) of out (n_tok, n_rows) = activations . w for
    a GEMM_TYPES matrix with rows % 8 == 0 and `pack_activations` output. Releases the GIL."""
    xq, xd, xs = packed
    _gemm_rows(w_raw, qt, g0, g1, xq, xd, xs, TILE_TOKENS, out)


# the parallel region over 1 to 3 matrices, per type set: DRIVERS.run(ws, qts, packed, outs, n_threads)
DRIVERS = gemm_parallel.Drivers(globals(), ("_run", "_run_wide", "_gemm_wide", "_gemm_rows"), _TYPE_NAMES,
                                TILE_TOKENS, "q32_wide" if _WIDE else "q32")
