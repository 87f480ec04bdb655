"""The compiled float ops (kernels_cpu/ops.py) against Backend's numpy ops, which spell out
llama.cpp's rounding order: equal bit for bit. The numpy ops themselves are checked
against float64 math here (up to float32 accuracy), so neither can drift unnoticed."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.backend import Backend, _gelu_f16_table
from edgeinfer.kernels_cpu import ops
from edgeinfer.kernels_cpu.reference import reference_rms_norm, reference_rope
from edgeinfer.models.base import ROPE_NEOX, ROPE_NORM


class _Vectors(Backend):
    """Backend with its weight vectors given directly (no GGUF file)."""

    def __init__(self, vectors):
        super().__init__(None)
        self._vectors = dict(vectors)


def test_rms_norm_is_bit_exact_and_correct():
    rng = np.random.default_rng(0)
    for shape in [(1, 640), (7, 3, 256), (5, 33)]:
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        got = ops.rms_norm(x, w, 1e-6)
        np.testing.assert_array_equal(got, _Vectors({"w": w}).rms_norm(x, "w", 1e-6))
        ref = reference_rms_norm(x, w, 1e-6)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    out = np.empty((5, 33), np.float32)
    assert ops.rms_norm(x, w, 1e-6, out) is out


@pytest.mark.parametrize("mode", [ROPE_NORM, ROPE_NEOX])
def test_rope_is_bit_exact_and_correct(mode):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 4, 64)).astype(np.float32)
    pos = np.array([0, 1, 2, 17, 500, 32000])
    kernel_mode = "neox" if mode == ROPE_NEOX else "normal"
    for n_dims, factors, scale in [(64, None, 1.0), (32, None, 0.25), (64, rng.uniform(1, 8, 32), 1.0)]:
        vectors = {"ff": factors.astype(np.float32)} if factors is not None else {}
        want = _Vectors(vectors).rope(x, pos, n_dims, 10000.0, scale, mode, "ff" if factors is not None else None)
        got = ops.rope_inplace(x.copy(), pos, 10000.0, kernel_mode, n_dims, scale,
                               None if factors is None else factors.astype(np.float32))
        np.testing.assert_array_equal(got, want)
        # float64 math agrees where float32 angles are accurate (ggml's are not at 32000)
        ref = reference_rope(x, pos, 10000.0, kernel_mode, n_dims, scale, factors)
        np.testing.assert_allclose(got[:5], ref[:5], rtol=1e-4, atol=1e-4 * np.abs(x).max())
        if n_dims < 64:
            np.testing.assert_array_equal(got[..., n_dims:], x[..., n_dims:])


def test_gelu_mul_is_bit_exact_and_correct():
    rng = np.random.default_rng(2)
    gate = np.concatenate([rng.standard_normal(3000) * 4, [-12.0, 12.0, -10.0, 10.0, 0.0]]).astype(np.float32)
    up = rng.standard_normal(gate.shape).astype(np.float32)
    got = ops.gelu_mul(gate, up, _gelu_f16_table())
    np.testing.assert_array_equal(got, Backend(None).gelu_mul(gate, up))
    g64 = gate.astype(np.float64)
    gelu = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * g64 * (1 + 0.044715 * g64 ** 2)))
    np.testing.assert_allclose(got, gelu * up, atol=2e-3 * np.abs(gelu * up).max())
