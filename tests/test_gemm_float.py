"""kernels_cpu.gemm_float (the vision encoders' float GEMM) against float64 numpy."""
import numpy as np
import pytest

from edgeinfer import kernels_cpu
from edgeinfer.kernels_cpu import gemm_float


def _with_threads(n, fn):
    old = kernels_cpu.get_threads()
    kernels_cpu.set_threads(n)
    try:
        return fn()
    finally:
        kernels_cpu.set_threads(old)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_tok,k,n_rows", [(1, 8, 1), (5, 12, 7), (97, 72, 13), (130, 264, 50)])
@pytest.mark.parametrize("threads", [1, 2])
def test_products_match_float64(dtype, n_tok, k, n_rows, threads, monkeypatch):
    monkeypatch.setattr(gemm_float, "CHUNK_VALUES", 5 * k)   # several chunks a thread, a short last one
    rng = np.random.default_rng(n_tok * k + n_rows)
    w = rng.standard_normal((n_rows, k)).astype(dtype)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    got = _with_threads(threads, lambda: gemm_float.gemm(w, x))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (n_tok, n_rows) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(want).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_bias_gives_the_bits_of_a_separate_add(dtype, threads, monkeypatch):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((50, 264)).astype(dtype)
    x = rng.standard_normal((130, 264)).astype(np.float32)
    bias = rng.standard_normal(50).astype(np.float32)
    monkeypatch.setattr(gemm_float, "CHUNK_VALUES", 9 * 264)
    plain, biased = _with_threads(threads, lambda: (gemm_float.gemm(w, x), gemm_float.gemm(w, x, bias=bias)))
    np.testing.assert_array_equal(biased, plain + bias)


@pytest.mark.parametrize("w,x,bias", [(np.zeros((3, 16), np.float32), np.zeros((2, 8), np.float32), None),
                                      (np.zeros((3, 16), np.int8), np.zeros((2, 16), np.float32), None),
                                      (np.zeros((3, 16), np.float32), np.zeros((2, 16), np.float32),
                                       np.zeros(2, np.float32))])
def test_shapes_and_types_it_cannot_take_are_refused(w, x, bias):
    with pytest.raises(ValueError, match="gemm"):
        gemm_float.gemm(w, x, bias=bias)


def test_numpy_blas_is_kept_to_one_thread_beside_ours(monkeypatch):
    # each of our worker threads calls BLAS: with BLAS threads of its own the cores run
    # threads x BLAS threads (the encoder alone, with no text model's backend to limit it)
    from threadpoolctl import threadpool_info, threadpool_limits

    from edgeinfer.kernels_cpu import threads

    monkeypatch.setattr(threads, "_blas_limited", False)
    with threadpool_limits(2, user_api="blas"):
        gemm_float.gemm(np.ones((16, 8), np.float16), np.ones((4, 8), np.float32))
        blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
        assert blas and set(blas) == {1}, blas


def test_called_from_a_worker_thread_it_runs_there_instead_of_waiting_on_the_pool():
    # every worker busy waiting on pieces queued behind it would hang; 2 workers, 2 calls
    from edgeinfer.kernels_cpu.threads import worker_pool

    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 16)).astype(np.float16)
    x = rng.standard_normal((80, 16)).astype(np.float32)
    want = _with_threads(2, lambda: gemm_float.gemm(w, x))
    got = _with_threads(2, lambda: list(worker_pool(2).map(lambda _: gemm_float.gemm(w, x), range(2))))
    for g in got:
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
