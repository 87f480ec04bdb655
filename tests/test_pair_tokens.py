"""pair_tokens: a short batch two tokens a 512-bit vector, each (row, token) with matvec's bits.

The packing is checked against numpy everywhere; the kernels where the CPU the tests compile
for has 512-bit VNNI (elsewhere matvec never routes to them)."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from edgeinfer.kernels_cpu import dispatch, pair_tokens
from quant_blocks import random_blocks

MATVEC = importlib.import_module("edgeinfer.kernels_cpu.matvec")
TYPES = [T.Q8_0, T.Q4_0, T.Q5_0, T.IQ4_NL]
needs_pairs = pytest.mark.skipif(not pair_tokens.host_has_pairs(),
                                 reason="the pair kernels need 512-bit VNNI on the CPU the tests compile for")


@pytest.mark.parametrize("n_tok", [1, 2, 5])
def test_pack_lays_out_pairs_scales_and_offset_starts(n_tok):
    rng = np.random.default_rng(n_tok)
    xq = rng.integers(-127, 128, (n_tok, 96), dtype=np.int8)
    xd = rng.uniform(0.01, 2, (n_tok, 3)).astype(np.float32)
    xq2, dx2, (c2, c8) = pair_tokens.packed(xq, xd, [int(T.Q5_0), int(T.Q8_0)])
    n_pairs = (n_tok + 1) // 2
    assert xq2.shape == (n_pairs, 192) and dx2.shape == c2.shape == (n_pairs, 48)
    padded = np.zeros((2 * n_pairs, 96), np.int8)
    padded[:n_tok] = xq
    scales = np.zeros((2 * n_pairs, 3), np.float32)
    scales[:n_tok] = xd
    blocks = padded.reshape(n_pairs, 2, 3, 32)   # pair, half, block, byte
    np.testing.assert_array_equal(xq2.reshape(n_pairs, 3, 2, 32), blocks.transpose(0, 2, 1, 3))
    fours = blocks.astype(np.int32).reshape(n_pairs, 2, 3, 8, 4).sum(-1)
    np.testing.assert_array_equal(c2.reshape(n_pairs, 3, 2, 8), -16 * fours.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(c8, c2 * 8)   # Q8_0's codes are value + 128
    np.testing.assert_array_equal(dx2.reshape(n_pairs, 3, 2, 8),
                                  np.repeat(scales.reshape(n_pairs, 2, 3).transpose(0, 2, 1)[..., None], 8, -1))


@needs_pairs
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [2, 3, 5, 8, 11, 13, 17])   # 1, 2, 3 and 4 pairs a loop, odd counts padded
def test_each_token_has_matvecs_bits(qt, n_tok):
    rng = np.random.default_rng(int(qt) * 100 + n_tok)
    n_rows = 37   # not a whole number of claims
    w = random_blocks(qt, n_rows, 640, rng)
    w.flags.writeable = False
    X = rng.standard_normal((n_tok, 640)).astype(np.float32) * rng.uniform(0.01, 10, (n_tok, 1)).astype(np.float32)
    xq, xd, _ = MATVEC.quantize_activation_rows(X, MATVEC.quant_info(qt))
    got = np.full((n_tok, n_rows), np.nan, np.float32)
    dispatch.matmul_pairs([w], [int(qt)], xq, xd, [got])
    for t in range(n_tok):
        np.testing.assert_array_equal(got[t], K.matvec(w, qt, X[t]), err_msg=f"token {t}")


@needs_pairs
def test_three_matrices_of_mixed_types_in_one_region():
    # Q, K, V as Gemma 3's files mix them: Q5_0, Q5_0 and Q8_0, one packing, each its own starts
    rng = np.random.default_rng(7)
    qts = [T.Q5_0, T.Q5_0, T.Q8_0]
    ws = [random_blocks(qt, n, 640, rng) for qt, n in zip(qts, (64, 16, 16))]
    for w in ws:
        w.flags.writeable = False
    X = rng.standard_normal((5, 640)).astype(np.float32)
    with K.decode_order():
        got = MATVEC.matmul_many(ws, qts, X)
    for w, qt, g in zip(ws, qts, got):
        for t in range(5):
            np.testing.assert_array_equal(g[t], K.matvec(w, qt, X[t]), err_msg=f"{qt.name} token {t}")


@needs_pairs
def test_decode_order_batches_take_the_pairs(monkeypatch):
    calls = []
    real = dispatch.matmul_pairs
    monkeypatch.setattr(dispatch, "matmul_pairs", lambda *a: calls.append(a[1][0]) or real(*a))
    rng = np.random.default_rng(3)
    w = random_blocks(T.Q8_0, 64, 256, rng)
    w.flags.writeable = False
    X = rng.standard_normal((4, 256)).astype(np.float32)
    with K.decode_order():
        got = K.matmul(w, T.Q8_0, X)
    assert calls == [int(T.Q8_0)]
    np.testing.assert_array_equal(got[3], K.matvec(w, T.Q8_0, X[3]))
    K.matmul(w, T.Q8_0, X[:1])   # one token: the decode row kernel
    assert calls == [int(T.Q8_0)]
