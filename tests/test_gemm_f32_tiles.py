"""kernels_cpu.gemm_f32_tiles (the vision encoders' float GEMM) against float64 numpy."""
import numpy as np
import pytest

from edgeinfer import kernels_cpu
from edgeinfer.kernels_cpu import gemm_f32_tiles


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_tok,k,n_rows", [(1, 8, 1), (5, 16, 7), (97, 72, 13), (130, 264, 50)])
@pytest.mark.parametrize("threads", [1, 2])
def test_products_match_float64(dtype, n_tok, k, n_rows, threads, monkeypatch):
    monkeypatch.setattr(gemm_f32_tiles, "TOKEN_BLOCK", 48)   # 97 and 130 tokens: partial blocks
    rng = np.random.default_rng(n_tok * k + n_rows)
    w = rng.standard_normal((n_rows, k)).astype(dtype)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    old = kernels_cpu.get_threads()
    kernels_cpu.set_threads(threads)
    try:
        got = gemm_f32_tiles.gemm(w, x)
    finally:
        kernels_cpu.set_threads(old)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (n_tok, n_rows) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(want).max())


def test_a_given_output_buffer_is_filled_whole():
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((10, 24)).astype(np.float32), rng.standard_normal((9, 24)).astype(np.float32)
    out = np.full((9, 10), np.nan, np.float32)
    assert gemm_f32_tiles.gemm(w, x, out) is out
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("w,x", [(np.zeros((3, 12), np.float32), np.zeros((2, 12), np.float32)),
                                 (np.zeros((3, 16), np.float32), np.zeros((2, 8), np.float32)),
                                 (np.zeros((3, 16), np.int8), np.zeros((2, 16), np.float32))])
def test_shapes_and_types_it_cannot_take_are_refused(w, x):
    with pytest.raises(ValueError, match="gemm"):
        gemm_f32_tiles.gemm(w, x)
