"""kernels_cpu/expf_glibc.expf against the C library's expf, every float32 of the range the
flash-attention weights use (and a sample of positive ones)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from edgeinfer.kernels_cpu.expf_glibc import expf


@njit(parallel=True, cache=True)
def _mismatches(xs):
    bad = 0
    for i in prange(xs.shape[0]):
        x = xs[i]
        if expf(x) != np.float32(math.exp(x)):   # float32 math.exp: the library's expf
            bad += 1
    return bad


def _floats(lo_bits: int, hi_bits: int, negative: bool) -> np.ndarray:
    u = np.arange(lo_bits, hi_bits, dtype=np.uint32)
    return (u | np.uint32(0x80000000) if negative else u).view(np.float32)


def test_every_negative_float_down_to_underflow_matches_libm():
    # -0 .. -110 (past -103.97, where both give 0), in slices of 2^26 values
    bad = sum(_mismatches(_floats(a, min(a + (1 << 26), 0x42DC0000), True))
              for a in range(0, 0x42DC0000, 1 << 26))
    assert bad == 0


def test_positive_floats_below_88_and_the_edges_match_libm():
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.uniform(0, 88, 1 << 22).astype(np.float32),
                         np.array([0.0, -0.0, -np.inf, -103.97, -87.5, 1e-30, -1e-30], np.float32)])
    assert _mismatches(xs) == 0
    assert expf(np.float32(-np.inf)) == 0.0 and expf(np.float32(0.0)) == 1.0
