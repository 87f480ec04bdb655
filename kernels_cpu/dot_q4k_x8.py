"""Q4_K four rows in float lanes, llama.cpp's repacked-gemv order, and its interleaved layout Q4_K_X8.

Per block each row's integer dot and min dot, then one fma per row lane-wise: the order of
llama.cpp's repacked 8-row gemv (not ggml_vec_dot_q4_K's). Q4_K_X8 (repack.py) holds the
same blocks with rows interleaved in eights; its kernels give the plain layout's bits.
Loops: 512-bit (AVX512-BW), AVX2 with two rows a vector, and a generic 256-bit one.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .dot_kquant import k_nibbles, make_deq_q45_k, q4k_block_bytes, q4k_qs32, q4k_scales_heads, q4k_scales_vec
from .ir_helpers import (F16T, F32T, I8, I16, I32, ROWS, X8_BLOCK, X8_ROWS, IRHelpers, array_ptrs, c64, const_vec,
                         counted_loop, make_deq_intrinsic, mask, prefetch_lines, target_features, vec)


def _reduce_rows4(h, vs):
    """4 x <8 x i32> -> <8 x i32> whose lanes k and k + 4 are the sum of vs[k]'s lanes (exact)."""
    b = h.b
    q = _hadd_i32(b, _hadd_i32(b, vs[0], vs[1]), _hadd_i32(b, vs[2], vs[3]))    # rows 0-3 in each 128-bit half
    return b.add(q, b.shuffle_vector(q, q, mask([4, 5, 6, 7, 0, 1, 2, 3])))


def _q4_k_rows4_lanes(context, builder, sig, args):
    """Rows r, r+step, r+2*step, r+3*step of a Q4_K matrix with one row per float lane, in
    the order of llama.cpp's repacked 8-row gemv: per block, each row's integer dot I and
    min dot M, then acc += (d*dx) * I and accm += (dmin*(-dx)) * M lane-wise; row k's
    result is acc[k] + accm[k]. (That gemv sums each block's integer dot to one integer
    before a single float fma per block, so its float order differs from
    ggml_vec_dot_q4_K's; the lanes are independent, so 4 rows give its bits as 8 do.)
    AVX2 takes the rows in pairs (_q4_k_rows4_block_256); the generic 256-bit loop runs
    the float work on 8 lanes, rows 0-3 twice: as cheap as 4 lanes."""
    (wrows, xq, xd, xs), nb = array_ptrs(context, builder, sig, args, ROWS)
    h = IRHelpers(builder, target_features(context))
    b = builder
    lanes = 4 if h.avx512bw and h.f16c else 8
    zero = ir.Constant(vec(F32T, lanes), [0.0] * lanes)
    if h.avx2 and lanes == 8:   # rows in pairs (_q4_k_rows4_block_256): one <8 x float> for acc and accm
        tot, = counted_loop(b, nb, 1, [zero], lambda bi, accs: [_q4_k_rows4_block_256(h, wrows, xq, xd, xs, bi, *accs)],
                            "q4k4")
        lane = [0, 4, 1, 5]       # row k's acc; its accm two lanes on
        return [b.fadd(b.extract_element(tot, ir.Constant(I32, i)), b.extract_element(tot, ir.Constant(I32, i + 2)))
                for i in lane]

    def block(bi, accs):
        return _q4_k_rows4_block(h, wrows, xq, xd, xs, bi, *accs)
    ra, rm = counted_loop(b, nb, 1, [zero, zero], block, "q4k4")
    tot = b.fadd(ra, rm)
    return [b.extract_element(tot, ir.Constant(I32, k)) for k in range(ROWS)]


def _q4_k_rows_isums_512(h, wrows, wo, xq, xo, sm):
    """The rows' integer dots sum_j scale_j * (q_j . x_j) of one Q4_K block on 512-bit
    vectors (AVX512-BW): the same products and exact sums as the 256-bit loop in half the
    instructions. A 64-byte load holds qs for c = 2p, 2p + 1: its low nibbles are
    sub-blocks 4p and 4p + 2, its high ones 4p + 1 and 4p + 3. sm: the rows' scale bytes,
    row k's in 128-bit lane k (_q4_k_scales_rows4). Returns <16 x i32> partial sums per row."""
    b = h.b
    v64, v32i16, v16i32 = vec(I8, 64), vec(I16, 32), vec(I32, 16)
    isums = [ir.Constant(v16i32, [0] * 16)] * len(wrows)
    for p in range(2):
        xvs = []
        for hi in range(2):   # activations of sub-blocks 4p + hi and 4p + 2 + hi, side by side
            lo32 = h.load(xq, b.add(xo, c64(32 * (4 * p + hi))), vec(I8, 32))
            hi32 = h.load(xq, b.add(xo, c64(32 * (4 * p + 2 + hi))), vec(I8, 32))
            xvs.append(b.shuffle_vector(lo32, hi32, mask(range(64))))
        for k, wrow in enumerate(wrows):
            q = h.load(wrow, b.add(wo, c64(16 + 64 * p)), v64)
            for hi in range(2):
                nib = b.and_(q, const_vec(I8, 64, 15)) if hi == 0 else b.lshr(q, const_vec(I8, 64, 4))
                p16 = h.x86("llvm.x86.avx512.pmaddubs.w.512", v32i16, [nib, xvs[hi]])   # <= 2*15*128
                j0, j1 = 4 * p + hi, 4 * p + 2 + hi     # each half's scale, zero-extended to i16
                # row k's scale bytes (lane k of sm) picked and zero-extended in one byte permute
                pick = [16 * k + j0, 64] * 16 + [16 * k + j1, 64] * 16
                sc = b.bitcast(b.shuffle_vector(sm, const_vec(I8, 64, 0), mask(pick)), v32i16)
                isums[k] = b.add(isums[k], h.x86("llvm.x86.avx512.pmaddw.d.512", v16i32, [p16, sc]))
    return isums


def _q4_k_scales_rows4(h, wrows, wo):
    """The 4 rows' 16-byte block heads (d|dmin, 12 scale bytes) in one <16 x i32>, decoded
    at once: (<64 x i8> with row k's 8 scales then 8 mins in 128-bit lane k, <4 x i32> of
    the rows' d | dmin << 16). The decode is q4k_scales_vec's, on all four rows' lanes."""
    b = h.b
    heads = [h.load(wrow, wo, vec(I32, 4)) for wrow in wrows]    # dm u0 u1 u2, per row
    return _q4_k_decode_heads4(h, b.shuffle_vector(b.shuffle_vector(heads[0], heads[1], mask(range(8))),
                                                   b.shuffle_vector(heads[2], heads[3], mask(range(8))),
                                                   mask(range(16))))


def _q4_k_decode_heads4(h, v):
    """_q4_k_scales_rows4 on the 4 heads already in one <16 x i32> (row k's in lane k)."""
    return q4k_scales_heads(h, v), h.b.shuffle_vector(v, v, mask([0, 4, 8, 12]))


def _sum_rows4_512(h, vs):
    """4 x <16 x i32> -> <4 x i32> of their lane sums (exact): two unpack-and-add rounds
    leave each 128-bit lane holding [s0 s1 s2 s3] partials, then the lanes are added."""
    b = h.b

    def unpack_add(x, y, lo, hi):
        return b.add(b.shuffle_vector(x, y, mask([16 * (i >= 2) + 4 * l + j for l in range(4) for i, j in enumerate(lo)])),
                     b.shuffle_vector(x, y, mask([16 * (i >= 2) + 4 * l + j for l in range(4) for i, j in enumerate(hi)])))
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
    wo = b.mul(bi, c64(144))
    sm, dm = _q4_k_scales_rows4(h, wrows, wo)
    isums = _q4_k_rows_isums_512(h, wrows, wo, xq, b.mul(bi, c64(256)), sm)
    return _q4_k_rows4_finish_512(h, sm, dm, _sum_rows4_512(h, isums), xd, xs, bi, acc, accm)


def _lane_sums4(h, v):
    """<16 x i32> -> <4 x i32> of each 128-bit lane's sum (exact): two swap-and-add rounds."""
    b = h.b
    v = b.add(v, b.shuffle_vector(v, v, mask([4 * l + j for l in range(4) for j in (1, 0, 3, 2)])))
    v = b.add(v, b.shuffle_vector(v, v, mask([4 * l + j for l in range(4) for j in (2, 3, 0, 1)])))
    return b.shuffle_vector(v, v, mask([0, 4, 8, 12]))


def _q4_k_rows4_finish_512(h, sm, dm, isum4, xd, xs, bi, acc, accm):
    """The float side of one block for 4 rows in 4 lanes: (acc, accm) + the block's terms,
    from the decoded heads (_q4_k_decode_heads4) and the rows' integer dots (<4 x i32>)."""
    b = h.b
    dx = h.load(xd, b.mul(bi, c64(4)), F32T)
    # min sums: row k's 8 mins (i16, lane k) . the 8 per-32 activation sums (|s| <= 32*128,
    # exact in i16, the same in every lane)
    mins16 = b.bitcast(h.x86("llvm.x86.avx512.pshuf.b.512", vec(I8, 64),
                              [sm, const_vec(I8, 64, [v for j in range(8, 16) for v in (j, -128)] * 4)]), vec(I16, 32))
    bs16 = b.trunc(h.pairs(h.load(xs, b.mul(bi, c64(64)), vec(I32, 16))), vec(I16, 8))
    bs16 = b.shuffle_vector(bs16, bs16, mask(list(range(8)) * 4))
    mp = h.x86("llvm.x86.avx512.pmaddw.d.512", vec(I32, 16), [mins16, bs16])   # 4 partials per lane
    tot_m = b.sitofp(_lane_sums4(h, mp), vec(F32T, 4))
    tot_i = b.sitofp(isum4, vec(F32T, 4))
    dm16 = b.bitcast(dm, vec(I16, 8))
    d = b.fpext(b.bitcast(b.shuffle_vector(dm16, dm16, mask([0, 2, 4, 6])), vec(F16T, 4)), vec(F32T, 4))
    dmin = b.fpext(b.bitcast(b.shuffle_vector(dm16, dm16, mask([1, 3, 5, 7])), vec(F16T, 4)), vec(F32T, 4))
    return [h.fma(b.fmul(d, h.splat(dx, 4)), tot_i, acc),
            h.fma(b.fmul(dmin, h.splat(b.fneg(dx), 4)), tot_m, accm)]


def _q4_k_rows4_block(h, wrows, xq, xd, xs, bi, acc, accm, x8=False):
    """One block of _q4_k_rows4_lanes: the new (acc, accm). x8: the rows are Q4_K_X8 row
    pointers (the 256-bit loop only: AVX-512 hosts take _q4_k_x8_block_512)."""
    if h.avx512bw and h.f16c and not x8:
        return _q4_k_rows4_block_512(h, wrows, xq, xd, xs, bi, acc, accm)
    b = h.b
    wo = b.mul(bi, c64(q4k_block_bytes(x8)))
    dx = h.load(xd, b.mul(bi, c64(4)), F32T)
    bs32 = h.pairs(h.load(xs, b.mul(bi, c64(64)), vec(I32, 16)))     # per-32 sums of x
    xo = b.mul(bi, c64(256))
    msums = []
    dm = ir.Constant(vec(I32, 8), [0] * 8)
    # the 4 rows sub-block by sub-block, each activation vector loaded once for all of
    # them: rows one after another made LLVM keep all 8 activation vectors live (it shares
    # the identical loads) and spill; this order measured 11-15% faster, in L2 and from
    # memory. Integer sums are exact, so the order within a row changes no bit.
    sms = [q4k_scales_vec(h, wrow, wo) for wrow in wrows]
    sc2s = [b.shuffle_vector(sm, sm, mask(list(range(16)) * 2)) for sm in sms]   # both lanes
    isums = [ir.Constant(vec(I32, 8), [0] * 8)] * len(wrows)
    for c in range(4):
        xvs = [h.load(xq, b.add(xo, c64(64 * c + 32 * hi)), vec(I8, 32)) for hi in range(2)]
        for k, wrow in enumerate(wrows):
            q = q4k_qs32(h, wrow, wo, c, x8)
            for hi in range(2):   # sub-block 2c + hi: low nibbles, then high
                p16 = h.maddubs(k_nibbles(h, q, hi), xvs[hi])             # pairs <= 2*15*128
                isums[k] = b.add(isums[k], h.madd_i16(p16, h.bcast_u8_as_i16(sc2s[k], 2 * c + hi)))
    for k, wrow in enumerate(wrows):
        mn32 = b.zext(b.shuffle_vector(sms[k], sms[k], mask(range(8, 16))), vec(I32, 8))
        msums.append(b.mul(mn32, bs32))
        dmk = h.load(wrow, wo, I32)                                     # d | dmin << 16
        dm = b.insert_element(b.insert_element(dm, dmk, ir.Constant(I32, k)), dmk, ir.Constant(I32, k + 4))
    tot_i = b.sitofp(_reduce_rows4(h, isums), vec(F32T, 8))
    tot_m = b.sitofp(_reduce_rows4(h, msums), vec(F32T, 8))
    dm16 = b.bitcast(dm, vec(I16, 16))
    d = h.f16_lanes(b.shuffle_vector(dm16, dm16, mask(range(0, 16, 2))))
    dmin = h.f16_lanes(b.shuffle_vector(dm16, dm16, mask(range(1, 16, 2))))
    return [h.fma(b.fmul(d, h.splat(dx, 8)), tot_i, acc),
            h.fma(b.fmul(dmin, h.splat(b.fneg(dx), 8)), tot_m, accm)]


@intrinsic
def rows4_q4_k(typingctx, w, r, xq, xd, xs, step):
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
    v64, v32i16, v16i32 = vec(I8, 64), vec(I16, 32), vec(I32, 16)
    wo = b.add(b.mul(bi, c64(X8_BLOCK)), c64(64 * half))
    sm, dm = _q4_k_decode_heads4(h, h.load(gbase, wo, v16i32))
    xo = b.mul(bi, c64(256))
    isum = ir.Constant(v16i32, [0] * 16)
    for c in range(4):
        s = [None, None]
        for piece in range(2):      # qs bytes 32c + 16 piece ..: piece t = 2c + piece
            q = h.load(gbase, b.add(wo, c64(X8_ROWS * 16 + 128 * (2 * c + piece))), v64)
            for hi in range(2):     # sub-block 2c + hi: elements 16 piece .. of it
                nib = b.and_(q, const_vec(I8, 64, 15)) if hi == 0 else b.lshr(q, const_vec(I8, 64, 4))
                x16 = h.load(xq, b.add(xo, c64(32 * (2 * c + hi) + 16 * piece)), vec(I8, 16))
                p = h.x86("llvm.x86.avx512.pmaddubs.w.512", v32i16,
                           [nib, b.shuffle_vector(x16, x16, mask(list(range(16)) * 4))])
                s[hi] = p if s[hi] is None else b.add(s[hi], p)
        for hi in range(2):
            sc = h.x86("llvm.x86.avx512.pshuf.b.512", v64, [sm, const_vec(I8, 64, [2 * c + hi, -128] * 32)])
            isum = b.add(isum, h.x86("llvm.x86.avx512.pmaddw.d.512", v16i32, [s[hi], b.bitcast(sc, v32i16)]))
    return _q4_k_rows4_finish_512(h, sm, dm, _lane_sums4(h, isum), xd, xs, bi, acc, accm)


# AVX-512 hosts prefetch every line of the block one block ahead: a thread reads one stream,
# which the hardware prefetchers alone kept at 19-20 GB/s from memory (Xeon, 14336 x 4096,
# 2 threads; 21-23.5 with it; Llama-3.2-1B-shaped decode 43-46 -> 39-42 ms a token)
X8_PREFETCH = X8_BLOCK


@intrinsic
def rows8_q4_k_x8(typingctx, w, g, xq, xd, xs):
    """Rows 8g .. 8g + 7 of a Q4_K_X8 matrix as a tuple, each as _q4_k_rows4_lanes computes
    it (llama.cpp's repacked-gemv order): the same bits as the plain layout's kernel."""
    sig = types.UniTuple(types.float32, X8_ROWS)(w, g, xq, xd, xs)

    def codegen(context, builder, sig, args):
        b = builder
        (wrows, xq, xd, xs), nb = array_ptrs(context, b, sig, [args[0], b.mul(args[1], c64(X8_ROWS))] + list(args[2:]))
        gbase = wrows[0]
        h = IRHelpers(b, target_features(context))
        if h.avx512bw and h.f16c:
            zero = ir.Constant(vec(F32T, 4), [0.0] * 4)

            def block(bi, accs):
                prefetch_lines(h, [gbase], bi, X8_BLOCK, X8_PREFETCH)
                return (_q4_k_x8_block_512(h, gbase, xq, xd, xs, bi, *accs[:2], 0)
                        + _q4_k_x8_block_512(h, gbase, xq, xd, xs, bi, *accs[2:], 1))
        elif h.avx2:
            zero = ir.Constant(vec(F32T, 8), [0.0] * 8)
            acc, accm = counted_loop(b, nb, 1, [zero, zero],
                                     lambda bi, accs: _q4_k_x8_block_256(h, gbase, xq, xd, xs, bi, *accs), "q4kx8")
            tot = b.fadd(acc, accm)     # rows 0 2 4 6 | 1 3 5 7
            return context.make_tuple(b, sig.return_type, [b.extract_element(tot, ir.Constant(I32, k // 2 + 4 * (k % 2)))
                                                           for k in range(X8_ROWS)])
        else:
            zero = ir.Constant(vec(F32T, 8), [0.0] * 8)
            rows = [b.gep(gbase, [c64(16 * k)]) for k in range(X8_ROWS)]

            def block(bi, accs):
                return (_q4_k_rows4_block(h, rows[:4], xq, xd, xs, bi, *accs[:2], x8=True)
                        + _q4_k_rows4_block(h, rows[4:], xq, xd, xs, bi, *accs[2:], x8=True))
        fin = counted_loop(b, nb, 1, [zero] * 4, block, "q4kx8")
        vals = []
        for half in range(2):
            tot = b.fadd(fin[2 * half], fin[2 * half + 1])
            vals += [b.extract_element(tot, ir.Constant(I32, k)) for k in range(4)]
        return context.make_tuple(b, sig.return_type, vals)
    return sig, codegen

deq_row_q4_k_x8 = make_deq_intrinsic(256, make_deq_q45_k(False, x8=True), x8=True)


# ----------------------------------------------------------------------------- AVX2: two rows a vector
# A vector holds 16 bytes of each of two rows (row a in the low 128-bit half, row b in the
# high one), so the two 16-byte pieces of a sub-block add in i16 before one vpmaddwd (a
# lane: <= 2 * 2*15*128), one vpshufb makes both rows' scales, one decode serves both
# heads, and the rows' partial sums end one row a lane after two rounds of pair adds.
# Against one row a vector (two vpmaddwd and two vpshufb per 32 bytes of qs, a decode and
# a lane reduction per row): 268 instead of 332 instructions per block of 4 rows, 15.8
# instead of 19.2 cycles a row (llvm-mca, znver3); measured on 4096 x 14336, 2 threads,
# old and new alternating in one process: 24.2 -> 31.6 GB/s L2-resident, 23-25 -> 26-27
# GB/s from memory. The integers I and M are exact, so the order of their sums changes
# no bit; the float ops per row are _q4_k_rows4_lanes'.

def _hadd_i32(b, x, y):
    """vphaddd's lanes: per 128-bit half [x0+x1, x2+x3, y0+y1, y2+y3] (exact)."""
    return b.add(b.shuffle_vector(x, y, mask([0, 2, 8, 10, 4, 6, 12, 14])),
                 b.shuffle_vector(x, y, mask([1, 3, 9, 11, 5, 7, 13, 15])))


def _bcast16(h, base, off):
    """16 bytes at base + off in both 128-bit halves of a <32 x i8> (vbroadcasti128)."""
    x = h.load(base, off, vec(I8, 16))
    return h.b.shuffle_vector(x, x, mask(list(range(16)) * 2))


def _q4_k_pair_sums(h, qload, sms, xq, xo, bs16):
    """Per row pair m: (<8 x i32> integer-dot partials, <8 x i32> min-dot partials), row a's
    in lanes 0-3, row b's in 4-7. qload(m, t): the pair's qs piece t (bytes 16t..16t+16 of
    each row) as <32 x i8>; sms: q4k_scales_heads's bytes; bs16: the 8 per-32 activation
    sums as i16 in both halves."""
    b = h.b
    isums = [None] * len(sms)
    for c in range(4):
        # piece 2c + p holds elements 16p.. of sub-blocks 2c (low nibbles) and 2c + 1 (high)
        xv = [[_bcast16(h, xq, b.add(xo, c64(32 * (2 * c + hi) + 16 * p))) for hi in range(2)] for p in range(2)]
        for m in range(len(sms)):
            s = [None, None]
            for p in range(2):
                q = qload(m, 2 * c + p)
                for hi in range(2):
                    prod = h.maddubs(k_nibbles(h, q, hi), xv[p][hi])        # pairs <= 2*15*128
                    s[hi] = prod if s[hi] is None else b.add(s[hi], prod)
            for hi in range(2):
                t = h.madd_i16(s[hi], h.bcast_u8_as_i16(sms[m], 2 * c + hi))
                isums[m] = t if isums[m] is None else b.add(isums[m], t)
    mins = const_vec(I8, 32, [v for j in range(8, 16) for v in (j, -128)] * 2)
    msums = [h.madd_i16(b.bitcast(h.x86("llvm.x86.avx2.pshuf.b", vec(I8, 32), [sm, mins]), vec(I16, 16)), bs16)
             for sm in sms]
    return isums, msums


def _bsums16(h, xs, bi):
    """The block's 8 per-32 activation sums as i16 (|s| <= 32*128), in both halves."""
    b = h.b
    s = b.trunc(h.pairs(h.load(xs, b.mul(bi, c64(64)), vec(I32, 16))), vec(I16, 8))
    return b.shuffle_vector(s, s, mask(list(range(8)) * 2))


def _q4_k_rows4_block_256(h, wrows, xq, xd, xs, bi, acc):
    """_q4_k_rows4_block on AVX2, rows paired (0, 1) and (2, 3): a pair's 16-byte pieces
    joined in one vector (vinserti128 from memory). acc: <8 x float>, lanes [acc of rows 0
    2, accm of rows 0 2 | acc of rows 1 3, accm of rows 1 3]: one fma for both sums, each
    lane's ops those of the separate acc and accm."""
    b = h.b
    wo = b.mul(bi, c64(144))
    pairs = [(wrows[0], wrows[1]), (wrows[2], wrows[3])]

    def join(m, off, n, ty):
        lo, hi = (h.load(w, b.add(wo, c64(off)), vec(ty, n)) for w in pairs[m])
        return b.shuffle_vector(lo, hi, mask(range(2 * n)))
    heads = [join(m, 0, 4, I32) for m in range(2)]
    sms = [q4k_scales_heads(h, v) for v in heads]
    isums, msums = _q4_k_pair_sums(h, lambda m, t: join(m, 16 + 16 * t, 16, I8), sms, xq, b.mul(bi, c64(256)),
                                   _bsums16(h, xs, bi))
    # [I0 I2 M0 M2 | I1 I3 M1 M3]
    im = _hadd_i32(b, _hadd_i32(b, isums[0], isums[1]), _hadd_i32(b, msums[0], msums[1]))
    dm16 = b.bitcast(b.shuffle_vector(heads[0], heads[1], mask([0, 8, 4, 12])), vec(I16, 8))  # rows 0 2 1 3
    dd = h.f16_lanes(b.shuffle_vector(dm16, dm16, mask([0, 2, 1, 3, 4, 6, 5, 7])))   # [d0 d2 dmin0 dmin2 | ..]
    dx = h.load(xd, b.mul(bi, c64(4)), F32T)
    dx8 = h.splat(dx, 8)
    dxs = b.shuffle_vector(dx8, b.fneg(dx8), mask([0, 1, 10, 11, 4, 5, 14, 15]))
    return h.fma(b.fmul(dd, dxs), b.sitofp(im, vec(F32T, 8)), acc)


def _q4_k_x8_block_256(h, gbase, xq, xd, xs, bi, acc, accm):
    """One block of a Q4_K_X8 group on AVX2: a 32-byte load is one piece of two adjacent
    rows, the heads load as four pairs. acc, accm: <8 x float> of rows [0 2 4 6 | 1 3 5 7].
    (13.2 cycles a row against the plain layout's 15.8, but one memory stream a thread:
    repack.py keeps AVX2 hosts on the plain layout.)"""
    b = h.b
    wo = b.mul(bi, c64(X8_BLOCK))
    heads = [h.load(gbase, b.add(wo, c64(32 * m)), vec(I32, 8)) for m in range(4)]
    sms = [q4k_scales_heads(h, v) for v in heads]
    isums, msums = _q4_k_pair_sums(
        h, lambda m, t: h.load(gbase, b.add(wo, c64(X8_ROWS * 16 + 128 * t + 32 * m)), vec(I8, 32)),
        sms, xq, b.mul(bi, c64(256)), _bsums16(h, xs, bi))
    tot_i = _hadd_i32(b, _hadd_i32(b, isums[0], isums[1]), _hadd_i32(b, isums[2], isums[3]))
    tot_m = _hadd_i32(b, _hadd_i32(b, msums[0], msums[1]), _hadd_i32(b, msums[2], msums[3]))
    unpack = mask([0, 8, 1, 9, 4, 12, 5, 13])
    dm = b.shuffle_vector(b.shuffle_vector(heads[0], heads[1], unpack), b.shuffle_vector(heads[2], heads[3], unpack),
                          mask([0, 1, 8, 9, 4, 5, 12, 13]))                    # rows 0 2 4 6 | 1 3 5 7
    dm16 = b.bitcast(dm, vec(I16, 16))
    d = h.f16_lanes(b.shuffle_vector(dm16, dm16, mask(range(0, 16, 2))))
    dmin = h.f16_lanes(b.shuffle_vector(dm16, dm16, mask(range(1, 16, 2))))
    dx = h.load(xd, b.mul(bi, c64(4)), F32T)
    return [h.fma(b.fmul(d, h.splat(dx, 8)), b.sitofp(tot_i, vec(F32T, 8)), acc),
            h.fma(b.fmul(dmin, h.splat(b.fneg(dx), 8)), b.sitofp(tot_m, vec(F32T, 8)), accm)]
