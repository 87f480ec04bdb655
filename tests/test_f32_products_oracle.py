"""kernels_cpu.f32_ggml against the oracle's own ggml_mul_mat (F32 x F32), bit for bit.

The shapes cover what decides ggml's path: k a multiple of its vector or not (tinyBLAS or
vec_dot_f32), the matrix's row count a multiple of 4 or not (tinyBLAS declines other counts:
a one-row gate such as qwen35moe's shared-expert gate), one token or several, and every
leftover length of vec_dot_f32 (its tail: whole vectors of products rounded on their own,
then half a vector, then fused multiply-adds, as GCC compiled llama.cpp's builds)."""
from __future__ import annotations

import ggml_flash_oracle as gfo
import numpy as np
import pytest
from ggml_lib import oracle_ggml, our_mul_mat

from edgeinfer.kernels_cpu import f32_ggml

_F32 = 0   # GGML_TYPE_F32


def _ggml_product(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """ggml_mul_mat(w (rows, k), x (n, k)) -> (n, rows), on 2 threads."""
    return gfo.mul_mat(oracle_ggml(), w, x, _F32)


def _ours(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return our_mul_mat(f32_ggml, w, x)


@pytest.mark.parametrize("rows,k", [(8, 64), (8, 256), (1, 64), (1, 2048), (6, 100), (128, 2048), (12, 48)])
@pytest.mark.parametrize("n", [1, 2, 3, 10])
def test_f32_products_are_ggml_s(rows, k, n):
    rng = np.random.default_rng(rows * 1000 + k + n)
    w = rng.standard_normal((rows, k)).astype(np.float32)
    x = rng.standard_normal((n, k)).astype(np.float32)
    np.testing.assert_array_equal(_ours(w, x), _ggml_product(w, x))


def test_every_vec_dot_leftover_length():
    rng = np.random.default_rng(0)
    for k in range(64, 128 + 1):
        w = rng.standard_normal((3, k)).astype(np.float32)
        x = rng.standard_normal((1, k)).astype(np.float32)
        np.testing.assert_array_equal(_ours(w, x), _ggml_product(w, x), err_msg=f"k={k}")


@pytest.mark.parametrize("rows,k", [(8, 64), (12, 48), (6, 100), (128, 2048), (8, 40)])
@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_f16_products_are_ggml_s(rows, k, n):
    # an F16 matrix times float32 tokens: ggml rounds the tokens to F16, then tinyBLAS (F16
    # tiles; k a multiple of its vector, rows of 4, two tokens or more) or vec_dot_f16
    rng = np.random.default_rng(rows * 1000 + k + n)
    w = rng.standard_normal((rows, k)).astype(np.float16)
    x = rng.standard_normal((n, k)).astype(np.float32)
    want = gfo.mul_mat(oracle_ggml(), w, x, 1, b_type=_F32)
    got = f32_ggml.matmul_f16(w, x.astype(np.float16).astype(np.float32), np.empty((n, rows), np.float32))
    np.testing.assert_array_equal(got, want)
