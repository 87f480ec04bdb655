"""llama.cpp's CPU flash attention itself, as an op: one ggml graph with ggml_flash_attn_ext
built and run through ctypes on the oracle's own libraries (tests/ggml_lib.py), so the
numpy reference (kernels_cpu/flash_attention_ref.py) is held to the compiled code, the
compiler's fma contractions included."""
from __future__ import annotations

import ctypes

import numpy as np

from ggml_lib import Ggml

_P = ctypes.c_void_p


class _InitParams(ctypes.Structure):   # struct ggml_init_params
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _setup(g: Ggml) -> None:
    b = g.base
    b.ggml_init.restype = _P
    b.ggml_init.argtypes = [_InitParams]
    b.ggml_new_tensor_4d.restype = _P
    b.ggml_new_tensor_4d.argtypes = [_P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    b.ggml_flash_attn_ext.restype = _P
    b.ggml_flash_attn_ext.argtypes = [_P, _P, _P, _P, _P, ctypes.c_float, ctypes.c_float, ctypes.c_float]
    b.ggml_flash_attn_ext_add_sinks.argtypes = [_P, _P]
    b.ggml_new_graph.restype = _P
    b.ggml_new_graph.argtypes = [_P]
    b.ggml_build_forward_expand.argtypes = [_P, _P]
    b.ggml_get_data.restype = _P
    b.ggml_get_data.argtypes = [_P]
    b.ggml_nbytes.restype = ctypes.c_size_t
    b.ggml_nbytes.argtypes = [_P]
    b.ggml_free.argtypes = [_P]
    g.cpu.ggml_graph_compute_with_ctx.argtypes = [_P, _P, ctypes.c_int]


def _fill(g: Ggml, t, arr: np.ndarray) -> None:
    a = np.ascontiguousarray(arr)
    assert a.nbytes == g.base.ggml_nbytes(t), (a.nbytes, g.base.ggml_nbytes(t))
    ctypes.memmove(g.base.ggml_get_data(t), a.ctypes.data, a.nbytes)


def flash_attn_ext(g: Ggml, q: np.ndarray, k: np.ndarray, v: np.ndarray, type_k: int, type_v: int,
                   hd: int, hdv: int, kpos: np.ndarray, qpos: np.ndarray, scale: float, window: int = 0,
                   sinks: np.ndarray | None = None, softcap: float = 0.0) -> np.ndarray:
    """q (n, n_head, hd) f32; k (S, n_kv, row bytes or hd f16); v likewise -> (n, n_head, hdv) f32."""
    if not getattr(g, "_fa_ready", False):
        _setup(g)
        g._fa_ready = True
    b = g.base
    n, n_head = q.shape[:2]
    n_keys, n_kv = k.shape[:2]
    ctx = b.ggml_init(_InitParams(256 * 1024 * 1024, None, False))
    try:
        tq = b.ggml_new_tensor_4d(ctx, 0, hd, n, n_head, 1)
        tk = b.ggml_new_tensor_4d(ctx, type_k, hd, n_keys, n_kv, 1)
        tv = b.ggml_new_tensor_4d(ctx, type_v, hdv, n_keys, n_kv, 1)
        tm = b.ggml_new_tensor_4d(ctx, 1, n_keys, n, 1, 1)
        _fill(g, tq, np.asarray(q, np.float32).transpose(1, 0, 2))           # [hd, n, n_head]
        _fill(g, tk, np.asarray(k).transpose(1, 0, 2))                       # [row, S, n_kv]
        _fill(g, tv, np.asarray(v).transpose(1, 0, 2))
        qp = np.asarray(qpos)[:, None]
        allowed = np.asarray(kpos)[None, :] <= qp
        if window:
            allowed &= (qp - np.asarray(kpos)[None, :]) < window
        _fill(g, tm, np.where(allowed, 0, -np.inf).astype(np.float16))
        out = b.ggml_flash_attn_ext(ctx, tq, tk, tv, tm, scale, 0.0, softcap)
        if sinks is not None:
            ts = b.ggml_new_tensor_4d(ctx, 0, n_head, 1, 1, 1)
            _fill(g, ts, np.asarray(sinks, np.float32))
            b.ggml_flash_attn_ext_add_sinks(out, ts)
        gf = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(gf, out)
        g.cpu.ggml_graph_compute_with_ctx(ctx, gf, 1)
        res = np.empty((n, n_head, hdv), np.float32)                          # dst [hdv, n_head, n]
        ctypes.memmove(res.ctypes.data, b.ggml_get_data(out), res.nbytes)
        return res
    finally:
        b.ggml_free(ctx)


def mul_mat(g: Ggml, a: np.ndarray, b: np.ndarray, ggml_type: int, b_type: int | None = None) -> np.ndarray:
    """ggml_mul_mat(a (m, k), b (n, k)) -> (n, m): a of ggml_type (0 F32, 1 F16, 30 BF16 given
    as uint16: the arrays' element size must match), b of b_type (default: ggml_type), run on
    2 threads as a graph of one node."""
    _setup(g)
    base = g.base
    base.ggml_mul_mat.restype = _P
    base.ggml_mul_mat.argtypes = [_P, _P, _P]
    (m, k), n = a.shape, b.shape[0]
    ctx = base.ggml_init(_InitParams(64 << 20, None, False))
    try:
        ta = base.ggml_new_tensor_4d(ctx, ggml_type, k, m, 1, 1)
        tb = base.ggml_new_tensor_4d(ctx, ggml_type if b_type is None else b_type, k, n, 1, 1)
        _fill(g, ta, a)
        _fill(g, tb, b)
        out = base.ggml_mul_mat(ctx, ta, tb)                       # [n, m]: out[j][i] = a[i] . b[j]
        gf = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(gf, out)
        g.cpu.ggml_graph_compute_with_ctx(ctx, gf, 2)
        res = np.empty((n, m), np.float32)
        ctypes.memmove(res.ctypes.data, base.ggml_get_data(out), res.nbytes)
        return res
    finally:
        base.ggml_free(ctx)
