"""One decoded token's RMSNorm -> SwiGLU MLP -> residual in one compiled call.

Why: a decode layer streams tens of MB of weights, which evicts the caches, so every
Python-level op between two matvecs starts cold: `ops.rms_norm` on 2048 floats takes
~6 us warm and ~70 us right after a 64 MB sweep. Running norm -> matvecs -> activation
-> matvec -> residual as one call leaves one cold entry instead of about eight.
Each step calls the same kernels the op-by-op path calls, in the same order, so the
results are the same bits (tests/test_fused_layer.py). The matvecs are those of the
model's kernel set (dispatch.kernels_for): only the model's types compile.
"""
from __future__ import annotations

from types import FunctionType

import numpy as np
from numba import njit, prange

from . import compile_progress
from . import quant_kernels as qk
from .dispatch import kernels_for, model_set, use_types, zero_weights
from .quant_types import quant_info
from .ops import _rms_norm_kernel, _silu_mul_kernel
from .threads import apply_threads, get_threads

_JIT = dict(cache=True, nogil=True)


# Compiled only as copies per kernel set (_kernel), whose globals hold that set's
# `claimed_items`. The parallel loops are written out here rather than calling the
# dispatch's parallel kernels: a cached function calling another parallel function
# crashed when both were loaded from caches written by different processes.
def _norm_swiglu_residual(x, norm_w, eps, wg, qg, wu, qu, act_gu, wd, qd, act_d, nt):
    n = x.shape[0]
    h = np.empty((1, n), np.float32)
    _rms_norm_kernel(x.reshape(1, n), norm_w, eps, h)
    xq, xd, xs = qk.quantize_act(h[0], act_gu)
    gate = np.empty((1, wg.shape[0]), np.float32)   # one row: claimed_items' token axis
    up = np.empty((1, wu.shape[0]), np.float32)
    none = np.empty((1, 0), np.float32)
    claims = np.zeros(2, np.int64)
    for _ in prange(nt):   # as dispatch._matvec_kernel: one iteration per thread
        claimed_items(claims[0:1], nt, wg, qg, gate, wu, qu, up, wu, qu, none,  # noqa: F821
                      xq.reshape((1, xq.shape[0])), xd.reshape((1, xd.shape[0])), xs.reshape((1, xs.shape[0])))
    act = np.empty(wg.shape[0], np.float32)
    _silu_mul_kernel(gate[0], up[0], act)
    aq, ad, as_ = qk.quantize_act(act, act_d)
    down = np.empty((1, wd.shape[0]), np.float32)
    for _ in prange(nt):
        claimed_items(claims[1:2], nt, wd, qd, down, wd, qd, none, wd, qd, none,  # noqa: F821
                      aq.reshape((1, aq.shape[0])), ad.reshape((1, ad.shape[0])), as_.reshape((1, as_.shape[0])))
    out = np.empty(n, np.float32)
    for k in range(n):
        out[k] = x[k] + down[0, k]
    return out


_KERNELS: dict = {}   # kernel set's types -> _norm_swiglu_residual compiled with its claimed_items


def _kernel(ks):
    got = _KERNELS.get(ks.types)
    if got is None:
        f = _norm_swiglu_residual
        name = f.__name__ + ks.suffix     # its own file in Numba's on-disk cache
        copy = FunctionType(f.__code__, dict(globals(), claimed_items=ks.claimed_items), name,
                            f.__defaults__, f.__closure__)
        copy.__qualname__, copy.__module__ = name, f.__module__
        got = _KERNELS[ks.types] = njit(parallel=True, **_JIT)(copy)
    return got


def norm_swiglu_residual(x: np.ndarray, norm_w: np.ndarray, eps: float, gate_up, down) -> np.ndarray:
    """x + down(silu(gate(h)) * up(h)) with h = rms_norm(x) * norm_w, for one token.

    x (n,) float32 C-contiguous; gate_up: matvec.prepare_group of (gate, up); down:
    matvec.prepare_weight of down (prepared weights: validated once by the caller)."""
    apply_threads()
    g, u = gate_up
    kernel = _kernel(kernels_for(g.qt, u.qt, down.qt))
    return kernel(x, norm_w, np.float32(eps), g.w, g.qt, u.w, u.qt, g.info.act_block,
                  down.w, down.qt, down.info.act_block, get_threads())


def model_kernel():
    """The fused decode MLP for the latest registered model's kernel set (None before
    any), set to compile first on a cold start that shares its work with a second process
    (compile_progress.compile_before: decode needs it only after the prompt, and it is
    the largest kernel a SwiGLU model compiles)."""
    ks = model_set()
    if ks is None:
        return None
    kernel = _kernel(ks)
    compile_progress.compile_before(
        kernel, f"from edgeinfer.kernels_cpu import fused_layer; fused_layer.compile_here({ks.types!r})")
    return kernel


def compile_here(qts: tuple) -> None:
    """Compile (or load) the fused decode MLP of the kernel set for these type ids with the
    signature decoding calls it with (float32 vectors, read-only weights), on zeros."""
    ks = use_types(qts)
    qt = int(qts[0])
    act = quant_info(qt).act_block
    w = zero_weights(qt, 256, 256)
    x, norm_w = np.zeros(256, np.float32), np.ones(256, np.float32)
    _kernel(ks)(x, norm_w, np.float32(1e-6), w, qt, w, qt, act, w, qt, act, get_threads())
