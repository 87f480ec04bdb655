"""The i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) against the oracle's own ggml.

- the tables (kernels_cpu/iq_tables.py): every grid entry and sign pattern dequantized as
  ggml's to_float does, bit for bit, through the numpy reference and the IR kernels;
- the row dots: ggml's vec_dot with its Q8_K activations, bit for bit (numpy reference,
  IR kernels through matvec, short-prompt matmul); the plain Numba kernels near them;
- hostile blocks: NaN and infinite scales give what ggml gives, nothing else breaks.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from edgeinfer.kernels_cpu import dispatch, iquant_ref, quant_kernels
from edgeinfer.kernels_cpu.reference import reference_quantize_act
from ggml_lib import oracle_ggml
from quant_blocks import random_blocks

MATVEC = importlib.import_module("edgeinfer.kernels_cpu.matvec")
IQ_TYPES = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M)
# entries of each type's grid (and of the 7-bit sign table where the type uses it)
GRID_SIZE = {T.IQ2_XXS: 256, T.IQ2_XS: 512, T.IQ2_S: 1024, T.IQ3_XXS: 256, T.IQ3_S: 512, T.IQ1_S: 2048,
             T.IQ1_M: 2048}


@pytest.fixture(scope="module")
def ggml():
    return oracle_ggml()


def _bits_equal(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_every_table_entry_dequantizes_as_ggml(qtype, ggml):
    rng = np.random.default_rng(int(qtype))
    # enough random groups that every grid index is drawn (checked below)
    n_rows = 32 * GRID_SIZE[qtype] // 256
    w = random_blocks(qtype, n_rows, 2048, rng)
    used = iquant_ref.grid_indices(int(qtype), w)
    assert np.unique(used).size == GRID_SIZE[qtype]
    want = ggml.to_float(int(qtype), w, 2048)
    assert _bits_equal(iquant_ref.dequantize(int(qtype), w), want)
    assert _bits_equal(K.dequantize_rows(w, qtype, 2048, 0, n_rows), want)        # the IR kernel
    plain = np.empty_like(want)
    quant_kernels.dequantize_rows_kernel(w, w.view(np.int8), int(qtype), np.arange(n_rows), plain)
    assert _bits_equal(plain, want)


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows, n_cols", [(1, 256), (37, 1024), (19, 4096)])
def test_row_dots_are_ggml_s_vec_dot(qtype, n_rows, n_cols, ggml):
    rng = np.random.default_rng(n_rows + int(qtype))
    w = random_blocks(qtype, n_rows, n_cols, rng)
    w.flags.writeable = False
    x = (rng.standard_normal(n_cols) * rng.uniform(0.1, 10)).astype(np.float32)
    want = ggml.vec_dot_rows(int(qtype), w, x)
    got = K.matvec(w, qtype, x)
    assert _bits_equal(got, want), np.abs(got - want).max()
    xq, xd, xs = K.quantize_activations(x, K.quant_info(qtype))
    assert _bits_equal(iquant_ref.vec_dot(int(qtype), w, xq, xd, xs), want)
    plain = np.empty(n_rows, np.float32)
    quant_kernels.matvec_q_kernel(w, w.view(np.int8), int(qtype), xq, xd, xs, plain, 16, 32)
    W = iquant_ref.dequantize(int(qtype), w).astype(np.float64)
    scale = np.abs(W) @ np.abs(xq.astype(np.float64) * np.repeat(xd, 256))
    assert np.all(np.abs(plain - want) <= 2e-5 * scale + 1e-30)


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_short_prompts_are_decode_bits_and_long_ones_the_exact_product(qtype, ggml):
    rng = np.random.default_rng(5)
    w = random_blocks(qtype, 72, 512, rng)
    w.flags.writeable = False
    with MATVEC.decode_order():   # speculative verification's rows: the decode bits at any count
        for n_tok in (6, 20):
            X = rng.standard_normal((n_tok, 512)).astype(np.float32)
            Y = K.matmul(w, qtype, X)
            for t in range(n_tok):
                assert _bits_equal(Y[t], ggml.vec_dot_rows(int(qtype), w, X[t]))
    W = ggml.to_float(int(qtype), w, 512).astype(np.float64)
    for n_tok in (12, 80):   # the 8-bit GEMM (AVX2 without VNNI) or dequantized + BLAS
        X = rng.standard_normal((n_tok, 512)).astype(np.float32)
        if K.matmul_uses_int8(qtype, n_tok, 72):   # Q8_K activations, exact integer sums
            X = np.stack([reference_quantize_act(x, 256) for x in X])
        tol = 2e-5 * (np.abs(X) @ np.abs(W).T)
        assert np.all(np.abs(K.matmul(w, qtype, X.astype(np.float32)) - X @ W.T) <= tol)


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_experts_of_an_i_quant_tensor(qtype, ggml):
    rng = np.random.default_rng(6)
    n_expert, n_per, n_cols = 4, 32, 512
    w = random_blocks(qtype, n_expert * n_per, n_cols, rng)
    w.flags.writeable = False
    X = rng.standard_normal((3, n_cols)).astype(np.float32)
    experts, starts, rows_of = np.array([2, 0]), np.array([0, 2, 3]), np.array([0, 2, 1])
    out = np.zeros((3, n_per), np.float32)
    xq, xd, xs = MATVEC.quantize_activation_rows(X, K.quant_info(qtype))
    dispatch.expert_matvec_fast([w], [int(qtype)], experts, starts, rows_of, n_per, xq, xd, xs, [out])
    for a, (e, t) in enumerate([(2, 0), (2, 2), (0, 1)]):
        want = ggml.vec_dot_rows(int(qtype), w[e * n_per:(e + 1) * n_per], X[t])
        assert _bits_equal(out[a], want)


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_nan_and_infinite_scales_give_what_ggml_gives(qtype, ggml):
    rng = np.random.default_rng(7)
    w = random_blocks(qtype, 8, 512, rng)
    bad = np.array([np.nan, np.inf, -np.inf, 0.0], np.float16)
    for row, value in enumerate(bad):   # the first block of rows 0..3
        if qtype == T.IQ1_M:
            from gguf_factory import _iq1m_scale
            blk = w[row:row + 1, :56]
            _iq1m_scale(blk, np.array([value], np.float16))
            w[row, :56] = blk[0]
        else:
            w[row, 0:2] = np.array([value], np.float16).view(np.uint8)
    w.flags.writeable = False
    x = rng.standard_normal(512).astype(np.float32)
    want, got = ggml.vec_dot_rows(int(qtype), w, x), K.matvec(w, qtype, x)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert _bits_equal(np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0, want))
    assert not np.isfinite(got[:3]).any() and np.isfinite(got[3:]).all()
    deq = K.dequantize_rows(w, qtype, 512, 0, 8)
    ref = ggml.to_float(int(qtype), w, 512)
    assert np.array_equal(np.isnan(deq), np.isnan(ref))
    assert _bits_equal(np.where(np.isnan(deq), 0, deq), np.where(np.isnan(ref), 0, ref))
