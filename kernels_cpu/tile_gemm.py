"""Prefill products on 8-bit activations with VNNI: 4 weight rows x 16 tokens a tile.

A long prompt's products used to dequantize weight tiles to float32 for BLAS: ~100
GFLOP/s a core at best. `vpdpbusd` does 32 u8 x s8 products, summed in fours into 8 i32
lanes, in one instruction; here each lane is one token:
- `pack_activations` quantizes the prompt as the decode path does (Q8_0 blocks of 32)
  and lays the tokens in lanes: for block b and step i, 8 tokens' bytes 4i..4i+3 side by
  side. One packing serves every matrix on the same input (Q/K/V, gate/up).
- Per block, each row's 4-byte group i is broadcast to all lanes (vpermd) and dotted
  with the 8 tokens' group i; after 8 steps lane j holds the block's exact integer dot
  with token j. Two token groups share each broadcast, four rows each activation load.
- vpdpbusd multiplies unsigned by signed bytes: weights go in as unsigned codes (Q4_0,
  Q5_0: their codes; Q8_0: its byte + 128) with value = code - offset, so the integer
  sums start from -offset * (the token's block sum), packed beside the activations.
- Then per block, one float fma a row and 8 tokens: acc += (d_w * d_x) * dot, the order of
  llama.cpp's repacked GEMMs (not ggml_vec_dot's 8-lane order, so the last bits differ
  from a decoded token's; the BLAS path they replace differed too).

Measured on Gemma 3 270M's Q5_0 2048 x 640 with 512 tokens, 2 threads: 3.3 ms against
6.5 ms for dequantize + BLAS (~400 against ~205 GFLOP/s). Without VNNI the same IR runs a
portable emulation (exact, slow), so `matvec.matmul` takes the tiles only on VNNI CPUs.

The intrinsics build on the IR helpers (ir_helpers.py) and the value extraction of
dot_q32.py and dot_kquant.py; Numba's cache is keyed to all of them (cache_dir.py).
"""
from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from . import quant_kernels as qk
from .dot_kquant import q4k_block_bytes, q4k_qs32, q4k_scales_vec
from .dot_q32 import Q32, q32_values
from .ir_helpers import (F32T, I8, I16, I32, IRHelpers, c64, const_vec, counted_loop, has_vnni_features, mask,
                         row_ptrs, target_features, vec)
from .quant_kernels import Q4_0, Q4_K, Q4_K_X8, Q5_0, Q6_K, Q8_0
from .quant_types import TILE_IDS, tile_types

TILE_ROWS = 4     # weight rows a tile (adjacent; in a Q4_K_X8 matrix, half a group)
TILE_TYPES = tuple(int(t) for t in tile_types())   # the registry's `tile` types (quant_types)
TILE_LAYOUTS = TILE_IDS                            # and the repacked layouts (repack.py)
_JIT = dict(cache=True, nogil=True)


@functools.cache
def has_vnni() -> bool:
    """Whether the CPU Numba compiles for has 256-bit vpdpbusd (AVX512-VNNI with VL, or AVX-VNNI)."""
    return has_vnni_features(target_features(cpu_target.target_context))


def _dpbusd(h, acc, a_u8, b_s8):
    """acc + (<32 x i8> unsigned a . <32 x i8> signed b): <8 x i32>, lane i adding the
    products 4i..4i+3 (the accumulator also takes the correction, so no zeroed register
    and no subtraction per dot). Without VNNI: vpmaddubsw + vpmaddwd, exact while every
    pair a_2k b_2k + a_2k+1 b_2k+1 stays under 2^15, which holds for codes up to 127 (the
    callers' Q4_0, Q5_0, Q4_K and Q6_K codes; Q8_0 takes _dot_signed there)."""
    b = h.b
    if h.vnni:
        return h.dpbusd(acc, a_u8, b_s8)
    return b.add(acc, h.madd_i16(h.maddubs(a_u8, b_s8), const_vec(I16, 16, 1)))


def _dot_signed(h, acc, w_s8, b_s8):
    """acc + (<32 x i8> signed w . <32 x i8> signed b) summed in fours, without VNNI: |w| .
    sign(b, w), pairs <= 2 * 128 * 127 (the activations are in -127..127)."""
    return h.b.add(acc, h.madd_i16(h.maddubs(h.abs_i8(w_s8), h.sign_i8(b_s8, w_s8)), const_vec(I16, 16, 1)))


GROUP = 8                # tokens in one vector: lane j of every accumulator is token j
TILE_GROUPS = 2          # token groups a tile (16 tokens)
_OFFSET = {Q8_0: 128, Q4_0: 8, Q5_0: 16}   # weight = code - offset (Q8_0: its byte + 128)


def _signed_q8(h, qt):
    """Whether this tile takes Q8_0's bytes as signed values (_dot_signed): without VNNI,
    whose unsigned codes (byte + 128) would overflow vpmaddubsw's pairs."""
    return qt == Q8_0 and not h.vnni


def _codes(h, wrow, wo, qt):
    """Block at byte wo of a row as <32 x i8> unsigned codes (value = code - _OFFSET[qt]),
    or Q8_0's signed bytes themselves where _signed_q8."""
    if qt == Q8_0:
        raw = h.load(wrow, h.b.add(wo, c64(2)), vec(I8, 32))
        return raw if _signed_q8(h, qt) else h.b.xor(raw, const_vec(I8, 32, -128))
    return q32_values(h, wrow, wo, qt)


def _lane(h, v, i):
    """Lane i of <8 x i32> v in every lane (vpermd: one instruction, any lane)."""
    if h.avx2:
        return h.x86("llvm.x86.avx2.permd", vec(I32, 8), [v, const_vec(I32, 8, i)])
    return h.b.shuffle_vector(v, v, mask([i] * 8))


def _dots(h, isums, codes, xgs, act, steps=range(8), signed=False):
    """isums[row][group] += (row's 32 codes) . (activation block `act` of the group's 8
    tokens): each row's 4-byte group i broadcast against the tokens' groups i, for i in
    `steps` (all 8: the whole block). signed: the codes are signed values (_dot_signed)."""
    b = h.b
    dot = _dot_signed if signed else _dpbusd
    isums = [list(row) for row in isums]
    for i in steps:
        xvs = [h.load(xg, b.add(b.mul(act, c64(256)), c64(32 * i)), vec(I8, 32)) for xg in xgs]
        for k, c in enumerate(codes):
            bc = b.bitcast(_lane(h, c, i), vec(I8, 32))
            for gi, xv in enumerate(xvs):
                isums[k][gi] = dot(h, isums[k][gi], bc, xv)
    return isums


def _q32_block(h, qt, wrows, xgs, dgs, sgs, bi, accs):
    """One 32-element block (Q8_0, Q4_0, Q5_0) of the tile: the new accumulators."""
    b = h.b
    wo = b.mul(bi, c64(34 if qt == Q8_0 else Q32[qt][0]))
    shift = _OFFSET[qt].bit_length() - 1          # offsets are powers of two
    codes = [b.bitcast(_codes(h, wrow, wo, qt), vec(I32, 8)) for wrow in wrows]
    dw = [h.splat(h.load_f16(wrow, wo), 8) for wrow in wrows]
    # -offset * each token's block sum starts the integer sums, so the dots leave
    # code . x - offset * sum(x): the block's exact integer dot
    signed = _signed_q8(h, qt)
    if signed:
        starts = [ir.Constant(vec(I32, 8), [0] * 8)] * len(sgs)
    else:
        starts = [b.shl(h.load(sg, b.mul(bi, c64(32)), vec(I32, 8)), const_vec(I32, 8, shift)) for sg in sgs]
    isums = _dots(h, [list(starts) for _ in wrows], codes, xgs, bi, signed=signed)
    new = list(accs)
    for gi, dg in enumerate(dgs):
        dx = h.load(dg, b.mul(bi, c64(32)), vec(F32T, 8))
        for k in range(len(wrows)):
            n = TILE_GROUPS * k + gi
            new[n] = h.fma(b.fmul(dw[k], dx), b.sitofp(isums[k][gi], vec(F32T, 8)), accs[n])
    return new


def _q4_k_block(h, wrows, xgs, dgs, sgs, bi, accs, x8=False):
    """One 256-element Q4_K block of the tile: 8 sub-blocks of 32, each one activation
    block; value = d * sc_j * q - dmin * m_j, so per sub-block and token
    acc += dx * (d sc_j * (q . x) - dmin m_j * sum(x)). x8: Q4_K_X8 row pointers."""
    b = h.b
    wo = b.mul(bi, c64(q4k_block_bytes(x8)))
    izero = ir.Constant(vec(I32, 8), [0] * 8)
    scs, mns = [], []
    for wrow in wrows:       # the row's 8 scales times d and 8 mins times dmin, as floats
        sm = q4k_scales_vec(h, wrow, wo)
        as_f = [b.uitofp(b.zext(b.shuffle_vector(sm, sm, mask(range(o, o + 8))), vec(I32, 8)), vec(F32T, 8))
                for o in (0, 8)]
        scs.append(b.bitcast(b.fmul(h.splat(h.load_f16(wrow, wo), 8), as_f[0]), vec(I32, 8)))
        mns.append(b.bitcast(b.fmul(h.splat(h.load_f16(wrow, b.add(wo, c64(2))), 8), as_f[1]), vec(I32, 8)))
    new = list(accs)
    for j in range(8):
        act = b.add(b.mul(bi, c64(8)), c64(j))
        codes = []
        for wrow in wrows:   # sub-block j: low nibbles of qs[32 c ..] for j = 2c, high for 2c + 1
            q = q4k_qs32(h, wrow, wo, j // 2, x8)
            q = b.and_(q, const_vec(I8, 32, 15)) if j % 2 == 0 else b.lshr(q, const_vec(I8, 32, 4))
            codes.append(b.bitcast(q, vec(I32, 8)))
        isums = _dots(h, [[izero] * len(xgs) for _ in wrows], codes, xgs, act)
        for gi in range(len(xgs)):
            dx = h.load(dgs[gi], b.mul(act, c64(32)), vec(F32T, 8))
            neg_sum = b.sitofp(h.load(sgs[gi], b.mul(act, c64(32)), vec(I32, 8)), vec(F32T, 8))
            for k in range(len(wrows)):
                sc = b.bitcast(_lane(h, scs[k], j), vec(F32T, 8))
                mn = b.bitcast(_lane(h, mns[k], j), vec(F32T, 8))
                t = h.fma(sc, b.sitofp(isums[k][gi], vec(F32T, 8)), b.fmul(mn, neg_sum))
                n = TILE_GROUPS * k + gi
                new[n] = h.fma(dx, t, new[n])
    return new


def _q6_k_block(h, wrows, xgs, dgs, sgs, hgs, bi, accs):
    """One 256-element Q6_K block of the tile. Activation block a = 4 half + part takes
    codes (ql low or high nibbles) | (2 qh bits << 4), value = d * sc * (code - 32), with a
    scale for each 16 elements: steps 0-3 and 4-7 of the dots sum apart, each from -32
    times its half's activation sum, then acc += (d dx) * (scA * IA + scB * IB)."""
    b = h.b
    wo = b.mul(bi, c64(210))
    scales = []
    for wrow in wrows:   # 16 int8 scales as two <8 x i32>
        sc = b.sext(h.load(wrow, b.add(wo, c64(192)), vec(I8, 16)), vec(I32, 16))
        scales.append([b.shuffle_vector(sc, sc, mask(range(o, o + 8))) for o in (0, 8)])
    dws = [h.splat(h.load_f16(wrow, b.add(wo, c64(208))), 8) for wrow in wrows]
    new = list(accs)
    for a in range(8):
        half, part = divmod(a, 4)
        act = b.add(b.mul(bi, c64(8)), c64(a))
        codes = []
        for wrow in wrows:
            ql = h.load(wrow, b.add(wo, c64(64 * half + 32 * (part % 2))), vec(I8, 32))
            ql = b.and_(ql, const_vec(I8, 32, 15)) if part < 2 else b.lshr(ql, const_vec(I8, 32, 4))
            qh = h.load(wrow, b.add(wo, c64(128 + 32 * half)), vec(I8, 32))
            qh = b.shl(b.and_(b.lshr(qh, const_vec(I8, 32, 2 * part)), const_vec(I8, 32, 3)), const_vec(I8, 32, 4))
            codes.append(b.bitcast(b.or_(ql, qh), vec(I32, 8)))
        neg_all = [h.load(sg, b.mul(act, c64(32)), vec(I32, 8)) for sg in sgs]
        neg_a = [h.load(hg, b.mul(act, c64(32)), vec(I32, 8)) for hg in hgs]
        five = const_vec(I32, 8, 5)
        starts_a = [b.shl(v, five) for v in neg_a]
        starts_b = [b.shl(b.sub(t, v), five) for t, v in zip(neg_all, neg_a)]
        ia = _dots(h, [list(starts_a) for _ in wrows], codes, xgs, act, steps=range(4))
        ib = _dots(h, [list(starts_b) for _ in wrows], codes, xgs, act, steps=range(4, 8))
        s_idx = 8 * half + 2 * part          # scales s_idx (elements 0-15), s_idx + 1 (16-31)
        for k in range(len(wrows)):
            sca = _lane(h, scales[k][s_idx // 8], s_idx % 8)
            scb = _lane(h, scales[k][(s_idx + 1) // 8], (s_idx + 1) % 8)
            for gi, dg in enumerate(dgs):
                dx = h.load(dg, b.mul(act, c64(32)), vec(F32T, 8))
                tot = b.add(b.mul(sca, ia[k][gi]), b.mul(scb, ib[k][gi]))
                n = TILE_GROUPS * k + gi
                new[n] = h.fma(b.fmul(dws[k], dx), b.sitofp(tot, vec(F32T, 8)), new[n])
    return new


def _tile_codegen(qt, n_rows):
    """IR for rows r..r+n_rows-1 of w against token groups g..g+TILE_GROUPS-1 of the packed
    activations; stores row k, token (group gi, lane j) at tmp[k, GROUP * gi + j]."""
    def codegen(context, builder, sig, args):
        w_ty, _, xp_ty, dxp_ty, xsp_ty, xhp_ty, _, tmp_ty = sig.args
        arrs = [context.make_array(ty)(context, builder, a) for ty, a in
                zip((w_ty, xp_ty, dxp_ty, xsp_ty, xhp_ty, tmp_ty), (args[0], args[2], args[3], args[4], args[5], args[7]))]
        w, xp, dxp, xsp, xhp, tmp = arrs
        r, g = args[1], args[6]
        h = IRHelpers(builder, target_features(context))
        b = builder
        i8p = I8.as_pointer()

        wrows = row_ptrs(b, w, r, n_rows, qt == Q4_K_X8)
        xgs, dgs, sgs, hgs = (row_ptrs(b, a, g, TILE_GROUPS) for a in (xp, dxp, xsp, xhp))
        n_act = b.sdiv(cgutils.unpack_tuple(b, dxp.shape)[1], c64(GROUP))   # dxp: (groups, blocks * GROUP)
        zero = ir.Constant(vec(F32T, 8), [0.0] * 8)
        if qt in (Q4_K, Q4_K_X8):
            def block(bi, accs):
                return _q4_k_block(h, wrows, xgs, dgs, sgs, bi, accs, qt == Q4_K_X8)
            n_blocks = b.sdiv(n_act, c64(8))
        elif qt == Q6_K:
            def block(bi, accs):
                return _q6_k_block(h, wrows, xgs, dgs, sgs, hgs, bi, accs)
            n_blocks = b.sdiv(n_act, c64(8))
        else:
            def block(bi, accs):
                return _q32_block(h, qt, wrows, xgs, dgs, sgs, bi, accs)
            n_blocks = n_act
        fin = counted_loop(b, n_blocks, 1, [zero] * (n_rows * TILE_GROUPS), block, "tile")
        tstride = cgutils.unpack_tuple(b, tmp.strides)[0]
        tbase = b.bitcast(tmp.data, i8p)
        for k in range(n_rows):
            for gi in range(TILE_GROUPS):
                p = b.gep(tbase, [b.add(b.mul(c64(k), tstride), c64(4 * GROUP * gi))])
                b.store(fin[TILE_GROUPS * k + gi], b.bitcast(p, vec(F32T, 8).as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _make_tile(qt, n_rows):
    @intrinsic
    def tile(typingctx, w, r, xp, dxp, xsp, xhp, g, tmp):
        """Rows r.. of w . token groups g.. of the packed activations, into tmp (see _tile_codegen)."""
        return types.void(w, r, xp, dxp, xsp, xhp, g, tmp), _tile_codegen(qt, n_rows)
    return tile


_tile4_q8_0, _tile1_q8_0 = _make_tile(Q8_0, TILE_ROWS), _make_tile(Q8_0, 1)
_tile4_q4_0, _tile1_q4_0 = _make_tile(Q4_0, TILE_ROWS), _make_tile(Q4_0, 1)
_tile4_q5_0, _tile1_q5_0 = _make_tile(Q5_0, TILE_ROWS), _make_tile(Q5_0, 1)
_tile4_q4_k, _tile1_q4_k = _make_tile(Q4_K, TILE_ROWS), _make_tile(Q4_K, 1)
_tile4_q4_k_x8, _tile1_q4_k_x8 = _make_tile(Q4_K_X8, TILE_ROWS), _make_tile(Q4_K_X8, 1)
_tile4_q6_k, _tile1_q6_k = _make_tile(Q6_K, TILE_ROWS), _make_tile(Q6_K, 1)


@njit(**_JIT)
def _tile(w, qt, r, n, xp, dxp, xsp, xhp, g, tmp):
    four = n == TILE_ROWS
    if qt == Q8_0:
        _tile4_q8_0(w, r, xp, dxp, xsp, xhp, g, tmp) if four else _tile1_q8_0(w, r, xp, dxp, xsp, xhp, g, tmp)
    elif qt == Q4_0:
        _tile4_q4_0(w, r, xp, dxp, xsp, xhp, g, tmp) if four else _tile1_q4_0(w, r, xp, dxp, xsp, xhp, g, tmp)
    elif qt == Q4_K:
        _tile4_q4_k(w, r, xp, dxp, xsp, xhp, g, tmp) if four else _tile1_q4_k(w, r, xp, dxp, xsp, xhp, g, tmp)
    elif qt == Q4_K_X8:
        _tile4_q4_k_x8(w, r, xp, dxp, xsp, xhp, g, tmp) if four else _tile1_q4_k_x8(w, r, xp, dxp, xsp, xhp, g, tmp)
    elif qt == Q6_K:
        _tile4_q6_k(w, r, xp, dxp, xsp, xhp, g, tmp) if four else _tile1_q6_k(w, r, xp, dxp, xsp, xhp, g, tmp)
    else:
        _tile4_q5_0(w, r, xp, dxp, xsp, xhp, g, tmp) if four else _tile1_q5_0(w, r, xp, dxp, xsp, xhp, g, tmp)


@njit(**_JIT)
def _matmul_rows(w, qt, r0, r1, xp, dxp, xsp, xhp, out):
    """out[t, r] for r0 <= r < r1 and every token, on this thread."""
    n_tok = out.shape[0]
    tmp = np.empty((TILE_ROWS, GROUP * TILE_GROUPS), np.float32)
    r = r0
    while r < r1:
        n = TILE_ROWS if r + TILE_ROWS <= r1 else 1
        for g in range(0, xp.shape[0], TILE_GROUPS):
            _tile(w, qt, r, n, xp, dxp, xsp, xhp, g, tmp)
            t0 = g * GROUP
            for k in range(n):
                for j in range(min(GROUP * TILE_GROUPS, n_tok - t0)):
                    out[t0 + j, r + k] = tmp[k, j]
        r += n


@njit(**_JIT)
def _quantize_packed(X, xp, dxp, xsp, xhp):
    n_tok, n_cols = X.shape
    nb = n_cols // 32
    xq = np.empty(n_cols, np.int8)
    xd = np.empty(nb, np.float32)
    xs = np.empty(nb, np.int32)
    for t in range(n_tok):
        qk.quantize_q8_0(X[t], xq, xd, xs, 32)
        g, j = t // GROUP, t % GROUP
        for bi in range(nb):
            dxp[g, bi * GROUP + j] = xd[bi]
            xsp[g, bi * GROUP + j] = -xs[bi]
            half = 0
            for e in range(16):
                half += xq[bi * 32 + e]
            xhp[g, bi * GROUP + j] = -half
            for i in range(8):
                for c in range(4):
                    xp[g, bi * 256 + i * 32 + j * 4 + c] = xq[bi * 32 + i * 4 + c]


def pack_activations(X: np.ndarray):
    """Quantize X (n_tok, n_cols) float32 to 8 bits as matvec does (Q8_0 blocks: the same
    values) with the tokens in lanes: xp[g, b, i, j] = bytes 4i..4i+3 of block b of token
    GROUP * g + j, dxp[g, b, j] that block's scale, xsp[g, b, j] minus its sum; zero tokens
    pad to whole tiles. One packing serves every TILE_TYPES matrix on this input."""
    n_tok, n_cols = X.shape
    nb = n_cols // 32
    n_groups = -(-n_tok // (GROUP * TILE_GROUPS)) * TILE_GROUPS
    xp = np.zeros((n_groups, nb * 256), np.int8)
    dxp = np.zeros((n_groups, nb * GROUP), np.float32)
    xsp = np.zeros((n_groups, nb * GROUP), np.int32)
    xhp = np.zeros((n_groups, nb * GROUP), np.int32)
    _quantize_packed(np.ascontiguousarray(X, dtype=np.float32), xp, dxp, xsp, xhp)
    return xp, dxp, xsp, xhp


def matmul_rows(w_raw, qt: int, r0: int, r1: int, packed, out) -> None:
    """Rows r0..r1 of out (n_tok, n_rows) = activations . w, for a TILE_TYPES weight and
    `pack_activations` output. Releases the GIL: callers run row ranges on their own threads."""
    xp, dxp, xsp, xhp = packed
    _matmul_rows(w_raw, qt, r0, r1, xp, dxp, xsp, xhp, out)
