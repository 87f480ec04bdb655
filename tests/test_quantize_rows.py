"""The activation quantization of a prompt's rows (quant_kernels.quantize_rows_*): the
integer-max search and the parallel rows keep the float reference's values."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.kernels_cpu import quant_kernels as qk
from edgeinfer.kernels_cpu.reference import reference_quantize_act


def _rows(block: int, n_tok: int, n: int, rng):
    X = rng.standard_normal((n_tok, n)).astype(np.float32) * rng.uniform(1e-3, 50, (n_tok, 1)).astype(np.float32)
    X[1, :block] = 0.0                       # an all-zero block
    X[2, 3] = -np.abs(X[2, :block]).max() * 3   # the largest magnitude negative...
    X[2, 9] = -X[2, 3]                       # ...and tied by a positive one after it (the first wins)
    X[3, 5:9] = np.float32(1e-38)            # subnormals beside normal values
    return X


@pytest.mark.parametrize("block", [32, 256])
def test_parallel_and_serial_rows_equal_the_reference(block):
    rng = np.random.default_rng(block)
    n_tok, n = 40, 1024
    X = _rows(block, n_tok, n, rng)
    outs = []
    for fn in ((qk.quantize_rows_q8_0, qk.quantize_rows_q8_0_parallel) if block == 32
               else (qk.quantize_rows_q8_k, qk.quantize_rows_q8_k_parallel)):
        xq = np.empty((n_tok, n), np.int8)
        xd = np.empty((n_tok, n // block), np.float32)
        xs = np.empty((n_tok, n // (32 if block == 32 else 16)), np.int32)
        fn(X, xq, xd, xs)
        outs.append((xq, xd, xs))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    xq, xd, xs = outs[0]
    group = 32 if block == 32 else 16
    np.testing.assert_array_equal(xs, xq.reshape(n_tok, -1, group).sum(axis=2, dtype=np.int32))
    for t in range(n_tok):
        got = (xq[t].reshape(-1, block).astype(np.float64) * xd[t][:, None].astype(np.float64)).ravel()
        np.testing.assert_array_equal(got, reference_quantize_act(X[t], block))


@pytest.mark.parametrize("block", [32, 256])
def test_a_nan_never_sets_the_scale(block):
    # ggml's `if (ax > amax)` skips a NaN: the block's other values keep their scale
    rng = np.random.default_rng(7)
    x = rng.standard_normal(block).astype(np.float32)
    clean = x.copy()
    x[4] = np.nan
    clean[4] = 0.0
    q, d = [], []
    for v in (x, clean):
        xq, xd = np.empty(block, np.int8), np.empty(1, np.float32)
        xs = np.empty(block // (32 if block == 32 else 16), np.int32)
        (qk.quantize_q8_0(v, xq, xd, xs, 32) if block == 32 else qk.quantize_q8_k(v, xq, xd, xs, 16))
        q.append(np.delete(xq, 4))
        d.append(xd[0])
    assert d[0] == d[1]
    np.testing.assert_array_equal(q[0], q[1])
