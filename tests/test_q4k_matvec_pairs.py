"""The Q4_K decode matvec on rows in eights (two rows a vector on AVX2, dot_q4k_x8) against
a numpy re-derivation of llama.cpp's repacked-gemv order: per block each row's exact
integer dot I and min dot M, acc += (d dx) I and accm += (dmin (-dx)) M in float32, the
row's result acc + accm. The Q4_K_X8 copy must give the same bits."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from edgeinfer.kernels_cpu import repack
from edgeinfer.kernels_cpu.quant_types import RepackedType
from quant_blocks import f16_values, fma_f32, q4k_scales_mins, random_blocks


def _reference(w, x):
    xq, xd, xs = K.quantize_activations(x, K.quant_info(T.Q4_K))
    n = w.shape[0]
    blocks = w.reshape(n, -1, 144)
    acc, accm = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for b in range(blocks.shape[1]):
        B = blocks[:, b]
        d = (np.float32(xd[b]) * f16_values(B[:, 0:2])).astype(np.float32)
        dmin = (np.float32(-xd[b]) * f16_values(B[:, 2:4])).astype(np.float32)
        scales, mins = q4k_scales_mins(B[:, 4:16])
        qs = B[:, 16:].astype(np.int64).reshape(n, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=2).reshape(n, 8, 32)       # sub-block 2c, 2c + 1
        xb = xq[256 * b: 256 * b + 256].astype(np.int64).reshape(8, 32)
        isum = ((q * xb[None]).sum(-1) * scales).sum(-1)
        msum = (mins * xs[16 * b: 16 * b + 16].astype(np.int64).reshape(8, 2).sum(-1)[None]).sum(-1)
        acc = fma_f32(d, isum.astype(np.float32), acc)
        accm = fma_f32(dmin, msum.astype(np.float32), accm)
    return acc + accm


def _extreme_blocks(n_rows, n_cols, rng):
    """Every nibble 15 and every scale and min 63 (the largest i16 partial sums), d and dmin
    random."""
    w = np.full((n_rows, n_cols // 256, 144), 0xFF, np.uint8)
    w[:, :, 0:4] = rng.uniform(-1, 1, (n_rows, n_cols // 256, 2)).astype(np.float16).view(np.uint8)
    return w.reshape(n_rows, -1)


@pytest.mark.parametrize("n_rows,n_cols", [(8, 256), (24, 2048), (40, 14336), (136, 512)])
def test_rows_in_eights_follow_the_repacked_gemv_order(n_rows, n_cols):
    # 24, 40 and 136 rows leave a partial work chunk; rows a quarter of the matrix apart
    # run together, so every row's slot must land on its own output
    rng = np.random.default_rng(n_rows)
    w = random_blocks(T.Q4_K, n_rows, n_cols, rng)
    wx = repack.interleave_q4_k(w)
    for scale in (0.01, 1.0, 300.0):
        x = (rng.standard_normal(n_cols) * scale).astype(np.float32)
        want = _reference(w, x)
        np.testing.assert_array_equal(K.matvec(w, T.Q4_K, x), want)
        np.testing.assert_array_equal(K.matvec(wx, RepackedType.Q4_K_X8, x), want)


def test_largest_partial_sums_stay_exact():
    # nibbles 15 against activations all -128 (x constant: its quantized values are -128):
    # a sub-block's two 16-byte pieces add to 2 * 2*15*(-128) in i16, no saturation
    rng = np.random.default_rng(3)
    w = _extreme_blocks(16, 1024, rng)
    for x in (np.ones(1024, np.float32), -np.ones(1024, np.float32),
              np.where(np.arange(1024) % 2 == 0, 1.0, -1.0).astype(np.float32)):
        xq = K.quantize_activations(x, K.quant_info(T.Q4_K))[0]
        assert np.abs(xq.astype(np.int64)).max() >= 127
        want = _reference(w, x)
        np.testing.assert_array_equal(K.matvec(w, T.Q4_K, x), want)
        np.testing.assert_array_equal(K.matvec(repack.interleave_q4_k(w), RepackedType.Q4_K_X8, x), want)


def test_each_row_gets_its_own_result():
    # one row's weights changed: only that row's output changes, whichever pair and half
    # of a vector it sits in
    rng = np.random.default_rng(7)
    w = random_blocks(T.Q4_K, 32, 512, rng)
    x = rng.standard_normal(512).astype(np.float32)
    base = K.matvec(w, T.Q4_K, x)
    for r in range(32):
        w2 = w.copy()
        w2[r, 16:] = 0          # row r's codes all 0: its I is 0
        got = K.matvec(w2, T.Q4_K, x)
        changed = np.flatnonzero(got != base)
        assert list(changed) == [r], (r, changed)
        np.testing.assert_array_equal(got, _reference(w2, x))
