"""The prefill's 8-bit tile kernels (kernels_cpu/tile_gemm.py) against numpy.

Bound as in test_kernels_quant: against dequantize(W) @ X_q, with X_q the activations
rounded exactly as the kernels quantize them, only the float order differs.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from edgeinfer.kernels_cpu import tile_gemm
from edgeinfer.kernels_cpu.reference import reference_quantize_act
from quant_blocks import random_blocks

MATVEC = importlib.import_module("edgeinfer.kernels_cpu.matvec")
TILE_TYPES = [T(t) for t in tile_gemm.TILE_TYPES]


def _check(Y, w, qtype, X):
    W = K.reference_dequantize(w, qtype).astype(np.float64)
    Xq = np.stack([reference_quantize_act(x, 32) for x in X])
    tol = 2e-5 * (np.abs(Xq) @ np.abs(W).T) + 1e-30
    assert np.all(np.abs(Y - Xq @ W.T) <= tol), qtype.name


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows,n_tok", [(103, 70), (4, 16), (1, 1), (9, 33)])
def test_tiles_match_reference(qtype, n_rows, n_tok):
    # rows past the last whole 4-row tile run 1-row tiles; tokens pad to 16 with zeros
    rng = np.random.default_rng(n_rows * 100 + n_tok)
    w = random_blocks(qtype, n_rows, 768, rng)   # whole Q4_K blocks
    w.flags.writeable = False
    X = (rng.standard_normal((n_tok, 768)) * 3).astype(np.float32)
    out = np.full((n_tok, n_rows), np.nan, np.float32)
    tile_gemm.matmul_rows(w, int(qtype), 0, n_rows, tile_gemm.pack_activations(X), out)
    _check(out, w, qtype, X)


def test_packing_quantizes_as_matvec():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((21, 96)).astype(np.float32)
    xp, dxp, xsp, xhp = tile_gemm.pack_activations(X)
    xq, xd, xs = MATVEC.quantize_activation_rows(X, K.quant_info(T.Q8_0))
    assert xp.shape == (4, 3 * 256) and dxp.shape == xsp.shape == (4, 3 * 8)   # 21 tokens -> 4 x 8
    lanes = xp.reshape(4, 3, 8, 8, 4).transpose(0, 3, 1, 2, 4).reshape(32, 96)  # [g, j] -> token
    np.testing.assert_array_equal(lanes[:21], xq)
    assert not lanes[21:].any()
    np.testing.assert_array_equal(dxp.reshape(4, 3, 8).transpose(0, 2, 1).reshape(32, 3)[:21], xd)
    np.testing.assert_array_equal(xsp.reshape(4, 3, 8).transpose(0, 2, 1).reshape(32, 3)[:21], -xs)
    halves = xq.reshape(21, 3, 2, 16).sum(axis=-1)[:, :, 0]
    np.testing.assert_array_equal(xhp.reshape(4, 3, 8).transpose(0, 2, 1).reshape(32, 3)[:21], -halves)


@pytest.mark.skipif(not tile_gemm.has_vnni(), reason="matmul takes the tiles only on a CPU with VNNI")
def test_matmul_many_shares_one_packing():
    rng = np.random.default_rng(2)
    qts = [T.Q5_0, T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K]
    ws = [random_blocks(qt, n, 256, rng) for qt, n in zip(qts, (64, 18, 7, 12, 9))]
    X = rng.standard_normal((100, 256)).astype(np.float32)
    many = K.matmul_many(ws, qts, X)
    for w, qt, y in zip(ws, qts, many):
        np.testing.assert_array_equal(y, K.matmul(w, qt, X))   # rows are independent
        _check(y, w, qt, X)
    with pytest.raises(ValueError, match="expected"):
        K.matmul_many(ws, qts, X[:, :128])
