"""The short-batch and prompt GEMM for the 32-element block types (kernels_cpu/gemm_q32.py),
its parallel driver (gemm_parallel.py), and the routing around it (matvec.matmul_path,
decode_order, the expert matmuls) against float64 numpy and the row kernels."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from edgeinfer.kernels_cpu import gemm_kquant, gemm_kquant_wide, gemm_q32, tile_gemm
from quant_blocks import random_blocks

MATVEC = importlib.import_module("edgeinfer.kernels_cpu.matvec")
PLAN = importlib.import_module("edgeinfer.kernels_cpu.prompt_plan")
TYPES = [T(t) for t in gemm_q32.GEMM_TYPES]
AVX2_GEMMS = gemm_kquant.host_has_avx2()
# a long prompt of a 32-element type in the VNNI tiles' layouts takes them where there is
# 256-bit VNNI only (with 512-bit VNNI gemm_q32_wide is faster)
LONG_Q32 = "tiles" if tile_gemm.has_vnni() and not gemm_kquant_wide.enabled() else "q32"


def _readonly(w):
    w.flags.writeable = False
    return w


def _reference(w, qtype, X):
    """float64 (quantized activations) . (dequantized weights): what the integer dots sum."""
    n_rows = w.shape[0]
    W = K.reference_dequantize(w, qtype).astype(np.float64).reshape(n_rows, -1)
    info = K.quant_info(qtype)
    xq, xd, _ = MATVEC.quantize_activation_rows(X, info)
    Xq = (xq.reshape(X.shape[0], -1, info.act_block).astype(np.float64) * xd[:, :, None]).reshape(X.shape)
    return Xq @ W.T, np.abs(Xq) @ np.abs(W).T


@pytest.mark.skipif(not gemm_kquant_wide.enabled(),
                    reason="the 32-row kernels run only with AVX512-VNNI (elsewhere they are not compiled) "
                           "and without EDGEINFER_NO_WIDE_GEMM")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 13, 300])   # 300: three token tiles
def test_wide_groups_have_the_8_row_kernels_bits(qtype, n_tok):
    """Rows in groups of 4 (gemm_q32_wide) against each 8-row group alone: equal bits,
    with a tail of blocks past the runs of NBLK (11 blocks)."""
    rng = np.random.default_rng(3 * int(qtype) + n_tok)
    w = _readonly(random_blocks(qtype, 72, 352, rng))   # 9 groups: two wide groups and one left
    X = rng.standard_normal((n_tok, 352)).astype(np.float32) * rng.uniform(0.01, 10, (n_tok, 1)).astype(np.float32)
    packed = gemm_q32.pack_activations(*MATVEC.quantize_activation_rows(X, K.quant_info(qtype)))
    wide = np.full((n_tok, 72), np.nan, np.float32)
    gemm_q32.matmul_rows(w, int(qtype), 0, 9, packed, wide)
    narrow = np.full((n_tok, 72), np.nan, np.float32)
    for g in range(9):   # one group a call: never four, so never the wide kernel
        gemm_q32.matmul_rows(w, int(qtype), g, g + 1, packed, narrow)
    np.testing.assert_array_equal(wide, narrow)
    want, scale = _reference(w, qtype, X)
    assert np.all(np.abs(wide - want) <= 2e-5 * scale + 1e-30)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows,n_cols,n_tok", [(8, 32, 1), (24, 288, 9), (40, 640, 4), (16, 2880, 3),
                                                 (32, 512, 70)])
def test_gemm_matches_numpy(qtype, n_rows, n_cols, n_tok):
    # column counts with and without a tail of blocks past the runs of NBLK, token counts
    # off the multiple of 4, several row groups
    rng = np.random.default_rng(n_rows + n_cols + n_tok)
    w = _readonly(random_blocks(qtype, n_rows, n_cols, rng))
    X = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    info = K.quant_info(qtype)
    out = np.full((n_tok, n_rows), np.nan, np.float32)
    packed = gemm_q32.pack_activations(*MATVEC.quantize_activation_rows(X, info))
    gemm_q32.matmul_rows(w, int(qtype), 0, n_rows // 8, packed, out)
    want, scale = _reference(w, qtype, X)
    assert np.all(np.abs(out - want) <= 2e-6 * scale + 1e-30), qtype.name
    # the parallel driver: three matrices in one region, each the single call's bits
    ws = [w, _readonly(random_blocks(qtype, 16, n_cols, rng)), w[:8]]
    outs = [np.empty((n_tok, m.shape[0]), np.float32) for m in ws]
    gemm_q32.DRIVERS.run(ws, [int(qtype)] * 3, packed, outs, 2)
    np.testing.assert_array_equal(outs[0], out)
    np.testing.assert_array_equal(outs[2], out[:, :8])
    single = np.empty_like(outs[1])
    gemm_q32.matmul_rows(ws[1], int(qtype), 0, 2, packed, single)
    np.testing.assert_array_equal(outs[1], single)


def test_extreme_values_do_not_overflow_the_i16_sums():
    # every weight at its largest magnitude and every activation at +-127: the i16 partial
    # sums at their bound (Q4_0 adds 8 vpmaddubsw results, Q5_0 4, Q8_0 1)
    rng = np.random.default_rng(7)
    for qtype in TYPES:
        w = random_blocks(qtype, 8, 256, rng)
        bs = K.quant_info(qtype).type_size
        blocks = w.reshape(8, -1, bs)
        if qtype == T.Q8_0:
            blocks[:, :, 2:] = np.uint8(0x81)          # -127
        elif qtype == T.MXFP4:
            blocks[:, :, 1:] = np.uint8(0xFF)          # code 15: -12
        elif qtype == T.IQ4_NL:
            blocks[:, :, 2:] = np.uint8(0x00)          # code 0: -127
        else:
            blocks[:, :, -16:] = np.uint8(0xFF)        # code 15 (Q5_0, Q5_1: with their fifth bits set too)
            if qtype in (T.Q5_0, T.Q5_1):
                blocks[:, :, bs - 20:bs - 16] = np.uint8(0xFF)
        _readonly(w)
        X = np.where(rng.random((5, 256)) < 0.5, -1.0, 1.0).astype(np.float32)
        out = np.empty((5, 8), np.float32)
        packed = gemm_q32.pack_activations(*MATVEC.quantize_activation_rows(X, K.quant_info(qtype)))
        gemm_q32.matmul_rows(w, int(qtype), 0, 1, packed, out)
        want, scale = _reference(w, qtype, X)
        assert np.all(np.abs(out - want) <= 2e-6 * scale), qtype.name


@pytest.mark.skipif(not AVX2_GEMMS, reason="the 8-bit GEMMs are AVX2 code: this CPU has no AVX2")
def test_routing_by_size_and_decode_order():
    assert MATVEC.matmul_path(T.Q5_0, 64, 2) == "rows"
    assert MATVEC.matmul_path(T.Q5_0, 64, 4) == "q32"
    assert MATVEC.matmul_path(T.Q5_0, 60, 40) == "rows"        # rows not in eights
    assert MATVEC.matmul_path(T.Q8_0, 64, 40) == "rows"        # llama.cpp's batches keep these bits
    assert MATVEC.matmul_path(T.Q8_0, 64, 65) == LONG_Q32
    assert MATVEC.matmul_path(T.MXFP4, 64, 512) == "q32"
    assert MATVEC.matmul_path(T.Q6_K, 64, 16) == "kquant"
    assert MATVEC.matmul_path(T.Q5_K, 64, 16) == "kquant"
    assert MATVEC.matmul_path(T.Q5_K, 64, 8) == "rows"
    with K.decode_order():
        assert MATVEC.matmul_path(T.Q5_K, 64, 16) == "rows"
        assert MATVEC.matmul_path(T.Q5_0, 64, 40) == "rows"
        assert MATVEC.matmul_path(T.Q6_K, 64, 16) == "rows"
        assert MATVEC.matmul_path(T.Q4_K, 64, 32) == "kquant"   # matvec's bits anyway
        assert MATVEC.matmul_path(T.Q5_0, 64, 65) == LONG_Q32   # a long prompt is never a verification
    assert not MATVEC._in_decode_order()


@pytest.mark.skipif(not AVX2_GEMMS, reason="the 8-bit GEMMs are AVX2 code: this CPU has no AVX2")
def test_matmul_takes_the_gemm_and_decode_order_keeps_matvec_bits():
    rng = np.random.default_rng(11)
    w = _readonly(random_blocks(T.Q5_0, 48, 640, rng))
    X = rng.standard_normal((12, 640)).astype(np.float32)
    fast = K.matmul(w, T.Q5_0, X)
    want, scale = _reference(w, T.Q5_0, X)
    assert np.all(np.abs(fast - want) <= 2e-6 * scale)
    with K.decode_order():
        exact = K.matmul(w, T.Q5_0, X)
    for t in range(12):
        np.testing.assert_array_equal(exact[t], K.matvec(w, T.Q5_0, X[t]))
    assert not np.array_equal(fast, exact)   # another order: the switch does something
    many = K.matmul_many([w, w[:16]], [T.Q5_0, T.Q5_0], X)   # gate/up: one packing, one region
    np.testing.assert_array_equal(many[0], fast)
    np.testing.assert_array_equal(many[1], fast[:, :16])


@pytest.mark.skipif(not AVX2_GEMMS, reason="the 8-bit GEMMs are AVX2 code: this CPU has no AVX2")
@pytest.mark.parametrize("qtype", [T.MXFP4, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_expert_matmul_runs_busy_experts_through_the_gemm(qtype):
    # 5 experts of 48 rows (3 work items a matrix), gate and up: experts 2 (261 tokens: two
    # token tiles), 0 (9) and 4 (17) take the GEMM in one region, experts 1 and 3 with one
    # token each the row kernels; outputs land in each assignment's row either way
    rng = np.random.default_rng(5)
    n_expert, n_per, n_cols = 5, 48, 512
    w = _readonly(random_blocks(qtype, n_expert * n_per, n_cols, rng))
    w_up = _readonly(random_blocks(qtype, n_expert * n_per, n_cols, rng))
    X = rng.standard_normal((300, n_cols)).astype(np.float32)
    experts = np.array([0, 1, 2, 3, 4])
    counts = np.array([9, 1, 261, 1, 17])
    starts = np.concatenate([[0], np.cumsum(counts)])
    rows_of = rng.integers(0, 300, counts.sum())   # each assignment's token
    got, got_up = K.expert_matvec([w, w_up], [qtype] * 2, experts, starts, rows_of, n_per, X)
    with K.decode_order():
        rows = K.expert_matvec([w], [qtype], experts, starts, rows_of, n_per, X)[0]
    for i, e in enumerate(experts):
        slab = w[e * n_per:(e + 1) * n_per]
        mine = slice(starts[i], starts[i + 1])
        if counts[i] > 1:   # the region's bits are the expert's own GEMM call's
            np.testing.assert_array_equal(got[mine], K.matmul(slab, qtype, X[rows_of[mine]]))
            np.testing.assert_array_equal(got_up[mine], K.matmul(w_up[e * n_per:(e + 1) * n_per], qtype,
                                                                 X[rows_of[mine]]))
        for a in range(starts[i], starts[i + 1]):
            x = X[rows_of[a]]
            np.testing.assert_array_equal(rows[a], K.matvec(slab, qtype, x))
            ref, scale = _reference(slab, qtype, x[None])
            assert np.all(np.abs(got[a] - ref[0]) <= 2e-6 * scale[0]), (qtype.name, e, a)
            if counts[i] == 1:   # the row kernels: matvec's bits
                np.testing.assert_array_equal(got[a], rows[a])
    busy = np.arange(starts[2], starts[3])
    if qtype != T.Q4_K:   # Q4_K's GEMM keeps matvec's bits; the others sum in their own order
        assert not np.array_equal(got[busy], rows[busy])
    else:
        np.testing.assert_array_equal(got[busy], rows[busy])


def test_a_models_types_share_one_driver():
    # a model's types (use_types) compile one driver that serves any subset; other type
    # sets keep their own
    union = gemm_q32.DRIVERS.use_types([T.Q5_0, T.Q8_0, T.Q6_K])   # Q6_K is gemm_kquant's
    assert union is gemm_q32.DRIVERS.for_types([T.Q5_0]) is gemm_q32.DRIVERS.for_types([T.Q8_0, T.Q5_0])
    assert gemm_q32.DRIVERS.for_types([T.Q4_0]) is not union
    assert gemm_q32.DRIVERS.use_types([T.Q6_K]) is None            # none of this GEMM's types
    # a second model (a draft) keeps its own, and the first one's stays
    draft = gemm_q32.DRIVERS.use_types([T.Q4_0, T.Q8_0])
    assert draft is gemm_q32.DRIVERS.for_types([T.Q4_0]) is not union
    assert gemm_q32.DRIVERS.for_types([T.Q5_0]) is union


@pytest.mark.skipif(not AVX2_GEMMS, reason="the 8-bit GEMMs are AVX2 code: this CPU has no AVX2")
@pytest.mark.parametrize("path, types", [("q32", (T.MXFP4,)), ("kquant", (T.Q4_K, T.Q6_K))])
def test_warm_up_compiles_the_drivers_a_prompt_calls(path, types):
    # Engine.warm_up's pass is two tokens: the GEMMs a longer prompt takes are compiled by
    # calling them on zeros with the argument types a prompt passes, so the prompt's call
    # adds no new signature (no compile at the first real prompt)
    gemm = gemm_q32 if path == "q32" else gemm_kquant
    kernels = PLAN.use_prompt_gemms(list(types), experts=True)
    driver = gemm.DRIVERS.for_types(types)
    assert kernels == [driver.kernel, driver.expert_kernel]
    PLAN.warm_prompt_gemms()
    before = (len(driver.kernel.signatures), len(driver.expert_kernel.signatures))
    assert min(before) >= 1
    rng = np.random.default_rng(3)
    w = _readonly(random_blocks(types[0], 4 * 16, 512, rng))
    X = rng.standard_normal((40, 512)).astype(np.float32)
    K.matmul(w, types[0], X)
    K.expert_matvec([w], [types[0]], np.array([1, 3]), np.array([0, 20, 40]), np.arange(40) % 40, 16, X)
    assert (len(driver.kernel.signatures), len(driver.expert_kernel.signatures)) == before
