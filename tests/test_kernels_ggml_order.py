"""The decode row dots follow llama.cpp's AVX2 float order exactly (the reason Gemma 3's
greedy tokens match llama.cpp's). Each numpy function below re-derives one ggml kernel's
order from its source: the activation quantization, the 8 integer lanes of each block
(lane L holds bytes 4L..4L+3 of a 32-byte chunk), one float accumulator per lane fed by an
fma per block, the AVX horizontal sum; the kernels must agree bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from quant_blocks import f16_values, fma_f32, hsum8, q4k_scales_mins, random_blocks


def _lanes(q, x):
    """int8 dot of a 32-value chunk split into 8 lanes of 4 bytes: (rows, 8) int64."""
    return (q.astype(np.int64) * x.astype(np.int64)).reshape(q.shape[0], 8, 4).sum(-1)


def _q32_dot(w, x, qtype):
    """ggml_vec_dot_q8_0_q8_0 / q5_0 / q4_0 (AVX2): signed values, one 8-lane accumulator."""
    xq, xd, _ = K.quantize_activations(x, K.quant_info(qtype))
    bs = {T.Q8_0: 34, T.Q5_0: 22, T.Q4_0: 18}[qtype]
    rows = w.reshape(w.shape[0], -1, bs)
    acc = np.zeros((w.shape[0], 8), np.float32)
    for b in range(rows.shape[1]):
        blk = rows[:, b]
        if qtype == T.Q8_0:
            q = blk[:, 2:].view(np.int8).astype(np.int64)
        else:
            qs = blk[:, -16:].astype(np.int64)
            q = np.concatenate([qs & 15, qs >> 4], axis=1)
            if qtype == T.Q5_0:
                qh = blk[:, 2:6].copy().view(np.uint32)[:, 0].astype(np.int64)
                q = q | (((qh[:, None] >> np.arange(32)) & 1) << 4)
                q = q - 16
            else:
                q = q - 8
        d = (f16_values(blk[:, :2]) * xd[b]).astype(np.float32)
        acc = fma_f32(d[:, None], _lanes(q, xq[32 * b: 32 * b + 32]).astype(np.float32), acc)
    return hsum8(acc)


def _q4k_dot(w, x):
    """ggml_vec_dot_q4_K_q8_K, or (rows a multiple of 8) the repacked 8-row gemv."""
    xq, xd, xs = K.quantize_activations(x, K.quant_info(T.Q4_K))
    n, rows8 = w.shape[0], w.shape[0] % 8 == 0
    blocks = w.reshape(n, -1, 144)
    acc, accm = np.zeros((n, 8), np.float32), np.zeros((n, 4), np.float32)
    for b in range(blocks.shape[1]):
        B = blocks[:, b]
        d = (xd[b] * f16_values(B[:, 0:2])).astype(np.float32)
        dmin = (-xd[b] * f16_values(B[:, 2:4])).astype(np.float32)
        scales, mins = q4k_scales_mins(B[:, 4:16])
        mprod = mins * xs[16 * b: 16 * b + 16].reshape(8, 2).sum(1)[None]
        sumi = np.zeros((n, 8), np.int64)
        for j in range(4):
            q4 = B[:, 16 + 32 * j: 48 + 32 * j].astype(np.int64)
            sumi += _lanes(q4 & 15, xq[256 * b + 64 * j: 256 * b + 64 * j + 32]) * scales[:, 2 * j: 2 * j + 1]
            sumi += _lanes(q4 >> 4, xq[256 * b + 64 * j + 32: 256 * b + 64 * j + 64]) * scales[:, 2 * j + 1: 2 * j + 2]
        if rows8:  # one lane per row: whole-block integers, the min terms subtracted at the end
            acc[:, 0] = fma_f32(d, sumi.sum(1).astype(np.float32), acc[:, 0])
            accm[:, 0] = fma_f32(-dmin, mprod.sum(1).astype(np.float32), accm[:, 0])
        else:
            acc = fma_f32(d[:, None], sumi.astype(np.float32), acc)
            accm = fma_f32(dmin[:, None], mprod.reshape(n, 4, 2).sum(-1).astype(np.float32), accm)
    if rows8:
        return acc[:, 0] - accm[:, 0]
    m = accm[:, :2] + accm[:, 2:]
    return hsum8(acc) + (m[:, 0] + m[:, 1])


def _q6k_dot(w, x):
    """ggml_vec_dot_q6_K_q8_K (AVX2)."""
    xq, xd, xs = K.quantize_activations(x, K.quant_info(T.Q6_K))
    n = w.shape[0]
    blocks = w.reshape(n, -1, 210)
    acc = np.zeros((n, 8), np.float32)
    for b in range(blocks.shape[1]):
        B = blocks[:, b]
        d = (xd[b] * f16_values(B[:, 208:210])).astype(np.float32)
        sc = B[:, 192:208].view(np.int8).astype(np.int64)
        sumi = -32 * (sc * xs[16 * b: 16 * b + 16][None]).reshape(n, 8, 2).sum(-1)
        for hh in range(2):
            ql0, ql1 = B[:, 64 * hh: 64 * hh + 32].astype(np.int64), B[:, 64 * hh + 32: 64 * hh + 64].astype(np.int64)
            qh = B[:, 128 + 32 * hh: 160 + 32 * hh].astype(np.int64)
            for gq in range(4):
                low = (ql0 if gq % 2 == 0 else ql1)
                low = low & 15 if gq < 2 else low >> 4
                q = low | (((qh >> (2 * gq)) & 3) << 4)
                g = hh * 8 + gq * 2
                lanes = _lanes(q, xq[256 * b + hh * 128 + gq * 32: 256 * b + hh * 128 + gq * 32 + 32])
                sumi += lanes * np.concatenate([np.repeat(sc[:, g:g + 1], 4, 1), np.repeat(sc[:, g + 1:g + 2], 4, 1)], 1)
        acc = fma_f32(d[:, None], sumi.astype(np.float32), acc)
    return hsum8(acc)


def _mxfp4_dot(w, x):
    """ggml_vec_dot_mxfp4_q8_0 (AVX2): table values, even blocks into one 8-lane accumulator and
    odd ones into another, summed before the horizontal sum; an odd last block as the scalar
    tail, sumf += d * sumi (product and sum rounded apart: llama.cpp's build keeps no fma there)."""
    from edgeinfer.kernels_cpu.reference import KVALUES_MXFP4, e8m0_to_fp32_half

    xq, xd, _ = K.quantize_activations(x, K.quant_info(T.MXFP4))
    blocks = w.reshape(w.shape[0], -1, 17)
    nb = blocks.shape[1]
    accs = np.zeros((2, w.shape[0], 8), np.float32)
    for b in range(nb):
        qs = blocks[:, b, 1:]
        q = KVALUES_MXFP4[np.concatenate([qs & 15, qs >> 4], axis=1)].astype(np.int64)
        d = (xd[b] * e8m0_to_fp32_half(blocks[:, b, 0])).astype(np.float32)
        lanes = _lanes(q, xq[32 * b: 32 * b + 32]).astype(np.float32)
        if b == nb - 1 and nb % 2:
            tail = (d, lanes.sum(1))   # exact: |sum| < 2^24
        else:
            accs[b % 2] = fma_f32(d[:, None], lanes, accs[b % 2])
    total = hsum8(accs[0] + accs[1])
    return (total + tail[0] * tail[1]).astype(np.float32) if nb % 2 else total


ORDERS = {T.Q8_0: lambda w, x: _q32_dot(w, x, T.Q8_0), T.Q5_0: lambda w, x: _q32_dot(w, x, T.Q5_0),
          T.Q4_0: lambda w, x: _q32_dot(w, x, T.Q4_0), T.Q4_K: _q4k_dot, T.Q6_K: _q6k_dot,
          T.MXFP4: _mxfp4_dot}


@pytest.mark.parametrize("qtype", list(ORDERS), ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [8, 13])
def test_matvec_follows_ggml_order(qtype, n_rows):
    rng = np.random.default_rng(n_rows)
    n_cols = 1024
    w = random_blocks(qtype, n_rows, n_cols, rng)
    x = (rng.standard_normal(n_cols) * 3).astype(np.float32)
    np.testing.assert_array_equal(K.matvec(w, qtype, x), ORDERS[qtype](w, x))


def _mxfp4_case(n_cols):
    """64 random MXFP4 rows and an x whose last block makes the tail's rounding show: codes
    4..7 (values 4..12) on x in (0.3, 1] * amax with amax / 127 = 2047/1024 * 2^-7 in fp16,
    so that d * sumi takes ~26 bits (an fma there gives other bits in about half the rows)."""
    rng = np.random.default_rng(n_cols)
    w = random_blocks(T.MXFP4, 64, n_cols, rng)
    x = (rng.standard_normal(n_cols) * 3).astype(np.float32)
    w.reshape(64, -1, 17)[:, -1, 1:] = rng.integers(4, 8, (64, 16)) * 17
    amax = np.float32(127 * 2047 / 1024 / 128)
    x[-32:] = rng.uniform(0.3, 1.0, 32).astype(np.float32) * amax
    x[-1] = amax
    return w, x


# 1 and 3 blocks (the tail alone, one pair and the tail), gpt-oss's 2880 = 90 blocks, 91
MXFP4_COLS = [32, 96, 2880, 2912]


@pytest.mark.parametrize("n_cols", MXFP4_COLS)
def test_mxfp4_pairs_blocks_and_ends_odd_counts_with_ggml_s_scalar_tail(n_cols):
    w, x = _mxfp4_case(n_cols)
    np.testing.assert_array_equal(K.matvec(w, T.MXFP4, x), _mxfp4_dot(w, x))


@pytest.mark.parametrize("n_cols", MXFP4_COLS)
def test_mxfp4_equals_llama_cpp_s_compiled_ggml(n_cols):
    """The kernels against the oracle's own libggml (tests/ggml_lib.py): dequantization, and
    where that build took the AVX2 path, the row dot, bit for bit."""
    from ggml_lib import oracle_ggml

    ggml = oracle_ggml()
    w, x = _mxfp4_case(n_cols)
    want = ggml.to_float(int(T.MXFP4), w, n_cols)
    np.testing.assert_array_equal(K.dequantize_rows(w, T.MXFP4, n_cols, 0, 64).view(np.uint32), want.view(np.uint32))
    if not ggml.has_avx2():
        pytest.skip("the oracle's ggml was built without AVX2: its dot sums in the generic order")
    np.testing.assert_array_equal(K.matvec(w, T.MXFP4, x), ggml.vec_dot_rows(int(T.MXFP4), w, x))


@pytest.mark.parametrize("qtype, n_rows, n_cols", [
    # four rows a quarter of the matrix apart per loop (_quartered_rows)
    (T.Q8_0, 4, 4096), (T.Q8_0, 37, 4096),
    (T.Q6_K, 4, 4096), (T.Q6_K, 38, 4096),
    (T.Q4_K, 8, 14336), (T.Q4_K, 24, 14336),  # one row per lane (_rows4_q4_k)
    # without VNNI also the 32-element types (dot_q32.rows_*, dot_mxfp4.rows_mxfp4); an odd
    # MXFP4 block count (91) runs its scalar tail in each of the four rows
    (T.Q4_0, 37, 4096), (T.Q5_0, 38, 2880), (T.MXFP4, 4, 2912), (T.MXFP4, 37, 2880),
], ids=lambda v: getattr(v, "name", str(v)))
def test_multi_row_loops_keep_the_order(qtype, n_rows, n_cols):
    # 37, 38 and 24 rows also leave a partial 16-row chunk, and 37 and 38 leftover rows
    rng = np.random.default_rng(n_rows)
    w = random_blocks(qtype, n_rows, n_cols, rng)
    x = (rng.standard_normal(n_cols) * 3).astype(np.float32)
    np.testing.assert_array_equal(K.matvec(w, qtype, x), ORDERS[qtype](w, x))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4, T.IQ4_NL], ids=lambda t: t.name)
def test_rows_in_fours_equal_one_row_at_a_time(qtype):
    # a 1-row matrix takes the one-row kernel; 39 rows take the four-a-loop kernels
    # (where this CPU has them) and a 3-row remainder
    rng = np.random.default_rng(int(qtype))
    w = random_blocks(qtype, 39, 2912, rng)
    x = (rng.standard_normal(2912) * 3).astype(np.float32)
    got = K.matvec(w, qtype, x)
    for r in range(39):
        np.testing.assert_array_equal(got[r], K.matvec(w[r:r + 1], qtype, x)[0])


def test_matvec_many_equals_separate_matvecs():
    rng = np.random.default_rng(4)
    ws = [random_blocks(t, r, 512, rng) for t, r in ((T.Q5_0, 24), (T.Q5_0, 8), (T.Q8_0, 8))]
    x = rng.standard_normal(512).astype(np.float32)
    for k in (2, 3):
        got = K.matvec_many(ws[:k], [T.Q5_0, T.Q5_0, T.Q8_0][:k], x)
        for g, w, t in zip(got, ws, (T.Q5_0, T.Q5_0, T.Q8_0)):
            np.testing.assert_array_equal(g, K.matvec(w, t, x))
    mixed = K.matvec_many([ws[0], random_blocks(T.Q4_K, 8, 512, rng)], [T.Q5_0, T.Q4_K], x)  # two formats
    np.testing.assert_array_equal(mixed[0], K.matvec(ws[0], T.Q5_0, x))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_claimed_work_items_cover_every_row_once(threads):
    """Rows of up to three matrices share one numbering of work items that threads claim
    in runs (dispatch._claimed_items): every output row is written, once, with the bits of
    one matrix at a time, whatever the thread count and however the runs fall."""
    from edgeinfer.kernels_cpu import dispatch

    rng = np.random.default_rng(9)
    # 19 + 1 + 63 work items; types that take the same 8-bit activations
    shapes = ((T.Q4_K, 8 * 37), (T.Q6_K, 13), (T.Q4_K, 1000))
    ws = [random_blocks(t, r, 512, rng) for t, r in shapes]
    x = rng.standard_normal(512).astype(np.float32)
    xq, xd, xs = K.quantize_activations(x, K.quant_info(T.Q4_K))
    alone = [K.matvec(w, t, x) for w, (t, _) in zip(ws, shapes)]
    before = K.get_threads()
    K.set_threads(threads)
    try:
        for k in (1, 2, 3):
            outs = [np.full(r, np.nan, np.float32) for _, r in shapes[:k]]
            dispatch.matvec_fast_many(ws[:k], [int(t) for t, _ in shapes[:k]], xq, xd, xs, outs)
            for got, want in zip(outs, alone):
                np.testing.assert_array_equal(got, want)
    finally:
        K.set_threads(before)


def test_matvec_prepared_equals_matvec():
    from edgeinfer.kernels_cpu.matvec import matvec_prepared, prepare_weight
    rng = np.random.default_rng(5)
    ws = [(random_blocks(T.Q4_K, 16, 512, rng), T.Q4_K), (random_blocks(T.Q6_K, 8, 512, rng), T.Q6_K),
          (random_blocks(T.Q4_K, 4, 512, rng), T.Q4_K)]
    x = rng.standard_normal(512).astype(np.float32)
    for k in (1, 2, 3):
        got = matvec_prepared([prepare_weight(w, t) for w, t in ws[:k]], x)
        for g, (w, t) in zip(got, ws):
            np.testing.assert_array_equal(g, K.matvec(w, t, x))
    assert prepare_weight(np.zeros((4, 512 * 2), np.uint8), T.F16) is None   # float types: general path
    with pytest.raises(ValueError, match="C-contiguous float32 \\(512,\\)"):
        matvec_prepared([prepare_weight(*ws[0])], x[:256])          # never reads past a row


@pytest.mark.parametrize("n_tok", [2, 5, 9])
def test_f32_prompt_products_follow_tinyblas(n_tok):
    # a router's F32 matrix on a prompt (llamafile's sgemm, which ggml calls for n >= 2): one
    # fma chain of 8 lanes per output over k, then AVX's horizontal sum; the tokens of a
    # tile run side by side, each keeping its own chain (on AVX-512 hosts the lanes are 16,
    # summed by _mm512_reduce_add_ps: the 256-bit halves added, then AVX's sum of 8)
    from edgeinfer.kernels_cpu import f32_ggml

    lanes = f32_ggml.host_lanes()
    rng = np.random.default_rng(n_tok)
    W = rng.standard_normal((24, 256)).astype(np.float32)
    X = rng.standard_normal((n_tok, 256)).astype(np.float32)
    want = np.empty((n_tok, 24), np.float32)
    for t in range(n_tok):
        acc = np.zeros((24, lanes), np.float32)
        for i in range(0, 256, lanes):
            acc = fma_f32(W[:, i:i + lanes], X[t, i:i + lanes], acc)
        want[t] = hsum8(acc if lanes == 8 else (acc[:, :8] + acc[:, 8:]).astype(np.float32))
    got = K.matmul(W.view(np.uint8), T.F32, X)
    np.testing.assert_array_equal(got, want)
