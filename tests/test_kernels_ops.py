"""Float kernels (RMSNorm, RoPE, attention) against float64 numpy references.

Tolerances: the kernels compute in float32 (norm sums in float64); errors are a few
float32 ulps of the magnitudes involved, so we allow 1e-5 relative (2e-5 for attention,
whose exp and sums over up to ~100 keys accumulate a little more).
"""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.kernels_cpu import ops
from edgeinfer.kernels_cpu.reference import reference_attention, reference_rms_norm, reference_rope


def test_rms_norm():
    rng = np.random.default_rng(0)
    for shape in [(1, 640), (7, 3, 256), (5, 33)]:
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        got = ops.rms_norm(x, w, 1e-6)
        ref = reference_rms_norm(x, w, 1e-6)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    out = np.empty((5, 33), np.float32)
    assert ops.rms_norm(x, w, 1e-6, out) is out


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_rope(mode):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 4, 64)).astype(np.float32)
    pos = np.array([0, 1, 2, 17, 500, 32000])
    for n_dims, factors, scale in [(64, None, 1.0), (32, None, 0.25), (64, rng.uniform(1, 8, 32), 1.0)]:
        ref = reference_rope(x, pos, 10000.0, mode, n_dims, scale, factors)
        got = ops.rope_inplace(x.copy(), pos, 10000.0, mode, n_dims, scale, factors)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(x).max())
        if n_dims < 64:
            np.testing.assert_array_equal(got[..., n_dims:], x[..., n_dims:])


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 30.0)])
def test_attention(window, softcap):
    rng = np.random.default_rng(2)
    n_head, n_kv, hd, hdv = 8, 2, 32, 48
    S = 40
    kpos = np.arange(S)
    for qpos in (np.array([39]), np.arange(30, 40), np.array([3, 0, 39])):
        q = rng.standard_normal((len(qpos), n_head, hd)).astype(np.float32)
        k = rng.standard_normal((S, n_kv, hd)).astype(np.float32)
        v = rng.standard_normal((S, n_kv, hdv)).astype(np.float32)
        got = ops.attention(q, k, v, kpos, qpos, hd ** -0.5, window, softcap)
        ref = reference_attention(q, k, v, kpos, qpos, hd ** -0.5, window, softcap)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.abs(v).max())


def test_attention_query_seeing_no_key_is_zero():
    q = np.ones((1, 2, 8), np.float32)
    k = np.ones((3, 1, 8), np.float32)
    got = ops.attention(q, k, k, np.array([5, 6, 7]), np.array([2]), 0.3)
    assert np.all(got == 0)
