"""gemm_kquant's token products with 512-bit VNNI: 32 rows a step, vpdpbusd sums.

gemm_kquant stages each block of 8 rows into a scratch (codes [sub-block][step][row][4
bytes], scales, d) and runs every token of a tile against it with vpmaddubsw, whose i16
pair sums take an add per product and a vpmaddwd per scale. On CPUs with AVX512-VNNI
(Zen 4 and later, Intel since Ice Lake) this module takes four staged groups at a time:
- `merge` lays them side by side once per block: each 128-byte line of codes holds 32
  rows' 4 bytes (two zmm), each group's scale becomes one i32 a row.
- Per token, bytes 4k..4k+3 of its sub-block are broadcast to 16 lanes once and serve
  both zmm of the line: vpdpbusd sums each row's four u8 x s8 products in its i32 lane,
  exactly, whatever the code width (no i16 bound as vpmaddubsw's). Each sub-block's
  (Q4_K, Q5_K: 32 values) or group's (per-16 types: 16) sum times its scale (vpmulld)
  adds into the token's I. Eight tokens a step: their 16 chains hide vpdpbusd's latency.
- The min and offset terms are gemm_kquant's vpmaddwd against the token's packed sums,
  32 rows wide; the float work per block and token is the same fma per row, so every
  result has the bits of the 8-row kernel (and of the decoded token where that one has).
Measured with 2 threads on an AVX-512 VNNI Xeon (Sapphire Rapids class), 512 tokens,
against the 8-row kernel in the same build: Q4_K 8192 x 2048 27-30 ms against 55 ms,
Q6_K 33-37 against 59. 16 rows a step (one zmm a line) ran 33 and 38 ms, 48 rows four
tokens a step 28-30 and 32-35 (within the noise of 32 rows; 32 divides more matrices).

The scratch offsets are gemm_kquant's (passed in as `StagedLayout`), so this module does
not import it. Signed codes (the i-quants', IQ4_XS's table values) are staged with an
offset (64, 128) that makes them u8, taken back against the token's sums as Q6_K's 32;
the i-quants whose scale covers 32 values (IQ2_XXS, IQ3_XXS, IQ3_S, IQ4_XS) take the
"per32" kind: half the vpmulld of "per16" (512 tokens x 8192 x 2048: IQ3_S 36.9 -> 27.9
ms; IQ4_XS, on the 8-row kernel before, 95 -> 30 ms).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

from numba import types
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from .ir_helpers import (F32T, I8, I16, I32, IRHelpers, c64, const_vec, counted_loop, mask, row_pointer,
                         target_features, vec)

GROUPS = 4              # gemm_kquant's 8-row groups a wide group
ROWS = 8 * GROUPS       # rows a wide group: two zmm of i32 lanes
LANES = 16              # i32 lanes a zmm
NV = ROWS // LANES      # zmm a line (each token broadcast serves NV products)
TOKENS = 4              # tokens a step (gemm_kquant's padding)
STEP = 8                # tokens a step while that many are left
ACC_COLS = 2 * ROWS     # per token: acc (32 floats), then accm (32 floats)
# the wide scratch: code lines [sub-block j][step k] of 4 bytes a row (128 bytes), then
# per group one i32 scale a row, per pair line two i16 a row, and d and dmin a float a row
_LINE = 4 * ROWS
_CODES = 0
_SC = _SC16 = 64 * _LINE
_MN, _PR16 = _SC + 8 * _LINE, _SC16 + 16 * _LINE
_D, _D16 = _MN + 4 * _LINE, _PR16 + 8 * _LINE
_DMIN, _DMIN16 = _D + _LINE, _D16 + _LINE
SCRATCH_BYTES = _DMIN16 + _LINE


class StagedLayout(NamedTuple):
    """Byte offsets of gemm_kquant's 8-row scratch."""
    codes: int
    scales: int     # Q4_K: 8 x 16 i16 (each scale twice); per-16: 16 x 16 i16
    mins: int       # Q4_K: 4 x 16 i16 min pairs; per-16: 8 x 16 i16 pairs
    d: int
    dmin: int
    per16: bool     # the per-16 layout (Q6_K, Q3_K, Q2_K, i-quants) rather than Q4_K's
    stride: int     # bytes from one group's scratch to the next


@functools.cache
def host_has_wide() -> bool:
    """Whether the CPU Numba compiles for has 512-bit vpdpbusd and vpmaddwd."""
    return {"+avx512vnni", "+avx512bw", "+avx512f"} <= target_features(cpu_target.target_context)


@functools.cache
def enabled() -> bool:
    """Whether the 32-row kernels run (gemm_kquant's, gemm_q32's) and matvec routes by their
    crossovers: on such CPUs, unless EDGEINFER_NO_WIDE_GEMM=1 (A/B benchmarks; the GEMM
    drivers compiled either way are cached under their own names)."""
    return host_has_wide() and not os.environ.get("EDGEINFER_NO_WIDE_GEMM")


def store(b, base, off, v):
    b.store(v, b.bitcast(b.gep(base, [c64(off)]), v.type.as_pointer()), align=1)


def load(b, base, off, ty):
    return b.load(b.bitcast(b.gep(base, [c64(off)]), ty.as_pointer()), align=1)


def gather_groups(b, src, at, ty):
    """The GROUPS staged scratches' `ty` vectors at byte `at` of each (src: their i8
    pointers), one after the other in one vector (8-row lanes -> 32-row lanes)."""
    vs = [load(b, p, at, ty) for p in src]
    while len(vs) > 1:   # GROUPS is a power of two
        vs = [b.shuffle_vector(vs[i], vs[i + 1], mask(range(2 * vs[i].type.count))) for i in range(0, len(vs), 2)]
    return vs[0]


def _merge_codegen(lay: StagedLayout):
    def codegen(context, builder, sig, args):
        b = builder
        s4, sw = (b.bitcast(context.make_array(t)(context, b, a).data, I8.as_pointer())
                  for t, a in zip(sig.args, args))
        src = [b.gep(s4, [c64(q * lay.stride)]) for q in range(GROUPS)]

        def cat(at, ty):
            return gather_groups(b, src, at, ty)
        for line in range(64):   # codes: [j][k] lines of 8 rows x 4 bytes -> 32 rows
            store(b, sw, _CODES + _LINE * line, cat(lay.codes + 32 * line, vec(I8, 32)))
        n_sc, n_pr = (16, 8) if lay.per16 else (8, 4)
        sc_at, pr_at = (_SC16, _PR16) if lay.per16 else (_SC, _MN)
        for g in range(n_sc):   # each row's scale twice as i16 -> once as i32
            v = cat(lay.scales + 32 * g, vec(I16, 16))
            v = b.shuffle_vector(v, v, mask(range(0, 4 * ROWS // 2, 2)))
            store(b, sw, sc_at + 4 * ROWS * g, b.sext(v, vec(I32, ROWS)))
        for i in range(n_pr):   # the i16 pairs for vpmaddwd, 32 rows
            store(b, sw, pr_at + 4 * ROWS * i, cat(lay.mins + 32 * i, vec(I16, 16)))
        d_at, dmin_at = (_D16, _DMIN16) if lay.per16 else (_D, _DMIN)
        for at, dst in ((lay.d, d_at), (lay.dmin, dmin_at)):
            store(b, sw, dst, cat(at, vec(F32T, 8)))
        return context.get_dummy_value()
    return codegen


def make_merge(lay: StagedLayout):
    """merge(s4, sw): the wide scratch sw of four staged 8-row scratches, s4's rows
    (each lay.stride bytes: rows 8q..8q+7 in s4[q])."""
    codegen = _merge_codegen(lay)

    @intrinsic
    def merge(typingctx, s4, sw):
        return types.void(s4, sw), codegen
    return merge


def dpbusd512(h, acc, w, x):
    return h.x86("llvm.x86.avx512.vpdpbusd.512", vec(I32, 16), [acc, w, x])


def _madd(h, a16, x16):
    return h.x86("llvm.x86.avx512.pmaddw.d.512", vec(I32, 16), [a16, x16])


def bcast16(h, p, off):
    """The 4 bytes at p + off in all 16 lanes (vpdpbusd's embedded broadcast)."""
    return h.splat(h.load(p, c64(off), I32), LANES)


def _scaled_sums(h, sw, xs, n_groups, pair_scales=False):
    """[[I] NV x <16 x i32>] a token: sum over the n_groups groups (8 of 32 values, or 16
    of 16) of scale_g * (codes . x)_g, each group's sum in i32 by vpdpbusd, one token
    broadcast serving both zmm of a line. The 8 sub-blocks are a loop, not unrolled.
    pair_scales: 8 groups whose scales sit in the per-16 layout, each twice (the i-quants
    with one scale per 32 values): every other scale line is read."""
    b = h.b
    zero = const_vec(I32, LANES, 0)
    per_j = n_groups // 8    # groups a sub-block: 1 or 2
    steps = 8 // per_j       # 4-byte steps a group
    sc_at = _SC16 if n_groups == 16 or pair_scales else _SC
    sc_step = 4 * ROWS * (2 if pair_scales else per_j)   # bytes from sub-block j's scales to j + 1's
    nt = len(xs)

    def sub_block(j, flat):
        isum = [flat[NV * t:NV * t + NV] for t in range(nt)]
        for gi in range(per_j):
            at = b.add(b.mul(j, c64(sc_step)), c64(sc_at + 4 * ROWS * gi))
            sc = [h.load(sw, b.add(at, c64(64 * v)), vec(I32, LANES)) for v in range(NV)]
            sub = [[zero] * NV for _ in range(nt)]
            for k in range(steps):
                line = gi * steps + k   # the step within sub-block j
                at = b.add(b.mul(j, c64(8 * _LINE)), c64(_CODES + _LINE * line))
                wv = [h.load(sw, b.add(at, c64(64 * v)), vec(I32, LANES)) for v in range(NV)]
                for t, x in enumerate(xs):
                    xb = bcast16(h, b.gep(x, [b.mul(j, c64(32))]), 4 * line)
                    sub[t] = [dpbusd512(h, s, w, xb) for s, w in zip(sub[t], wv)]
            isum = [[b.add(i, b.mul(s, c)) for i, s, c in zip(it, st, sc)] for it, st in zip(isum, sub)]
        return [v for it in isum for v in it]
    flat = counted_loop(b, c64(8), 1, [zero] * (NV * nt), sub_block, "kqw_sub")
    return [flat[NV * t:NV * t + NV] for t in range(nt)]


def _pair_sums(h, sw, bs, at, n, first):
    """[NV x sum_i pairs_i . (the token's i16 sums first + 2i, first + 2i + 1)] a token."""
    b = h.b
    out = [[const_vec(I32, LANES, 0)] * NV for _ in bs]
    for i in range(n):
        pv = [h.load(sw, c64(at + 4 * ROWS * i + 64 * v), vec(I16, 2 * LANES)) for v in range(NV)]
        for t, p in enumerate(bs):
            xb = b.bitcast(bcast16(h, p, first + 4 * i), vec(I16, 2 * LANES))
            out[t] = [b.add(o, _madd(h, w, xb)) for o, w in zip(out[t], pv)]
    return out


def _tokens_codegen(kind: str, code_offset: int):
    """kind: "q4k" (Q4_K, Q5_K: I and the min term M), "per16" (I minus offset * the group
    sums, Q6_K / Q3_K / the i-quants), "per32" (per16's layout and sums where each scale
    covers 32 values: IQ2_XXS, IQ3_XXS, IQ3_S; half the vpmulld), "q2k" (I and the per-16
    min term M)."""
    def codegen(context, builder, sig, args):
        s, xq, xd, xb = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:4], args[:4]))
        acc = context.make_array(sig.args[6])(context, builder, args[6])
        bi, t_lo, t_hi = args[4], args[5], args[7]
        b = builder
        h = IRHelpers(b, target_features(context))
        i8p = I8.as_pointer()
        sw = b.bitcast(s.data, i8p)

        xrow, drow, brow = (row_pointer(b, a, bi) for a in (xq, xd, xb))   # block-major
        arow = row_pointer(b, acc)
        per16 = kind != "q4k"

        def floats(at):
            return [h.load(sw, c64(at + 64 * v), vec(F32T, LANES)) for v in range(NV)]
        d = floats(_D16 if per16 else _D)
        dmin = None if kind in ("per16", "per32") else floats(_DMIN16 if per16 else _DMIN)

        def update(ap, off, scale, dx, ints):
            for v in range(NV):   # acc += (scale * dx) * ints: the 8-row kernel's fma per row
                a = h.load(ap, c64(off + 64 * v), vec(F32T, LANES))
                f = h.fma(b.fmul(scale[v], h.splat(dx, LANES)), b.sitofp(ints[v], vec(F32T, LANES)), a)
                store(b, ap, off + 64 * v, f)

        def tokens_at(first, n_t):
            ts = [b.add(first, c64(ti)) for ti in range(n_t)]
            xs, bs = [xrow(t) for t in ts], [brow(t) for t in ts]
            isum = _scaled_sums(h, sw, xs, 16 if kind in ("per16", "q2k") else 8, kind == "per32")
            msum = None
            if kind == "q4k":
                msum = _pair_sums(h, sw, bs, _MN, 4, 0)
            elif kind == "q2k":
                msum = _pair_sums(h, sw, bs, _PR16, 8, 16)
            else:   # minus offset * sum_g scale_g * (the token's sum over group g)
                shift = const_vec(I32, LANES, code_offset.bit_length() - 1)
                isum = [[b.sub(v, b.shl(o, shift)) for v, o in zip(it, ot)]
                        for it, ot in zip(isum, _pair_sums(h, sw, bs, _PR16, 8, 16))]
            for ti in range(n_t):
                dx = h.load(drow(ts[ti]), c64(0), F32T)
                ap = arow(ts[ti])
                update(ap, 0, d, dx, isum[ti])
                if msum is not None:
                    update(ap, 4 * ROWS, dmin, b.fneg(dx), msum[ti])

        # STEP tokens at a time (their chains of vpdpbusd interleave), then a last TOKENS
        n = b.sub(t_hi, t_lo)
        n_steps = b.mul(b.sdiv(n, c64(STEP)), c64(STEP))
        counted_loop(b, n_steps, STEP, [], lambda i, _: tokens_at(b.add(t_lo, i), STEP) or [], "kqw_tok")
        counted_loop(b, b.sub(n, n_steps), TOKENS, [],
                     lambda i, _: tokens_at(b.add(b.add(t_lo, n_steps), i), TOKENS) or [], "kqw_last")
        return context.get_dummy_value()
    return codegen


def make_tokens(kind: str, code_offset: int = 0):
    """tokens(sw, xq, xd, xb, bi, t_lo, acc, t_hi): for tokens t_lo..t_hi (a multiple of
    TOKENS apart), acc[t, :32] += block bi's scaled dots, acc[t, 32:] its min terms."""
    codegen = _tokens_codegen(kind, code_offset)

    @intrinsic
    def tokens(typingctx, s, xq, xd, xb, bi, t_lo, acc, t_hi):
        return types.void(s, xq, xd, xb, bi, t_lo, acc, t_hi), codegen
    return tokens
