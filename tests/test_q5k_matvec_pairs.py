"""The Q5_K decode matvec (four rows a loop, heads in pairs on AVX2: dot_kquant's
_q5_k_rows4_block_256) against a numpy re-derivation of ggml_vec_dot_q5_K's order: per row
8 float lanes, lane i of block b taking the exact integer sum_j scale_j * (elements 4i..4i+3
of sub-block j . x) and min_i * (sub-block i's activation sum), acc = fma(d dx, I, acc) then
acc = fma(-(dmin dx), M, acc); at the end lanes 0-3 plus 4-7, then the pairs, then the two."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from quant_blocks import f16_values, fma_f32, hsum8, q4k_scales_mins, random_blocks


def _codes(B):
    """(n, 176) blocks -> (n, 8, 32) 5-bit codes of sub-blocks 0..7."""
    n = B.shape[0]
    qh = B[:, 16:48].astype(np.int64)
    qs = B[:, 48:].astype(np.int64).reshape(n, 4, 32)
    lo = np.stack([qs & 15, qs >> 4], axis=2).reshape(n, 8, 32)       # sub-block 2c, 2c + 1
    hb = np.stack([(qh >> j) & 1 for j in range(8)], axis=1)           # bit j of qh[l]: sub-block j
    return lo | (hb << 4)


def _reference(w, x):
    xq, xd, xs = K.quantize_activations(x, K.quant_info(T.Q5_K))
    n = w.shape[0]
    blocks = w.reshape(n, -1, 176)
    acc = np.zeros((n, 8), np.float32)
    for b in range(blocks.shape[1]):
        B = blocks[:, b]
        d = (f16_values(B[:, 0:2]) * np.float32(xd[b])).astype(np.float32)
        dmin = (f16_values(B[:, 2:4]) * np.float32(xd[b])).astype(np.float32)
        scales, mins = q4k_scales_mins(B[:, 4:16])
        q = _codes(B)
        xb = xq[256 * b: 256 * b + 256].astype(np.int64).reshape(8, 32)
        prod = (q * xb[None]).reshape(n, 8, 8, 4).sum(-1)                 # (row, sub-block, lane)
        isum = (prod * scales[:, :, None]).sum(1)                          # lane i: elements 4i..4i+3
        msum = mins * xs[16 * b: 16 * b + 16].astype(np.int64).reshape(8, 2).sum(-1)[None]
        acc = fma_f32(d[:, None], isum.astype(np.float32), acc)
        acc = fma_f32(-dmin[:, None], msum.astype(np.float32), acc)
    return hsum8(acc)


@pytest.mark.parametrize("n_rows,n_cols", [(4, 256), (8, 256), (24, 2048), (42, 14336), (137, 512)])
def test_rows_follow_ggml_vec_dot_q5_k(n_rows, n_cols):
    # 42 and 137 rows leave rows outside the quartered loop and a partial work chunk; rows a
    # quarter of the matrix apart run together, so every row's slot must land on its own output
    rng = np.random.default_rng(n_rows)
    w = random_blocks(T.Q5_K, n_rows, n_cols, rng)
    for scale in (0.01, 1.0, 300.0):
        x = (rng.standard_normal(n_cols) * scale).astype(np.float32)
        np.testing.assert_array_equal(K.matvec(w, T.Q5_K, x), _reference(w, x))


def test_largest_partial_sums_stay_exact():
    # every code 31 and every scale and min 63 against activations -128 (x constant: its
    # quantized values are -128): vpmaddubsw pairs at 2*31*(-128), no saturation
    rng = np.random.default_rng(3)
    w = np.full((16, 1024 // 256, 176), 0xFF, np.uint8)
    w[:, :, 0:4] = rng.uniform(-1, 1, (16, 1024 // 256, 2)).astype(np.float16).view(np.uint8)
    w = w.reshape(16, -1)
    for x in (np.ones(1024, np.float32), -np.ones(1024, np.float32),
              np.where(np.arange(1024) % 2 == 0, 1.0, -1.0).astype(np.float32)):
        xq = K.quantize_activations(x, K.quant_info(T.Q5_K))[0]
        assert np.abs(xq.astype(np.int64)).max() >= 127
        np.testing.assert_array_equal(K.matvec(w, T.Q5_K, x), _reference(w, x))


def test_each_row_and_lane_gets_its_own_result():
    # one element's fifth bit set in one row: only that row's output changes, whichever
    # slot of the four rows a loop and half of a head pair it sits in
    rng = np.random.default_rng(7)
    w = random_blocks(T.Q5_K, 32, 512, rng)
    w[:, 16:48] = 0
    w[:, 176 + 16:176 + 48] = 0
    x = rng.standard_normal(512).astype(np.float32)
    base = K.matvec(w, T.Q5_K, x)
    np.testing.assert_array_equal(base, _reference(w, x))
    for r in range(32):
        w2 = w.copy()
        j, l = r % 8, (5 * r) % 32
        w2[r, 16 + l] |= np.uint8(1 << j)      # element l of sub-block j gains 16
        got = K.matvec(w2, T.Q5_K, x)
        assert list(np.flatnonzero(got != base)) == [r], r
        np.testing.assert_array_equal(got, _reference(w2, x))
