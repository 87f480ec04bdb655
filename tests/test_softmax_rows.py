"""kernels_cpu.softmax_rows against float64 numpy: the vision encoders' softmax."""
import numpy as np
import pytest
from numba import njit

from edgeinfer.kernels_cpu.ggml_math import ggml_expf_any
from edgeinfer.kernels_cpu.softmax_rows import exp_nonpositive, exp_rows


@njit
def _both(xs):
    ours, ggml = np.empty_like(xs), np.empty_like(xs)
    for i in range(xs.shape[0]):
        ours[i] = exp_nonpositive(xs[i])
        ggml[i] = ggml_expf_any(xs[i])
    return ours, ggml


def test_exp_is_ggml_v_expf_bit_for_bit_on_nonpositive_inputs():
    xs = -np.linspace(0, 87, 300001).astype(np.float32)
    ours, ggml = _both(xs)
    np.testing.assert_array_equal(ours, ggml)


@pytest.mark.parametrize("n", [1, 7, 8, 77, 4096])
def test_rows_are_softmax_weights_and_their_sums(n):
    rng = np.random.default_rng(n)
    s = (rng.standard_normal((5, n)) * 20).astype(np.float32)
    s[0, 0] = -1e30                      # a key far below the rest: weight 0, no NaN
    s[1, :] = 3.0                        # all equal: every weight 1
    scale = np.float32(0.125)
    got, sums = s.copy(), np.empty(5, np.float32)
    exp_rows(got, scale, sums)
    x = s.astype(np.float64) * float(scale)
    want = np.exp(x - x.max(axis=1, keepdims=True))
    # the argument is rounded to float32 as ggml rounds it: ~|x| 2^-24 relative in the weight
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-30)
    np.testing.assert_allclose(sums, want.sum(axis=1), rtol=1e-5)
    assert np.all(got[1] == 1.0)
