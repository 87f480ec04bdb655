"""The C library's expf over an array. ggml calls libm's expf in its scalar tails (softmax
past the last 8 lanes, attention sinks, swiglu_oai); glibc's expf is not correctly rounded
in every case, so exp in double rounded to float32 differs from it in ~1 value in 1,500."""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _expf_kernel(x, out):
    for i in range(x.shape[0]):
        out[i] = math.exp(x[i])  # float32 math.exp lowers to a call of the C library's expf


def expf(x) -> np.ndarray:
    """libm expf of every element of x (float32, any shape)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _expf_kernel(x.reshape(-1), out.reshape(-1))
    return out


@njit(cache=True, nogil=True)
def _tanhf_kernel(x, out):
    for i in range(x.shape[0]):
        out[i] = math.tanh(x[i])  # float32 math.tanh lowers to the C library's tanhf


def tanhf(x) -> np.ndarray:
    """libm tanhf of every element of x (float32, any shape): ggml's attention softcap."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _tanhf_kernel(x.reshape(-1), out.reshape(-1))
    return out
