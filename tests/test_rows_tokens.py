"""dispatch._dot_rows_tokens: a short batch's tokens up to four a row (the 32-element types:
eight), each with matvec's bits.

A short prompt or a speculative batch on the decode row kernels used to run every token
over a chunk of rows on its own; ir_helpers.token_row_loop runs two to four tokens per
row loop (the 32-element types up to eight) with each (row, token) pair's own accumulators
and operations, a batch in as few passes as can be (5 tokens: 3 + 2; Q8_0 one pass)."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from edgeinfer.kernels_cpu import dispatch
from quant_blocks import random_blocks

def assert_each_token_has_matvecs_bits(w, qt, X):
    """A batch in decode_order (a speculative batch: the row kernels): every token's row of
    the product equal to matvec's on that token alone."""
    with K.decode_order():
        got = K.matmul(w, qt, X)
    for t in range(X.shape[0]):
        np.testing.assert_array_equal(got[t], K.matvec(w, qt, X[t]), err_msg=f"token {t}")


TYPES = [T.Q8_0, T.Q6_K, T.Q5_K, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.Q3_K, T.Q2_K, T.IQ4_XS, T.Q4_K]


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [2, 3, 4, 5, 7, 9])   # one pass of 2, 3, 4; 3 + 2; 4 + 3; 3 + 3 + 3
def test_each_token_of_a_batch_has_matvecs_bits(qt, n_tok):
    rng = np.random.default_rng(int(qt) * 10 + n_tok)
    n_rows = 44 if qt == T.Q4_K else 40   # Q4_K: rows % 8 != 0, where its decode rows are row_loop's
    w = random_blocks(qt, n_rows, 768, rng)
    w.flags.writeable = False
    X = rng.standard_normal((n_tok, 768)).astype(np.float32) * rng.uniform(0.01, 10, (n_tok, 1)).astype(np.float32)
    assert dispatch.kernel_set((int(qt),)).has_tokens_rows(int(qt), n_rows)
    assert_each_token_has_matvecs_bits(w, qt, X)   # a speculative batch: the row kernels, for every type


WIDE = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL]


@pytest.mark.parametrize("qt", WIDE, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [6, 8, 11, 17])   # one pass of 6, 8; 6 + 5; 6 + 6 + 5
def test_passes_of_up_to_eight_tokens_keep_matvecs_bits(qt, n_tok):
    assert dispatch.kernel_set((int(qt),)).tokens_a_row(int(qt)) == 8
    rng = np.random.default_rng(900 + n_tok + 50 * int(qt))
    w = random_blocks(qt, 40, 32 * 11, rng)   # 11 blocks: two groups of four scales and a tail
    w.flags.writeable = False
    X = rng.standard_normal((n_tok, 32 * 11)).astype(np.float32) * rng.uniform(0.01, 10, (n_tok, 1)).astype(np.float32)
    assert_each_token_has_matvecs_bits(w, qt, X)


@pytest.mark.parametrize("qt", [T.Q8_0, T.Q4_0], ids=lambda t: t.name)
@pytest.mark.parametrize("n_blocks", [3, 7, 9])   # no group of four; one and a tail of 3; two and 1
def test_grouped_scale_products_keep_the_bits_with_a_tail(qt, n_blocks):
    # these types' token loops form four blocks' scale products in one multiply
    # (ir_helpers.group_scales), the blocks past the last group one at a time
    rng = np.random.default_rng(n_blocks)
    w = random_blocks(qt, 40, 32 * n_blocks, rng)
    w.flags.writeable = False
    X = rng.standard_normal((4, 32 * n_blocks)).astype(np.float32)
    assert_each_token_has_matvecs_bits(w, qt, X)


def test_decode_order_holds_past_the_short_batch_bound():
    # an encoder's Q8_0 products take decode's bits for any patch count: the row kernels
    # in batches of the short-batch bound (matvec._INT8_MATMUL_MAX_TOKENS = 64)
    rng = np.random.default_rng(70)
    w = random_blocks(T.Q8_0, 40, 256, rng)
    w.flags.writeable = False
    X = rng.standard_normal((150, 256)).astype(np.float32)
    assert_each_token_has_matvecs_bits(w, T.Q8_0, X)


def test_repacked_q4_k_keeps_its_own_rows():
    # Q4_K with rows % 8 == 0 decodes in llama.cpp's repacked gemv order: not token_row_loop's
    assert not dispatch.kernel_set((int(T.Q4_K),)).has_tokens_rows(int(T.Q4_K), 64)


@pytest.mark.parametrize("qts", [(T.Q5_0, T.Q5_0, T.Q8_0), (T.Q6_K, T.Q4_K), (T.Q8_0, T.Q6_K)],
                         ids=["q32-mixed", "kquants", "two-activation-formats"])
def test_matrices_on_one_input_share_one_region(qts, monkeypatch):
    # Q/K/V and gate/up of a short batch on the row kernels (no pairs: AVX2 hosts): one
    # quantization and one parallel region where the types share an activation format
    matvec_mod = sys.modules["edgeinfer.kernels_cpu.matvec"]
    monkeypatch.setattr(matvec_mod, "_PAIRS", False)
    calls = []
    real = dispatch.matmul_int_many
    monkeypatch.setattr(dispatch, "matmul_int_many", lambda ws, *a: calls.append(len(ws)) or real(ws, *a))
    rng = np.random.default_rng(11)
    ws = [random_blocks(qt, n, 768, rng) for qt, n in zip(qts, (44, 20, 12))]
    for w in ws:
        w.flags.writeable = False
    X = rng.standard_normal((3, 768)).astype(np.float32)
    with K.decode_order():
        got = K.matmul_many(ws, list(qts), X)
    one_format = len({K.quant_info(qt).act_block for qt in qts}) == 1
    assert calls == ([len(qts)] if one_format else [1] * len(qts))
    for w, qt, g in zip(ws, qts, got):
        for t in range(3):
            np.testing.assert_array_equal(g[t], K.matvec(w, qt, X[t]), err_msg=f"{qt.name} token {t}")
