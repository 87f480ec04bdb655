"""Quantized CPU kernels against numpy references (gguf.quants.dequantize + numpy).

Tolerances:
- tight: the kernel against dequantize(W) @ x_q, where x_q is x rounded exactly as the
  kernel quantizes activations. Both compute the same sum; only float32 accumulation
  order differs, bounded by ~n*eps*sum|w*x|. We allow 2e-5 * sum|w*x_q| (n <= 4096).
- loose: against the float reference dequantize(W) @ x. Rounding x to 8 bits moves each
  element by at most half a step, amax_block/254 (amax/127 steps), and the fp16 rounding of
  the Q8_0 scale adds at most 2^-11 relative: |y - ref| <= 1.01 * |W| @ (amax_block/254) + tight.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from edgeinfer.errors import UnsupportedModelError
from edgeinfer.kernels_cpu import bf16_ggml_ref, dispatch, quant_kernels, quant_types
from edgeinfer.kernels_cpu.reference import reference_quantize_act
from quant_blocks import random_blocks

MATVEC = importlib.import_module("edgeinfer.kernels_cpu.matvec")  # the module (K.matvec is its function)
TYPES = list(K.supported_types())
FAST_TYPES = list(quant_types.fast_types())


def _shapes(qtype):
    blk = K.quant_info(qtype).block_size
    blk = max(blk, 32)
    # (n_rows, n_cols): one row of one block, odd row count, many blocks
    return [(1, blk), (37, 3 * blk if blk == 256 else 96), (65, 8 * blk if blk == 256 else 2048)]


def _weights(qtype, n_rows, n_cols, seed=0):
    w = random_blocks(qtype, n_rows, n_cols, np.random.default_rng(seed))
    w.setflags(write=False)     # as the loader's mmap views
    return w


def _act_bound(W, x, block):
    """Upper bound of |W @ x - W @ x_q| from 8-bit activation rounding (see module doc)."""
    amax = np.abs(x.reshape(-1, block)).max(axis=1)
    step = np.repeat(amax / 254.0, block)
    return 1.01 * (np.abs(W) @ step)


def _float_act(qtype, x):
    """A float type's activation as its kernels take it: BF16 rounds it to BF16 (ggml's
    vec_dot_type for BF16), the others keep float32."""
    if qtype == T.BF16:
        return bf16_ggml_ref.widen(bf16_ggml_ref.to_bf16(x)).astype(np.float64)
    return x.astype(np.float64)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matvec_matches_reference(qtype):
    rng = np.random.default_rng(1)
    for n_rows, n_cols in _shapes(qtype):
        w = _weights(qtype, n_rows, n_cols)
        x = rng.standard_normal(n_cols).astype(np.float32)
        y = K.matvec(w, qtype, x)
        W = K.reference_dequantize(w, qtype).astype(np.float64)
        act = K.quant_info(qtype).act_block
        xq = reference_quantize_act(x, act) if act else _float_act(qtype, x)
        tight = W @ xq
        tol = 2e-5 * (np.abs(W) @ np.abs(xq)) + 1e-30
        assert np.all(np.abs(y - tight) <= tol), (qtype.name, n_rows, n_cols, np.abs(y - tight).max())
        ref = K.reference_matvec(w, qtype, x)
        rounding = _act_bound(W, x, act) if act else np.abs(W) @ np.abs(xq - x)   # BF16's, or none
        loose = rounding + tol + 1e-6 * np.abs(ref)
        assert np.all(np.abs(y - ref) <= loose), (qtype.name, n_rows, n_cols)


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_fast_path_matches_plain_kernel(qtype):
    rng = np.random.default_rng(2)
    for n_rows, n_cols in [(1, 256), (33, 1024), (7, 4096)]:
        w = _weights(qtype, n_rows, n_cols, seed=n_rows)
        x = (rng.standard_normal(n_cols) * rng.uniform(0.1, 10)).astype(np.float32)
        xq, xd, xs = K.quantize_activations(x, K.quant_info(qtype))
        fast = np.empty(n_rows, np.float32)
        plain = np.empty(n_rows, np.float32)
        dispatch.matvec_fast(w, int(qtype), xq, xd, xs, fast)
        quant_kernels.matvec_q_kernel(w, w.view(np.int8), int(qtype), xq, xd, xs, plain, 16, 32)
        W = K.reference_dequantize(w, qtype).astype(np.float64)
        scale = np.abs(W) @ np.abs(reference_quantize_act(x, K.quant_info(qtype).act_block))
        assert np.all(np.abs(fast - plain) <= 2e-5 * scale), qtype.name


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_matches_reference(qtype):
    rng = np.random.default_rng(3)
    n_cols = _shapes(qtype)[1][1]
    n_rows = 150                       # more than two 64-row prefill tiles, not a multiple
    w = _weights(qtype, n_rows, n_cols)
    W = K.reference_dequantize(w, qtype).astype(np.float64)
    act = K.quant_info(qtype).act_block
    for n_tok in (2, 5, 70):
        X = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        Y = K.matmul(w, qtype, X)
        assert Y.shape == (n_tok, n_rows) and Y.dtype == np.float32
        if K.matmul_uses_int8(qtype, n_tok, n_rows):    # 8-bit activations, as matvec: same bounds
            rows = MATVEC.matmul_uses_rows(qtype, n_tok, n_rows)   # else the VNNI tiles: 32-blocks
            Xq = np.stack([reference_quantize_act(x, act if rows else 32) for x in X])
            tol = 2e-5 * (np.abs(Xq) @ np.abs(W).T) + 1e-30
            assert np.all(np.abs(Y - Xq @ W.T) <= tol), (qtype.name, n_tok)
            if rows:                                    # the decode kernels: matvec's numbers
                for t in range(n_tok):
                    np.testing.assert_array_equal(Y[t], K.matvec(w, qtype, X[t]))
        else:                                         # float GEMM: only summation order differs
            tol = 2e-5 * (np.abs(X) @ np.abs(W).T) + 1e-30
            assert np.all(np.abs(Y - _float_act(qtype, X) @ W.T) <= tol), (qtype.name, n_tok)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_get_rows_and_dequantize_rows(qtype):
    n_rows, n_cols = _shapes(qtype)[1]
    w = _weights(qtype, n_rows, n_cols)
    W = K.reference_dequantize(w, qtype)
    ids = np.array([5, 0, n_rows - 1, 5])
    got = K.get_rows(w, qtype, n_cols, ids)
    np.testing.assert_allclose(got, W[ids], rtol=1e-6, atol=1e-7 * np.abs(W).max())
    part = K.dequantize_rows(w, qtype, n_cols, 3, 11)
    np.testing.assert_allclose(part, W[3:11], rtol=1e-6, atol=1e-7 * np.abs(W).max())
    full = K.dequantize_rows(w, qtype, n_cols, 0, n_rows)      # fast IR kernel where there is one
    np.testing.assert_allclose(full, W, rtol=1e-6, atol=1e-7 * np.abs(W).max())
    plain = np.empty_like(W)                                     # the plain Numba kernel too
    quant_kernels.dequantize_rows_kernel(w, w.view(np.int8), int(qtype), np.arange(n_rows), plain)
    np.testing.assert_allclose(plain, W, rtol=1e-6, atol=1e-7 * np.abs(W).max())


def test_writable_weights_and_out_buffer_and_threads():
    rng = np.random.default_rng(4)
    w = random_blocks(T.Q4_K, 50, 512, rng)         # writable
    x = rng.standard_normal(512).astype(np.float32)
    out = np.full(50, np.nan, np.float32)
    assert K.matvec(w, T.Q4_K, x, out) is out
    before = K.get_threads()
    try:
        K.set_threads(1)
        one = K.matvec(w, T.Q4_K, x)
    finally:
        K.set_threads(before)
    np.testing.assert_array_equal(out, one)          # rows are independent: same bits
    w.flags.writeable = False
    np.testing.assert_array_equal(K.matvec(w, T.Q4_K, x), one)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q4_0], ids=lambda t: t.name)
def test_zero_activations_give_zero(qtype):
    w = _weights(qtype, 9, 512)
    assert np.all(K.matvec(w, qtype, np.zeros(512, np.float32)) == 0)


def test_bad_inputs_raise():
    w = _weights(T.Q8_0, 4, 64)
    with pytest.raises(ValueError):
        K.matvec(w, T.Q8_0, np.zeros(63, np.float32))
    with pytest.raises(ValueError):
        K.matmul(w, T.Q8_0, np.zeros((2, 32), np.float32))
    with pytest.raises(IndexError):
        K.get_rows(w, T.Q8_0, 64, [4])
    with pytest.raises(UnsupportedModelError):
        K.matvec(np.zeros((4, 66), np.uint8), T.TQ2_0, np.zeros(256, np.float32))
    with pytest.raises(UnsupportedModelError):
        K.matvec(np.zeros((4, 35), np.uint8), T.Q8_0, np.zeros(32, np.float32))


def test_quant_types_table():
    assert K.quant_info(T.Q4_K).block_size == 256 and K.quant_info(T.Q4_K).type_size == 144
    assert K.row_bytes(T.Q8_0, 64) == 68 and K.row_bytes(T.F32, 3) == 12
    assert set(TYPES) == {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K,
                          T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.IQ1_S, T.IQ1_M, T.IQ2_XXS,
                          T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S}


def test_mxfp4_reference_is_ggml_s_and_gguf_s_dequantization():
    """The numpy reference (reference.py, from ggml-quants.c and ggml-impl.h) and gguf.quants
    (written apart) agree bit for bit on every E8M0 byte, denormal scales 0 and 1 included,
    and on every code; the kernels are held to both."""
    from gguf import quants

    from edgeinfer.kernels_cpu.reference import e8m0_to_fp32_half, reference_dequantize_mxfp4

    e = np.arange(256, dtype=np.uint8)
    half = e8m0_to_fp32_half(e)
    np.testing.assert_array_equal(half.view(np.uint32), quants.MXFP4.e8m0_to_fp32_half(e).view(np.uint32))
    assert half[0] == 2.0 ** -128 and half[1] == 2.0 ** -127 and half[128] == 1.0 and half[254] == 2.0 ** 126
    rng = np.random.default_rng(6)
    w = rng.integers(0, 256, (16, 17 * 16), dtype=np.uint8)        # 256 blocks: every scale byte
    w.reshape(-1, 17)[:, 0] = rng.permutation(256)
    with np.errstate(over="ignore"):    # 12 * 2^126 is inf in float32, in ggml too
        want = quants.dequantize(w, T.MXFP4).astype(np.float32).reshape(16, -1)
        ref = reference_dequantize_mxfp4(w)
    np.testing.assert_array_equal(ref.view(np.uint32), want.view(np.uint32))
    plain = np.empty_like(want)
    quant_kernels.dequantize_rows_kernel(w, w.view(np.int8), int(T.MXFP4), np.arange(16), plain)
    for got in (K.dequantize_rows(w, T.MXFP4, 512, 0, 16), plain):    # IR and plain Numba kernels
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_set_threads_applies_in_other_threads():
    import threading

    import numba
    seen = []
    w = _weights(T.Q8_0, 8, 64)

    def worker():
        K.matvec(w, T.Q8_0, np.ones(64, np.float32))
        seen.append(numba.get_num_threads())

    before = K.get_threads()
    try:
        K.set_threads(1)
        th = threading.Thread(target=worker)
        th.start()
        th.join()
    finally:
        K.set_threads(before)
    assert seen == [1]


@pytest.mark.parametrize("qtype", [T.Q5_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_quartered_rows_keep_each_rows_bits(qtype):
    # these types run four rows a quarter of the matrix apart in one loop; every row must
    # still come out exactly as the one-row kernel computes it alone (its ggml order)
    rng = np.random.default_rng(5)
    w = _weights(qtype, 37, 1024, seed=9)
    x = rng.standard_normal(1024).astype(np.float32)
    together = K.matvec(w, qtype, x)
    alone = np.array([K.matvec(np.ascontiguousarray(w[r:r + 1]), qtype, x)[0] for r in range(37)])
    np.testing.assert_array_equal(together, alone)
