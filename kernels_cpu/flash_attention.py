"""Flash attention over a quantized (or mixed F16 / quantized) K/V cache, compiled: llama.cpp's
CPU `flash_attn_ext` one-chunk path in its exact order.

kernels_cpu/flash_attention_ref.py is the readable numpy form of the same math (and says which
rounding comes from where); tests/test_kv_quant.py requires the two to agree bit for bit and the
reference to agree with the oracle's own ggml op. The F16/F16 cache never comes here: it keeps
the non-flash path of kv_attention.py, as llama.cpp without flash attention.

One job per (query row, block of K/V heads), decode and prefill alike (kv_block: as many
heads a job as still give every thread its share). Each job walks the keys once, CHUNK keys
at a time, reading K and V rows straight from their ggml blocks, and prefetches the next
chunk's rows of its heads while it works on this one (a key's rows for consecutive K/V
heads are contiguous: a block of heads reads whole cache lines). For each K/V head it runs
the heads that share it over the chunk in turn (the chunk's rows stay in L1). Per head,
the passes keep every float op of ggml's one-pass online softmax in its order: (1) the
chunk's scores (independent dots: q8_0 / q4_0 / q5_0 K through dot_q32's IR row dots, four
keys a call), (2) the running maximum M, the weights ms / vs (glibc's expf, inlined:
expf_glibc.py) and the sum S, which depend on the scores alone; then (3) the V rows,
acc = fma(v, vs, acc) key by key with acc rescaled by ms before a key that raised M, for
the whole group of heads at once (flash_attention_ir.v_keys_heads: each V block is
dequantized once for up to four heads, acc in registers across a run of keys; a run ends
where any of the heads raises its maximum). Each (K, V) type pair compiles its own kernel
(no type dispatch in the key loop). Type codes are the K/V type names' indices in TYPES. Q
goes to q8_0 through kv_quant_jit (the same bytes as kv_quant).

Skipping keys whose weight is 0 (as the F16 non-flash kernel skips them) does not pay
here: vs is a float32 and is 0 only below exp(-104), where the F16 path rounds every
weight under 2^-24 to 0; on the 1B-shaped file at 4096 keys no key qualified.

Measured (benchmarks/kv_decode_depth.py has the end-to-end numbers): one 1B-shaped layer
at 4096 keys (32 heads, 8 K/V heads, head 64), one thread on a Zen 3 core, min of 300:
q8_0/q8_0 10 ms for the first scalar kernel -> ~2.5 ms, against 2.2 ms for the F16 cache's
non-flash kernel (kv_attention.py). Two threads, one layer of random K/V in cache: 1.98 ->
1.46 ms with the V blocks shared by the group. The sixteen layers of a decode step at 4096
keys on the engine's own K/V (two threads, medians of 15 alternating rounds): 41.6 ms with
one K/V head a job, 34.7 ms with blocks of four.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import kv_quant, kv_quant_jit
from .dot_q32 import row_q4_0, row_q5_0, row_q8_0, rows_q4_0, rows_q5_0, rows_q8_0
from .flash_attention_ir import V_KEYS, V_KEYS_HEADS, prefetch_rows
from .expf_glibc import expf
from .f16 import f16_round
from .ggml_math import fma_f32, hsum8
from .kv_attention import reduce_slots
from .kv_attention_ir import SLOTS
from .quant_kernels import KVALUES_IQ4NL, f16
from .threads import apply_threads, get_threads

_JIT = dict(cache=True, nogil=True)  # no fastmath: the order of every float op matters here

TYPES = ("f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL = range(7)
_BLOCK = np.array([0, 34, 18, 20, 22, 24, 18], np.int64)
_IQ4_NL_VALUES = np.asarray(KVALUES_IQ4NL, np.int32)
CHUNK = 128   # keys a job scores before it weighs them and adds their V rows


@njit(inline="always", **_JIT)
def _code(row, o, t, e):
    """Element e (0..31) of the block at byte o of a K/V row: the signed value for q8_0 /
    q4_0 / q5_0 / iq4_nl, the unsigned code for q4_1 / q5_1."""
    if t == Q8_0:
        return np.int32(np.int8(row[o + 2 + e]))
    if t == IQ4_NL:
        byte = np.int32(row[o + 2 + (e & 15)])
        return _IQ4_NL_VALUES[(byte & 15) if e < 16 else (byte >> 4)]
    qs = o + (4 if t == Q4_1 else (6 if t == Q5_0 else (8 if t == Q5_1 else 2)))
    byte = np.int32(row[qs + (e & 15)])
    c = (byte & 15) if e < 16 else (byte >> 4)
    if t == Q5_0 or t == Q5_1:
        qo = o + (2 if t == Q5_0 else 4)
        c |= ((np.int32(row[qo + (e >> 3)]) >> (e & 7)) & 1) << 4
    if t == Q4_0:
        c -= 8
    elif t == Q5_0:
        c -= 16
    return c


@njit(inline="always", **_JIT)
def _dot_quant(krow, qrow, tk, nb, acc):
    """vec_dot of a quantized K row with Q in q8_0 / q8_1 (qrow bytes): 8 lanes of 4 products
    per block, fma(dK*dQ, lanes, acc), hsum_float_8, then + summs for q4_1 / q5_1."""
    bk = _BLOCK[tk]
    has_min = tk == Q4_1 or tk == Q5_1
    bq = 36 if has_min else 34
    qv = 4 if has_min else 2
    for l in range(8):
        acc[l] = np.float32(0.0)
    summs = np.float32(0.0)
    for b in range(nb):
        ko = b * bk
        qo = b * bq
        d = np.float32(f16(krow[ko], krow[ko + 1]) * f16(qrow[qo], qrow[qo + 1]))
        if has_min:
            summs = fma_f32(f16(krow[ko + 2], krow[ko + 3]), f16(qrow[qo + 2], qrow[qo + 3]), summs)
        for l in range(8):
            s = np.int32(0)
            for i in range(4):
                e = 4 * l + i
                s += _code(krow, ko, tk, e) * np.int32(np.int8(qrow[qo + qv + e]))
            acc[l] = fma_f32(d, np.float32(s), acc[l])
    r = hsum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7])
    if has_min:
        r = np.float32(r + summs)
    return r


@njit(inline="always", **_JIT)
def _dot_iq4_nl(krow, qx, qd, nb, acc):
    """ggml_vec_dot_iq4_nl_q8_0 (Q as q8_0 values qx and float scales qd): even blocks into
    acc[0:8], odd ones into acc[8:16], hsum_float_8 of the lane sums, then an odd last
    block as sum + d * (its integer dot), not fused."""
    for l in range(16):
        acc[l] = np.float32(0.0)
    paired = nb - nb % 2
    for b in range(paired):
        o = 18 * b
        at = 8 * (b & 1)
        d = np.float32(f16(krow[o], krow[o + 1]) * qd[b])
        for l in range(8):
            s = np.int32(0)
            for i in range(4):
                s += _code(krow, o, IQ4_NL, 4 * l + i) * np.int32(qx[32 * b + 4 * l + i])
            acc[at + l] = fma_f32(d, np.float32(s), acc[at + l])
    for l in range(8):
        acc[l] = np.float32(acc[l] + acc[8 + l])
    r = hsum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7])
    if paired < nb:
        b = nb - 1
        o = 18 * b
        s = np.int32(0)
        for e in range(32):
            s += _code(krow, o, IQ4_NL, e) * np.int32(qx[32 * b + e])
        r = np.float32(r + np.float32(np.float32(f16(krow[o], krow[o + 1]) * qd[b]) * np.float32(s)))
    return r


@njit(inline="always", **_JIT)
def _dot_f16(krow, q16, hd, slots):
    """ggml_vec_dot_f16 (K row as F16 bytes, Q rounded to F16): SLOTS float32 slots in order
    (the products are exact), the fixed reduction of this CPU's build, leftovers in double."""
    n_vec = hd - hd % SLOTS
    for i in range(SLOTS):
        slots[i] = np.float32(0.0)
    for c in range(0, n_vec, SLOTS):
        for i in range(SLOTS):
            e = c + i
            slots[i] = np.float32(slots[i] + f16(krow[2 * e], krow[2 * e + 1]) * q16[e])
    dot = np.float64(reduce_slots(slots))
    for e in range(n_vec, hd):
        dot += np.float64(f16(krow[2 * e], krow[2 * e + 1])) * np.float64(q16[e])
    return np.float32(dot)


@njit(inline="always", **_JIT)
def _dequant_v(vrow, tv, out):
    """ggml-base to_float of a V row into out (float32): q*d, or q*d + m rounded twice."""
    n = out.shape[0]
    if tv == F16:
        for e in range(n):
            out[e] = f16(vrow[2 * e], vrow[2 * e + 1])
        return
    bv = _BLOCK[tv]
    for b in range(n // 32):
        o = b * bv
        d = f16(vrow[o], vrow[o + 1])
        if tv == Q4_1 or tv == Q5_1:
            m = f16(vrow[o + 2], vrow[o + 3])
            for e in range(32):
                out[b * 32 + e] = np.float32(np.float32(np.float32(_code(vrow, o, tv, e)) * d) + m)
        else:
            for e in range(32):
                out[b * 32 + e] = np.float32(np.float32(_code(vrow, o, tv, e)) * d)


@njit(inline="always", **_JIT)
def _all_seen4(kpos, j, qp, window):
    """Whether keys j..j+3 are all visible to a query at qp."""
    for u in range(4):
        kp = kpos[j + u]
        if kp > qp or (window > 0 and qp - kp >= window):
            return False
    return True


@njit(inline="always", **_JIT)
def _seen_range(kpos, qp, window):
    """The slots lo..hi from the first to the last key a query at qp sees (lo = hi: none).
    A sliding-window layer's query sees a short run of a long cache: only that run is
    walked (the keys outside it are masked, so the bits do not change)."""
    lo, hi = kpos.shape[0], 0
    for j in range(kpos.shape[0]):
        kp = kpos[j]
        if kp <= qp and (window <= 0 or qp - kp < window):
            lo = min(lo, j)
            hi = j + 1
    return lo, hi


@njit(inline="always", **_JIT)
def _keeps_max(msv, i):
    """Whether key i of the chunk raises no head's maximum."""
    for hh in range(msv.shape[0]):
        if msv[hh, i] != np.float32(1.0):
            return False
    return True


def _make_rows(tk: int, tv: int):
    """The kernel for one (K type, V type) pair: TK / TV are closure constants, so each pair
    compiles its own key loop with no type dispatch in it (Numba's cache keys a closure by
    their values). q8_0 / q4_0 / q5_0 K dot through dot_q32's IR row dots and every quantized
    V through flash_attention_ir's block updates; F16 and q4_1 / q5_1 K keep the scalar
    loops above (the same order either way)."""
    TK, TV = tk, tv
    v_name = TYPES[tv] if tv != F16 else "q8_0"   # (F16 V never calls them)
    VK1, VK2, VK4 = V_KEYS[v_name], V_KEYS_HEADS[(v_name, 2)], V_KEYS_HEADS[(v_name, 4)]

    @njit(inline="always", **_JIT)
    def _v_runs(vb2, rows, n, msv, vsv, accs):
        """Quantized V for a group of heads over the chunk's keys rows[:n], in runs of keys
        that keep every head's maximum (each head rescaled before a key that raises its
        own): each V block is dequantized once for up to four heads, and each head's
        acc = fma(v, vs, acc) sequence is the one a head alone would run."""
        group, hdv = accs.shape
        i = 0
        while i < n:
            for hh in range(group):
                ms = msv[hh, i]
                if ms != np.float32(1.0):
                    for d in range(hdv):
                        accs[hh, d] = np.float32(accs[hh, d] * ms)
            e = i + 1
            while e < n and _keeps_max(msv, e):
                e += 1
            h0 = 0
            while h0 < group:
                if group - h0 >= 4:
                    VK4(vb2, rows, i, e, vsv, accs, h0)
                    h0 += 4
                elif group - h0 >= 2:
                    VK2(vb2, rows, i, e, vsv, accs, h0)
                    h0 += 2
                else:
                    VK1(vb2, rows, i, e, vsv[h0], accs[h0])
                    h0 += 1
            i = e

    @njit(parallel=True, **_JIT)
    def flash_rows(qq, q16, qx, qd, qs, kb, vb, hd, kpos, qpos, window, scale, softcap, sinks, has_sinks,
                   kv_block, out):
        """out[t, h] for every query row t and head h: one job per query row and block of
        kv_block K/V heads."""
        n_tok, n_head, hdv = out.shape
        n_keys, n_kv = kb.shape[0], kb.shape[1]
        kb2 = kb.reshape(n_keys * n_kv, kb.shape[2])   # row j * n_kv + g: key j of K/V head g
        vb2 = vb.reshape(n_keys * n_kv, vb.shape[2])
        group = n_head // n_kv
        n_blocks = n_kv // kv_block
        nb = hd // 32
        for job in prange(n_tok * n_blocks):
            t = job // n_blocks
            g0 = job % n_blocks * kv_block
            qp = qpos[t]
            lanes = np.empty(SLOTS, np.float32)   # _dot_f16's slots (the quantized dots use 8)
            vbuf = np.empty(hdv, np.float32)
            accs_all = np.zeros((kv_block, group, hdv), np.float32)   # F16 values when V is F16
            Ms_all = np.full((kv_block, group), -np.inf, np.float32)
            Ss_all = np.zeros((kv_block, group), np.float32)
            rows = np.empty(CHUNK, np.int64)
            sc = np.empty(CHUNK, np.float32)
            msv = np.empty((group, CHUNK), np.float32)   # each head's weights for the chunk's keys
            vsv = np.empty((group, CHUNK), np.float32)
            arg = np.empty(CHUNK, np.float32)
            ex = np.empty(CHUNK, np.float32)
            raised = np.empty(CHUNK, np.bool_)
            lo, hi = _seen_range(kpos, qp, window)
            for j0 in range(lo, hi, CHUNK):
                ahead = min(CHUNK, hi - j0 - CHUNK)
                if ahead > 0:   # the next chunk's rows of the block's heads, while this one is worked on
                    prefetch_rows(kb2, (j0 + CHUNK) * n_kv + g0, n_kv, ahead, kv_block)
                    prefetch_rows(vb2, (j0 + CHUNK) * n_kv + g0, n_kv, ahead, kv_block)
                for gi in range(kv_block):
                    g = g0 + gi
                    accs, Ms, Ss = accs_all[gi], Ms_all[gi], Ss_all[gi]
                    # the group's heads in turn over the same chunk of K/V rows (in L1 after
                    # the first): each head's own order, as one job per head would keep it
                    for hh in range(group):
                        h = g * group + hh
                        acc = accs[hh]
                        qrow, q16row, qxr, qdr, qsr = qq[t, h], q16[t, h], qx[t, h], qd[t, h], qs[t, h]
                        M = Ms[hh]
                        S = Ss[hh]
                        # 1. the chunk's unmasked keys and their scores (independent dots)
                        n = 0
                        j1 = min(j0 + CHUNK, hi)
                        j = j0
                        while (TK == Q8_0 or TK == Q4_0 or TK == Q5_0) and j + 4 <= j1 and _all_seen4(kpos, j, qp, window):
                            # four keys a call, sharing Q's loads (each key its own accumulator)
                            r = j * n_kv + g
                            if TK == Q8_0:
                                s4 = rows_q8_0(kb2, r, qxr, qdr, qsr, n_kv)
                            elif TK == Q4_0:
                                s4 = rows_q4_0(kb2, r, qxr, qdr, qsr, n_kv)
                            else:
                                s4 = rows_q5_0(kb2, r, qxr, qdr, qsr, n_kv)
                            for u in range(4):
                                s = np.float32(s4[u] * scale)
                                if softcap != 0.0:
                                    s = np.float32(softcap * np.float32(math.tanh(s)))
                                rows[n] = r + u * n_kv
                                sc[n] = s
                                n += 1
                            j += 4
                        for j in range(j, j1):
                            kp = kpos[j]
                            if kp > qp or (window > 0 and qp - kp >= window):
                                continue
                            r = j * n_kv + g
                            if TK == Q8_0:
                                s = row_q8_0(kb2, r, qxr, qdr, qsr)
                            elif TK == Q4_0:
                                s = row_q4_0(kb2, r, qxr, qdr, qsr)
                            elif TK == Q5_0:
                                s = row_q5_0(kb2, r, qxr, qdr, qsr)
                            elif TK == F16:
                                s = _dot_f16(kb2[r], q16row, hd, lanes)
                            elif TK == IQ4_NL:
                                s = _dot_iq4_nl(kb2[r], qxr, qdr, nb, lanes)
                            else:
                                s = _dot_quant(kb2[r], qrow, TK, nb, lanes)
                            s = np.float32(s * scale)
                            if softcap != 0.0:
                                s = np.float32(softcap * np.float32(math.tanh(s)))   # libm tanhf
                            rows[n] = r
                            sc[n] = s
                            n += 1
                        # 2. the online softmax's weights: they depend on the scores alone. The
                        # running maximum decides each key's exp argument (M - s where the key
                        # raises it, else s - M); the exps are then independent (glibc's expf
                        # inlined, its bits), and S sums in key order.
                        for i in range(n):
                            s = sc[i]
                            if s > M:
                                arg[i] = np.float32(M - s)
                                raised[i] = True
                                M = s
                            else:
                                arg[i] = np.float32(s - M)
                                raised[i] = False
                        for i in range(n):
                            ex[i] = expf(arg[i])
                        for i in range(n):
                            ms = ex[i] if raised[i] else np.float32(1.0)
                            vs = np.float32(1.0) if raised[i] else ex[i]
                            msv[hh, i] = ms
                            vsv[hh, i] = vs
                            # fma(S, 1, vs) is the float32 sum S + vs (one rounding either way): the
                            # short chain for the keys that keep the maximum
                            S = np.float32(S + vs) if ms == np.float32(1.0) else fma_f32(S, ms, vs)
                        # 3. V, key by key in order: acc = acc * ms where a key raised the maximum,
                        # then fma(v, vs, acc). F16 V here; quantized V below, for the group at once.
                        if TV == F16:
                            for i in range(n):
                                ms = msv[hh, i]
                                if ms != np.float32(1.0):
                                    for d in range(hdv):
                                        acc[d] = f16_round(np.float32(acc[d] * ms))
                                _dequant_v(vb2[rows[i]], TV, vbuf)
                                vs = vsv[hh, i]
                                for d in range(hdv):
                                    acc[d] = f16_round(fma_f32(vbuf[d], vs, acc[d]))
                        Ms[hh] = M
                        Ss[hh] = S
                    if TV != F16:
                        # 3. quantized V for the group at once (_v_runs)
                        _v_runs(vb2, rows, n, msv, vsv, accs)
            for gi in range(kv_block):
                for hh in range(group):
                    h = (g0 + gi) * group + hh
                    acc = accs_all[gi, hh]
                    M = Ms_all[gi, hh]
                    S = Ss_all[gi, hh]
                    if has_sinks:
                        sk = sinks[h]
                        ms = np.float32(1.0)
                        vs = np.float32(1.0)
                        if sk > M:
                            ms = np.float32(math.exp(np.float32(M - sk)))
                            M = sk
                            for d in range(hdv):
                                acc[d] = np.float32(acc[d] * ms)
                        else:
                            vs = np.float32(math.exp(np.float32(sk - M)))
                        S = np.float32(np.float32(S * ms) + vs)   # not fused here (the oracle's build)
                    inv = np.float32(0.0) if S == 0.0 else np.float32(np.float32(1.0) / S)
                    for d in range(hdv):
                        out[t, h, d] = np.float32(acc[d] * inv)
    return flash_rows


_KERNELS: dict = {}


def rows_kernel(tk: int, tv: int):
    """The compiled kernel for this (K type, V type) pair (made on first use)."""
    kernel = _KERNELS.get((tk, tv))
    if kernel is None:
        kernel = _KERNELS[(tk, tv)] = _make_rows(tk, tv)
    return kernel


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """A layer view's rows as bytes (S, n_kv, row bytes): F16 values or raw blocks."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape[0], a.shape[1], -1)


def _q_fields(type_k: str, q: np.ndarray, rot: int):
    """Q in q8_0 as dot_q32's row dots and _dot_iq4_nl read it (q8_0 / q4_0 / q5_0 / iq4_nl K),
    after fwht(q, rot) where rot > 0 (one compiled call): int8 values (n, n_head, hd), the
    fp16 scales as float32 (n, n_head, nb), and (unused by these types) int32 sums;
    placeholders for the other K types."""
    n, n_head = q.shape[:2]
    if type_k not in ("q8_0", "q4_0", "q5_0", "iq4_nl"):
        return (np.zeros((n, n_head, 1), np.int8), np.zeros((n, n_head, 1), np.float32),
                np.zeros((n, n_head, 1), np.int32))
    qx, qd = kv_quant_jit.quantize_q8_0_split(q, rot)
    return qx, qd, np.zeros(qd.shape, np.int32)


def kv_block(n_tok: int, n_kv: int, threads: int) -> int:
    """K/V heads per job: the most that still share the jobs evenly between the threads
    (a multiple of them, or four rounds and more). A job walks its heads' rows of each chunk
    together; a key's rows for consecutive heads are contiguous, so whole cache lines are
    read once (one head's 68-byte q8_0 row spans two lines, which the neighbouring heads'
    jobs fetched again)."""
    for block in range(n_kv, 1, -1):
        jobs = n_tok * (n_kv // block)
        if n_kv % block == 0 and jobs >= threads and (jobs % threads == 0 or jobs >= 4 * threads):
            return block
    return 1


def flash_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, kpos: np.ndarray, qpos: np.ndarray,
                    type_k: str, type_v: str, kq_scale: float, window: int = 0,
                    sinks: np.ndarray | None = None, softcap: float = 0.0, rotate_q: int = 0) -> np.ndarray:
    """As flash_attention_ref.flash_attention (same arguments, same bits), compiled, of
    fwht(q, rotate_q) where rotate_q > 0 (the cache's K rotation; with Q's quantization)."""
    apply_threads()
    q = np.ascontiguousarray(q, np.float32)
    n, n_head, hd = q.shape
    tk, tv = TYPES.index(type_k), TYPES.index(type_v)
    if rotate_q and tk not in (Q8_0, Q4_0, Q5_0, IQ4_NL):   # (those rotate in _q_fields)
        q = kv_quant_jit.fwht(q, rotate_q)
    hdv = v.shape[2] if type_v == "f16" else v.shape[2] // kv_quant.BLOCK_BYTES[type_v] * 32
    q16 = q.astype(np.float16).astype(np.float32) if tk == F16 else np.zeros((n, n_head, 1), np.float32)
    if tk in (Q4_1, Q5_1):   # the scalar dot reads Q's q8_1 blocks
        qq = np.ascontiguousarray(kv_quant.quantize(kv_quant.VEC_DOT_TYPE[type_k], q))
    else:
        qq = np.zeros((n, n_head, 1), np.uint8)
    qx, qd, qs = _q_fields(type_k, q, rotate_q)
    scale = np.float32(kq_scale)
    if softcap:
        scale = np.float32(scale / np.float32(softcap))
    out = np.empty((n, n_head, hdv), np.float32)
    sk = np.zeros(n_head, np.float32) if sinks is None else np.ascontiguousarray(sinks, np.float32)
    kb = _as_bytes(k)
    rows_kernel(tk, tv)(qq, q16, qx, qd, qs, kb, _as_bytes(v), hd,
                        np.ascontiguousarray(kpos, np.int64), np.ascontiguousarray(qpos, np.int64), int(window),
                        scale, np.float32(softcap), sk, sinks is not None, kv_block(n, kb.shape[1], get_threads()), out)
    return out
