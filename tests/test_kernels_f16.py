"""kernels_cpu/f16.py against numpy's float16 conversions, bit for bit."""
from __future__ import annotations

import numpy as np

from edgeinfer.kernels_cpu import f16

# around every F16 boundary: zero, the subnormal range and its rounding ties, the
# normal/subnormal edge, the largest finite value and the overflow tie, inf and NaN
EDGES = np.array([0, 1, 0x007FFFFF, 0x32FFFFFF, 0x33000000, 0x33000001, 0x33800000, 0x33C00000,
                  0x387FEFFF, 0x387FF000, 0x387FFFFF, 0x38800000, 0x38801000, 0x38803000,
                  0x3F800000, 0x3F801000, 0x3F803000, 0x477FE000, 0x477FEFFF, 0x477FF000,
                  0x47800000, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF], np.uint32)


def _inputs():
    rng = np.random.default_rng(0)
    sweep = np.arange(0x32F00000, 0x47900000, 1013, dtype=np.uint32)   # every F16 exponent
    bits = np.concatenate([EDGES, sweep, rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)])
    return np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)


def test_to_f16_bits_and_round_equal_numpy():
    x = _inputs()
    with np.errstate(all="ignore"):
        ref = x.astype(np.float16)
    got = f16.to_f16_bits(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], ref.view(np.uint16)[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()
    r = f16.round_f16(x.reshape(-1, 2))                     # any shape
    assert r.shape == (x.size // 2, 2)
    np.testing.assert_array_equal(r.reshape(-1)[~nan].view(np.uint32), ref.astype(np.float32)[~nan].view(np.uint32))


def test_f16_to_f32_equals_numpy_for_every_f16():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    got, ref = f16.f16_to_f32(h), h.astype(np.float32)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()
