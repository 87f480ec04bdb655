"""The compiled float ops (kernels_cpu/ops.py) against Backend's numpy ops, which spell out
llama.cpp's rounding order: equal bit for bit. The numpy ops themselves are checked
against float64 math here (up to float32 accuracy), so neither can drift unnoticed."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.backends.base import Backend, _gelu_f16_table
from edgeinfer.kernels_cpu import ops
from edgeinfer.kernels_cpu.f16 import f16_to_f32, round_f16
from edgeinfer.kernels_cpu.reference import reference_rms_norm, reference_rope
from edgeinfer.kernels_cpu.threads import PARALLEL_MIN
from edgeinfer.rope import ROPE_NEOX, ROPE_NORM


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


def test_gelu_is_gelu_mul_without_its_up_half():
    # the vision encoders' MLP: ggml's GELU table, identity from 10, zero from -10
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(3000) * 6, [-12.0, 12.0, -10.0, 10.0, 0.0]]).astype(np.float32)
    got = ops.gelu(x, _gelu_f16_table())
    np.testing.assert_array_equal(got, Backend(None).gelu_mul(x, np.ones_like(x)))
    assert got[-5:].tolist() == [0.0, 12.0, 0.0, 10.0, 0.0]


def test_gelu_in_place_gives_the_same_bits_and_refuses_a_wrong_out():
    # the vision MLP overwrites its up product (300 x 1001: prefill-sized, split over threads)
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((300, 1001)) * 6).astype(np.float32)
    want = ops.gelu(x, _gelu_f16_table())
    y = x.copy()
    assert ops.gelu(y, _gelu_f16_table(), out=y) is y
    np.testing.assert_array_equal(y, want)
    with pytest.raises(ValueError, match="out"):
        ops.gelu(x, _gelu_f16_table(), out=np.empty((300, 1000), np.float32))


def _ggml_v_expf_avx2(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf's AVX2 code transcribed literally, bit tricks and all three ranges
    (an independent check of the closed form `ggml_expf_any` uses)."""
    from edgeinfer.kernels_cpu import ggml_math as gm

    def fma(a, b, c):
        return (np.asarray(a, np.float64) * b + c).astype(np.float32)

    def bits(v):
        return np.asarray(v, np.float32).view(np.uint32)

    def flt(u):
        return np.asarray(u, np.uint32).view(np.float32)

    x = x.astype(np.float32)
    with np.errstate(all="ignore"):
        z = fma(x, gm.LOG2E, gm.R)
        n = (z - gm.R).astype(np.float32)
        b = fma(-n, gm.LN2_LO, fma(-n, gm.LN2_HI, x))
        e = (bits(z) << np.uint32(23)).astype(np.uint32)
        k = flt((e + bits(np.float32(1.0))).astype(np.uint32))
        c = np.abs(n) > 126
        u = (b * b).astype(np.float32)
        j = fma(fma(fma(gm.C5, b, gm.C4), u, fma(gm.C3, b, gm.C2)), u, (gm.C1 * b).astype(np.float32))
        g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0)).astype(np.uint32)
        s1 = flt((g + np.uint32(0x7F000000)).astype(np.uint32))
        s2 = flt((e - g).astype(np.uint32))
        d = np.abs(n) > 192
        big = (s1 * s1).astype(np.float32)
        mid = (fma(s2, j, s2) * s1).astype(np.float32)
        small = fma(k, j, k)
    return np.where(d, big, np.where(c, mid, small))


def _ggml_v_expf_avx512(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf's AVX-512 code transcribed literally: the polynomial ends in fma(c1, b, 1),
    then _mm512_scalef_ps (one rounding of j * 2^n), 0 or inf where |n| > 192."""
    from edgeinfer.kernels_cpu import ggml_math as gm

    def fma(a, b, c):
        return (np.asarray(a, np.float64) * b + c).astype(np.float32)

    x = x.astype(np.float32)
    with np.errstate(all="ignore"):
        z = fma(x, gm.LOG2E, gm.R)
        n = (z - gm.R).astype(np.float32)
        b = fma(-n, gm.LN2_LO, fma(-n, gm.LN2_HI, x))
        d = np.abs(n) > 192
        u = (b * b).astype(np.float32)
        j = fma(fma(fma(gm.C5, b, gm.C4), u, fma(gm.C3, b, gm.C2)), u, fma(gm.C1, b, np.float32(1.0)))
        res = np.ldexp(j.astype(np.float64), np.where(d, 0, n).astype(np.int32)).astype(np.float32)
        alt = np.where(n <= 0, np.float32(0.0), np.float32(np.inf))
    return np.where(d, alt, res)


def _ggml_v_expf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf as the llama.cpp build for this CPU computes it."""
    from edgeinfer.kernels_cpu import ggml_math as gm

    return _ggml_v_expf_avx512(x) if gm.AVX512 else _ggml_v_expf_avx2(x)


def test_both_builds_exps_are_close_to_exp():
    # the two transcriptions differ in last bits only: neither may stray from exp
    x = np.linspace(-87, 88, 200001).astype(np.float32)
    want = np.exp(x.astype(np.float64))
    for f in (_ggml_v_expf_avx2, _ggml_v_expf_avx512):
        np.testing.assert_allclose(f(x), want, rtol=4e-7)
    assert np.any(_ggml_v_expf_avx2(x) != _ggml_v_expf_avx512(x))


def test_silu_mul_is_ggml_swiglu_bit_for_bit():
    from edgeinfer.backends.base import ggml_expf_any
    rng = np.random.default_rng(3)
    # ordinary values, and the ranges where exp(-x) is subnormal, zero, huge or inf
    gate = np.concatenate([rng.standard_normal(4000) * 6, rng.uniform(-200, 200, 4000),
                           [0.0, -0.0, 87.0, 88.5, 90.0, 103.0, 104.5, 130.0, -88.0, -88.5, -89.0,
                            -132.0, 1e6, -1e6]]).astype(np.float32)
    up = rng.standard_normal(gate.shape).astype(np.float32)
    np.testing.assert_array_equal(ggml_expf_any(-gate), _ggml_v_expf(-gate))
    got = ops.silu_mul(gate, up)
    np.testing.assert_array_equal(got, Backend(None).silu_mul(gate, up))
    g64 = gate.astype(np.float64)
    with np.errstate(over="ignore"):
        want = g64 / (1.0 + np.exp(-g64)) * up
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30)


def test_prefill_sized_inputs_take_the_parallel_kernels_with_the_same_bits():
    # from PARALLEL_MIN elements the ops run on all threads, in pieces whose edges
    # fall inside rows (300 x 1001 is not a multiple of the piece size)
    rng = np.random.default_rng(4)
    n_tok, n = 300, 1001
    assert n_tok * n >= PARALLEL_MIN
    x = (rng.standard_normal((n_tok, n)) * 3).astype(np.float32)
    y = rng.standard_normal((n_tok, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    np.testing.assert_array_equal(ops.rms_norm(x, w, 1e-6), _Vectors({"w": w}).rms_norm(x, "w", 1e-6))
    np.testing.assert_array_equal(ops.gelu_mul(x, y, _gelu_f16_table()), Backend(None).gelu_mul(x, y))
    np.testing.assert_array_equal(ops.silu_mul(x, y), Backend(None).silu_mul(x, y))
    np.testing.assert_array_equal(ops.gelu(x, _gelu_f16_table()), Backend(None).gelu_mul(x, np.ones_like(x)))
    np.testing.assert_array_equal(ops.layer_norm(x, w, y[0], 1e-6), _layer_norm_ggml(x, w, y[0], 1e-6))
    np.testing.assert_array_equal(round_f16(x), x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(f16_to_f32(x.astype(np.float16)), x.astype(np.float16).astype(np.float32))


def _layer_norm_ggml(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """ggml_norm * w + b, transcribed with numpy: the sum in double in order, the mean
    rounded to float32, centred squares summed a vector at a time (8 lanes, movehl/movehdup;
    AVX-512: 16 lanes, _mm512_reduce_add_ps) into a double."""
    from edgeinfer.kernels_cpu.ggml_math import LANES

    n = x.shape[1]
    body = n - n % LANES
    out = np.empty_like(x)
    for i, row in enumerate(x):
        s = 0.0
        for v in row.tolist():   # in order, in double
            s += v
        mean = np.float32(np.float32(s) / np.float32(n))
        c = (row - mean).astype(np.float32)
        sq = (c * c).astype(np.float32)
        lanes = sq[:body].reshape(-1, LANES)
        if LANES == 16:   # the 256-bit halves first
            lanes = (lanes[:, :8] + lanes[:, 8:]).astype(np.float32)
        t = (lanes[:, :4] + lanes[:, 4:]).astype(np.float32)
        h = ((t[:, 0] + t[:, 2]).astype(np.float32) + (t[:, 1] + t[:, 3]).astype(np.float32)).astype(np.float32)
        ss = 0.0
        for v in h.tolist() + sq[body:].tolist():
            ss += v
        scale = np.float32(1.0) / np.float32(np.sqrt(np.float32(np.float32(ss / n) + np.float32(eps))))
        out[i] = ((c * scale).astype(np.float32) * w).astype(np.float32) + b
    return out


@pytest.mark.parametrize("n", [8, 13, 72, 1152])
def test_layer_norm_is_ggmls_order_bit_for_bit(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((5, n)) * 3 + 1.5).astype(np.float32)
    w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    got = ops.layer_norm(x, w, b, 1e-6)
    np.testing.assert_array_equal(got, _layer_norm_ggml(x, w, b, 1e-6))
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-6) * w + b
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(ops.layer_norm(x, w, None, 1e-6), ops.layer_norm(x, w, np.zeros(n, np.float32), 1e-6))
