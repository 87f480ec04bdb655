"""Short batches two tokens a 512-bit vector, each (row, token) with decode's bits.

Speculative verification and short chat turns send a few tokens through every matrix with
the row kernels' float order (matvec.decode_order): each (row, token) sum is what decoding
that token alone gives, llama.cpp's order for the 32-element types: per block, eight i32
lanes of four products each, converted and fma'd with the block's scale product into
eight float lanes, the lanes added at the end. The row kernels (dot_q32.py) do that one
token a 256-bit vector: for Gemma 3's 262144 x 640 Q8_0 output matrix, 5 tokens cost
2.6 decoded tokens, the largest share of a verification.

Here a 512-bit vector holds two tokens, one a half, each half the row kernel's eight lanes
for its token: one vpdpbusd covers a block against both, and the conversion, the scale
product and the fma go two tokens an instruction. The lanes of each half see the same
operations in the same order as the row kernel's, so each token keeps its bits. The
weights go in as unsigned codes (Q8_0: value + 128; Q4_0, Q5_0: the file's codes,
value + 8 or + 16; IQ4_NL: table value + 128), and the vpdpbusd starts from -offset *
(the activations summed in fours), which takes the offset back exactly: the i32 lanes are
the row kernel's integers.

`pack` lays the activations out for it once a call: per pair of tokens and block, the two
tokens' 32 bytes, their scales spread over 8 lanes each, and their sums in fours (times
-offset: the vpdpbusd starts of each type). An odd
count pads a token of zeros (its sums are 0 and are not stored).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from .dot_q32 import Q32, code_offset, q32_codes
from .ir_helpers import (F32T, I8, I32, IRHelpers, as_i8, c64, const_vec, counted_loop, emit_for_count, mask,
                         prefetch_row_streams, row_pointer, target_features, vec)
from .quant_kernels import IQ4_NL, Q4_0, Q5_0, Q8_0

PAIR_TYPES = (Q8_0, Q4_0, Q5_0, IQ4_NL)
MAX_PAIRS = 4   # pairs of tokens one row loop serves (its accumulators: one zmm a pair)
BLOCK_BYTES = {Q8_0: 34, **{qt: Q32[qt][0] for qt in (Q4_0, Q5_0, IQ4_NL)}}
OFFSET = {Q8_0: 128, **{qt: code_offset(qt) for qt in (Q4_0, Q5_0, IQ4_NL)}}   # code = value + OFFSET


def host_has_pairs() -> bool:
    """Whether the CPU Numba compiles for has 512-bit vpdpbusd (AVX512-VNNI with BW)."""
    return {"+avx512vnni", "+avx512bw", "+avx512f", "+f16c"} <= target_features(cpu_target.target_context)


def serves(qt: int) -> bool:
    return int(qt) in PAIR_TYPES


@njit(cache=True, nogil=True)
def pack(xq, xd, xq2, dx2, s2):
    """From xq (n_tok, n_cols) int8 and xd (n_tok, n_cols // 32) f32, for pair p = tokens
    2p, 2p + 1 and block b: xq2[p, 64b:64b + 64] the two tokens' 32 bytes, dx2[p, 16b:16b +
    16] their scales 8 times each, s2[p, 16b:16b + 16] their bytes summed in fours."""
    n_tok, n_cols = xq.shape
    nb = n_cols // 32
    for p in range(xq2.shape[0]):
        for half in range(2):
            t = 2 * p + half
            for bi in range(nb):
                q0 = 64 * bi + 32 * half
                l0 = 16 * bi + 8 * half
                if t < n_tok:
                    for j in range(32):
                        xq2[p, q0 + j] = xq[t, 32 * bi + j]
                    for g in range(8):
                        s = 0
                        for j in range(4):
                            s += np.int32(xq[t, 32 * bi + 4 * g + j])
                        s2[p, l0 + g] = s
                        dx2[p, l0 + g] = xd[t, bi]
                else:
                    for j in range(32):
                        xq2[p, q0 + j] = 0
                    for g in range(8):
                        s2[p, l0 + g] = 0
                        dx2[p, l0 + g] = 0.0


def packed(xq: np.ndarray, xd: np.ndarray, qts: list):
    """(xq2, dx2, [the vpdpbusd starts of each type in qts: -OFFSET * s2]) for `pack`,
    (ceil(n_tok / 2), ...) each."""
    n_pairs = (xq.shape[0] + 1) // 2
    nb = xq.shape[1] // 32
    xq2 = np.empty((n_pairs, 64 * nb), np.int8)
    dx2 = np.empty((n_pairs, 16 * nb), np.float32)
    s2 = np.empty((n_pairs, 16 * nb), np.int32)
    pack(xq, xd, xq2, dx2, s2)
    starts = {}
    for qt in qts:
        if OFFSET[qt] not in starts:
            starts[OFFSET[qt]] = s2 * np.int32(-OFFSET[qt])
    return xq2, dx2, [starts[OFFSET[qt]] for qt in qts]


def _codes(h, wrow, wo, qt):
    """A block's 32 unsigned codes (value + OFFSET[qt]) as <32 x i8>."""
    if qt == Q8_0:
        return h.b.xor(h.load(wrow, h.b.add(wo, c64(2)), vec(I8, 32)), const_vec(I8, 32, as_i8(128)))
    return q32_codes(h, wrow, wo, qt)


def _dpbusd512(h, acc, a_u8, x_s8):
    b = h.b
    return h.x86("llvm.x86.avx512.vpdpbusd.512", vec(I32, 16),
                 [acc, b.bitcast(a_u8, vec(I32, 16)), b.bitcast(x_s8, vec(I32, 16))])


def _pair_loop(context, builder, sig, args, qt, n_pairs):
    """Row r of w (args: w, r, xq2, dx2, c2, p0) against pairs p0..p0 + n_pairs - 1: the
    2 * n_pairs sums, token order."""
    w = context.make_array(sig.args[0])(context, builder, args[0])
    stride0 = cgutils.unpack_tuple(builder, w.strides)[0]
    wrow = builder.gep(builder.bitcast(w.data, I8.as_pointer()), [builder.mul(args[1], stride0)])
    arrs = [context.make_array(sig.args[k])(context, builder, args[k]) for k in (2, 3, 4)]
    rows = [row_pointer(builder, a) for a in arrs]
    pairs = [[row(builder.add(args[5], c64(k))) for row in rows] for k in range(n_pairs)]
    nb = builder.sdiv(cgutils.unpack_tuple(builder, arrs[0].shape)[1], c64(64))
    h = IRHelpers(builder, target_features(context))
    b = h.b
    bs = BLOCK_BYTES[qt]

    def blocks(bi, accs):
        # 4 KiB ahead for every type, as the token loops: one row at a time, the hardware
        # prefetcher fell behind (Gemma's Q5_0 gate + up, 2 tokens, Xeon: 0.31 -> 0.19 ms)
        prefetch_row_streams(h, [wrow], bi, bs)
        wo = b.mul(bi, c64(bs))
        codes = _codes(h, wrow, wo, qt)
        both = b.shuffle_vector(codes, codes, mask(list(range(32)) * 2))
        dw = h.splat(h.load_f16(wrow, wo), 16)
        out = []
        for (xq2, dx2, c2), acc in zip(pairs, accs):
            s = _dpbusd512(h, h.load(c2, b.mul(bi, c64(64)), vec(I32, 16)), both,
                           h.load(xq2, b.mul(bi, c64(64)), vec(I8, 64)))
            d = b.fmul(dw, h.load(dx2, b.mul(bi, c64(64)), vec(F32T, 16)))
            out.append(h.fma(d, b.sitofp(s, vec(F32T, 16)), acc))
        return out
    zero = ir.Constant(vec(F32T, 16), [0.0] * 16)
    fin = counted_loop(builder, nb, 1, [zero] * n_pairs, blocks, "pairs")
    return [h.hsum_f32(h.half(acc, k)) for acc in fin for k in (0, 1)]


def make_pair_intrinsic(qt: int):
    """pair_dots(w, r, xq2, dx2, c2, p0, m) -> the 2 * m sums of row r of w (type qt) with
    the tokens of pairs p0..p0 + m - 1 (`pack`'s arrays; 1 <= m <= MAX_PAIRS), then zeros:
    2 * MAX_PAIRS values whatever m. The row loop is unrolled for each m, the one for this
    m run (ir_helpers.emit_for_count)."""
    @intrinsic
    def pair_dots(typingctx, w, r, xq2, dx2, c2, p0, m):
        sig = types.UniTuple(types.float32, 2 * MAX_PAIRS)(w, r, xq2, dx2, c2, p0, m)

        def codegen(context, builder, sig, args):
            slots = [cgutils.alloca_once(builder, F32T) for _ in range(2 * MAX_PAIRS)]

            def run(n_pairs):
                sums = _pair_loop(context, builder, sig, args, qt, n_pairs)
                sums += [ir.Constant(F32T, 0.0)] * (2 * MAX_PAIRS - len(sums))
                for slot, v in zip(slots, sums):
                    builder.store(v, slot)
            emit_for_count(builder, args[6], 1, MAX_PAIRS, run)
            return context.make_tuple(builder, sig.return_type, [builder.load(slot) for slot in slots])
        return sig, codegen
    return pair_dots


# per type, one row loop for 1 to 4 pairs (dispatch._dot_rows_pairs: a row read once for
# up to 8 tokens; 5 tokens as 2 + 1 pairs cost as much as 8)
pairs_q8_0, pairs_q4_0, pairs_q5_0, pairs_iq4_nl = (make_pair_intrinsic(qt) for qt in (Q8_0, Q4_0, Q5_0, IQ4_NL))
