"""llama.cpp's non-flash attention as libmtmd's encoders build it (clip.cpp's build_attn with
flash attention off), run as a ggml graph on the oracle's own libraries: Q and K permuted
views, V permuted and made contiguous, KQ = mul_mat(K, Q), soft_max_ext without a mask,
KQV = mul_mat(V, KQ), permuted back."""
from __future__ import annotations

import ctypes

import numpy as np
from ggml_flash_oracle import _fill, _InitParams, _P, _setup
from ggml_lib import Ggml


def attention_f32(g: Ggml, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, n_threads: int = 2) -> np.ndarray:
    """q, k, v (n, heads, d) float32 -> (n, heads * d), every query seeing every key."""
    _setup(g)
    b = g.base
    for name, args in (("ggml_permute", [_P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
                       ("ggml_cont", [_P, _P]), ("ggml_mul_mat", [_P, _P, _P]),
                       ("ggml_soft_max_ext", [_P, _P, _P, ctypes.c_float, ctypes.c_float])):
        fn = getattr(b, name)
        fn.restype, fn.argtypes = _P, args
    n, n_head, d = q.shape
    ctx = b.ggml_init(_InitParams(max(64 << 20, 8 * n * n * n_head + (16 << 20)), None, False))
    try:
        t = [b.ggml_new_tensor_4d(ctx, 0, d, n_head, n, 1) for _ in range(3)]   # [d, n_head, n]
        for tensor, arr in zip(t, (q, k, v)):
            _fill(g, tensor, np.ascontiguousarray(arr, np.float32))
        qp = b.ggml_permute(ctx, t[0], 0, 2, 1, 3)
        kp = b.ggml_permute(ctx, t[1], 0, 2, 1, 3)
        vp = b.ggml_cont(ctx, b.ggml_permute(ctx, t[2], 1, 2, 0, 3))
        kq = b.ggml_soft_max_ext(ctx, b.ggml_mul_mat(ctx, kp, qp), None, scale, 0.0)
        out = b.ggml_cont(ctx, b.ggml_permute(ctx, b.ggml_mul_mat(ctx, vp, kq), 0, 2, 1, 3))   # [d, n_head, n]
        gf = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(gf, out)
        g.cpu.ggml_graph_compute_with_ctx(ctx, gf, n_threads)
        res = np.empty((n, n_head * d), np.float32)
        ctypes.memmove(res.ctypes.data, b.ggml_get_data(out), res.nbytes)
        return res
    finally:
        b.ggml_free(ctx)
