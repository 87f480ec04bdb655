"""edgeinfer.vision.position_ops against ggml's own ops, run through the oracle's library
(tests/ggml_lib.py): the rotary embeddings of qwen3vl (ggml_rope_multi, vision) and gemma4v
(two NeoX ggml_rope_ext), and qwen3vl's position-table resize (ggml_interpolate, bilinear,
aligned corners), each equal bit for bit: a last-bit difference there reached a Q8_0
mmproj's embeddings as a whole quantum. The numpy forms these replaced (np.cos, products
without ggml's fused multiply-adds) differed in 20-30% of the values."""
from __future__ import annotations

import ctypes

import ggml_flash_oracle as gfo
import numpy as np
import pytest
from ggml_lib import oracle_ggml

from edgeinfer.vision import position_ops
from edgeinfer.vision.qwen3vl import _blocks_of_four

_P = ctypes.c_void_p
_F32, _I32 = 0, 26                       # GGML_TYPE_F32, GGML_TYPE_I32
_ROPE_NEOX, _ROPE_VISION = 2, 24         # GGML_ROPE_TYPE_*
_BILINEAR_ALIGN_CORNERS = 1 | (1 << 8)   # GGML_SCALE_MODE_BILINEAR | GGML_SCALE_FLAG_ALIGN_CORNERS


@pytest.fixture(scope="module")
def ggml():
    g = oracle_ggml()
    gfo._setup(g)
    b = g.base
    b.ggml_interpolate.restype = _P
    b.ggml_interpolate.argtypes = [_P, _P] + [ctypes.c_int64] * 4 + [ctypes.c_uint32]
    b.ggml_rope_multi.restype = _P
    b.ggml_rope_multi.argtypes = [_P, _P, _P, _P, ctypes.c_int, ctypes.c_int * 4, ctypes.c_int, ctypes.c_int] + \
        [ctypes.c_float] * 6
    b.ggml_rope_ext.restype = _P
    b.ggml_rope_ext.argtypes = [_P, _P, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int] + [ctypes.c_float] * 6
    return g


def _run(g, build, inputs, out_shape):
    """One ggml graph: `inputs` [(type, ne0..ne3, array)], build(ctx, *tensors) -> the output."""
    b = g.base
    ctx = b.ggml_init(gfo._InitParams(64 << 20, None, False))
    try:
        tensors = []
        for ty, ne, arr in inputs:
            t = b.ggml_new_tensor_4d(ctx, ty, *ne)
            gfo._fill(g, t, arr)
            tensors.append(t)
        out = build(ctx, *tensors)
        gf = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(gf, out)
        g.cpu.ggml_graph_compute_with_ctx(ctx, gf, 1)
        res = np.empty(out_shape, np.float32)
        ctypes.memmove(res.ctypes.data, b.ggml_get_data(out), res.nbytes)
        return res
    finally:
        b.ggml_free(ctx)


def _grid(ph: int, pw: int):
    rows = np.broadcast_to(np.arange(ph)[:, None, None], (ph, pw, 1))
    cols = np.broadcast_to(np.arange(pw)[None, :, None], (ph, pw, 1))
    return (_blocks_of_four(np.ascontiguousarray(rows))[:, 0], _blocks_of_four(np.ascontiguousarray(cols))[:, 0])


@pytest.mark.parametrize("ph,pw,d", [(6, 10, 32), (12, 12, 64), (16, 20, 72)])
def test_qwen3vl_rotary_is_ggml_rope_multi_vision(ggml, ph, pw, d):
    x = np.random.default_rng(d).standard_normal((ph * pw, 3, d)).astype(np.float32)
    rows, cols = _grid(ph, pw)
    n = x.shape[0]
    sections = (ctypes.c_int * 4)(d // 4, d // 4, d // 4, d // 4)
    want = _run(ggml, lambda ctx, t, pos: ggml.base.ggml_rope_multi(
        ctx, t, pos, None, d // 2, sections, _ROPE_VISION, 32768, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0),
        [(_F32, (d, 3, n, 1), x), (_I32, (4 * n, 1, 1, 1), np.concatenate([rows, cols, rows, cols]).astype(np.int32))],
        x.shape)
    got = position_ops.rotate_mrope_vision(x, position_ops.mrope_vision_angles(rows, cols, d, 10000.0))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ph,pw,d", [(9, 9, 32), (11, 19, 64)])
def test_gemma4v_rotary_is_two_neox_ropes(ggml, ph, pw, d):
    x = np.random.default_rng(d + 1).standard_normal((ph * pw, 2, d)).astype(np.float32)
    cols, rows = np.tile(np.arange(pw), ph), np.repeat(np.arange(ph), pw)
    n, half = x.shape[0], d // 2
    want = np.empty_like(x)
    for k, pos in enumerate((cols, rows)):   # gemma4v's graph: the first half by x, the second by y
        part = np.ascontiguousarray(x[..., k * half:(k + 1) * half])
        want[..., k * half:(k + 1) * half] = _run(ggml, lambda ctx, t, p: ggml.base.ggml_rope_ext(
            ctx, t, p, None, half, _ROPE_NEOX, 0, 100.0, 1.0, 0.0, 1.0, 0.0, 0.0),
            [(_F32, (half, 2, n, 1), part), (_I32, (n, 1, 1, 1), pos.astype(np.int32))], part.shape)
    got = position_ops.rotate_2d_neox(x, position_ops.neox_2d_angles(cols, rows, d, 100.0))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ph,pw", [(12, 12), (6, 10), (10, 6), (4, 6), (16, 16), (1, 8)])
def test_position_table_resize_is_ggml_interpolate(ggml, ph, pw):
    table = np.random.default_rng(ph * pw).standard_normal((8, 8, 48)).astype(np.float32)
    sy, sx, e = table.shape
    want = _run(ggml, lambda ctx, t: ggml.base.ggml_interpolate(ctx, t, pw, ph, e, 1, _BILINEAR_ALIGN_CORNERS),
                [(_F32, (sx, sy, e, 1), np.ascontiguousarray(table.transpose(2, 0, 1)))], (e, ph, pw))
    np.testing.assert_array_equal(position_ops.resize_align_corners(table, ph, pw), want.transpose(1, 2, 0))
