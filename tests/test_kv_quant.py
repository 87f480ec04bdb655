"""Quantized K/V cache math: the row quantizers against gguf.quants and the oracle's ggml,
the numpy flash attention against ggml's own flash_attn_ext op, and the compiled kernel
against the numpy reference, all bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.kernels_cpu import flash_attention, flash_attention_ref, kv_quant, kv_quant_jit
from ggml_lib import oracle_ggml
from ggml_flash_oracle import flash_attn_ext

TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
PAIRS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q8_0"), ("q4_1", "q5_1"), ("q5_0", "q4_1"),
         ("iq4_nl", "iq4_nl"), ("q8_0", "iq4_nl")]
# (queries, keys, head dim, heads, K/V heads, window, sinks, softcap)
SHAPES = [(1, 37, 64, 4, 2, 0, False, 0.0), (5, 40, 128, 2, 1, 7, True, 0.0), (3, 20, 96, 4, 4, 0, False, 30.0)]
# GQA groups of 3..8 heads (the kernel shares V blocks in sub-groups of 4, 2 and 1), over more
# keys than one chunk (flash_attention.CHUNK), a window, sinks
GROUP_SHAPES = [(2, 300, 64, 8, 2, 0, False, 0.0), (1, 150, 32, 7, 1, 0, True, 0.0),
                (3, 140, 64, 8, 1, 50, False, 0.0), (2, 200, 96, 6, 2, 0, False, 20.0), (1, 260, 64, 5, 1, 0, False, 0.0)]


def _rows(rng, shape):
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 10, shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1, 32)[0] = 0.0        # an all-zero block: d = 0
    x.reshape(-1, 32)[1, 3] = 1e-8    # a tiny value beside normal ones
    return x


def _store(t, x):
    return x.astype(np.float16) if t == "f16" else kv_quant.quantize(t, x)


@pytest.mark.parametrize("name", TYPES + ["q8_1"])
def test_quantizers_match_ggml_cpu_from_float(name):
    g = oracle_ggml()
    x = _rows(np.random.default_rng(0), (16, 128))
    out = np.empty((16, kv_quant.row_bytes(name, 128)), np.uint8)
    g.cpu.ggml_get_type_traits_cpu(kv_quant.GGML_TYPE_ID[name]).contents.from_float(x.ctypes.data, out.ctypes.data,
                                                                                     x.size)
    mine = kv_quant.quantize(name, x)
    if name == "iq4_nl":   # ggml leaves an all-zero block's nibbles as they were (d = 0 either way)
        blocks, ours = out.reshape(-1, 18), mine.reshape(-1, 18)
        zero = ~blocks[:, :2].any(axis=1)
        assert zero[0] and zero.sum() == 1 and not ours[zero, 2:].any()
        assert np.array_equal(ours[:, :2], blocks[:, :2]) and np.array_equal(ours[~zero], blocks[~zero])
    else:
        assert np.array_equal(mine, out)
    if name != "q8_1":
        ref = g.to_float(kv_quant.GGML_TYPE_ID[name], out, 128)
        assert np.array_equal(kv_quant.dequantize(name, out).view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", [t for t in TYPES if t != "iq4_nl"])   # gguf does not quantize iq4_nl
def test_reference_quantizers_match_gguf(name):
    import gguf
    from gguf.quants import quantize

    x = _rows(np.random.default_rng(1), (16, 128))
    mine = kv_quant.quantize_q8_0_ref(x) if name == "q8_0" else kv_quant.quantize(name, x)
    assert np.array_equal(quantize(x, gguf.GGMLQuantizationType[name.upper()]), mine)


def test_q8_0_store_rounds_to_even_unlike_the_file_reference():
    # 0.5 * 127/127: the CPU store (rint) gives 0 where the file quantizer (roundf) gives 1
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = 127.0, 0.5
    assert kv_quant.quantize("q8_0", x)[0, 3] == 0
    assert kv_quant.quantize_q8_0_ref(x)[0, 3] == 1


def test_row_bytes():
    assert kv_quant.row_bytes("f16", 128) == 256
    assert kv_quant.row_bytes("q8_0", 128) == 136
    assert kv_quant.row_bytes("q4_0", 128) == 72
    with pytest.raises(ValueError):
        kv_quant.row_bytes("q8_0", 48)


def _case(rng, tk, tv, n, S, hd, nh, nkv):
    q = (rng.standard_normal((n, nh, hd)) * 2).astype(np.float32)
    k = _store(tk, rng.standard_normal((S, nkv, hd)).astype(np.float32))
    v = _store(tv, rng.standard_normal((S, nkv, hd)).astype(np.float32))
    return q, k, v, np.arange(S), np.arange(S - n, S)


@pytest.mark.parametrize("tk,tv", PAIRS)
def test_reference_matches_ggml_flash_attn_ext(tk, tv):
    g = oracle_ggml()
    rng = np.random.default_rng(2)
    for n, S, hd, nh, nkv, window, sink, cap in SHAPES:
        q, k, v, kpos, qpos = _case(rng, tk, tv, n, S, hd, nh, nkv)
        sinks = rng.standard_normal(nh).astype(np.float32) if sink else None
        want = flash_attn_ext(g, q, k, v, kv_quant.GGML_TYPE_ID[tk], kv_quant.GGML_TYPE_ID[tv], hd, hd, kpos, qpos,
                              0.125, window, sinks, cap)
        got = flash_attention_ref.flash_attention(q, k, v, kpos, qpos, tk, tv, 0.125, window, sinks, cap)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (tk, tv, n, S, hd)


@pytest.mark.parametrize("tk,tv", PAIRS)
def test_kernel_matches_reference(tk, tv):
    rng = np.random.default_rng(3)
    for n, S, hd, nh, nkv, window, sink, cap in SHAPES + GROUP_SHAPES:
        q, k, v, kpos, qpos = _case(rng, tk, tv, n, S, hd, nh, nkv)
        kpos = rng.permutation(kpos)   # keys in any slot order (a shifted or gathered cache)
        sinks = rng.standard_normal(nh).astype(np.float32) if sink else None
        want = flash_attention_ref.flash_attention(q, k, v, kpos, qpos, tk, tv, 0.125, window, sinks, cap)
        got = flash_attention.flash_attention(q, k, v, kpos, qpos, tk, tv, 0.125, window, sinks, cap)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (tk, tv, n, S, hd)


def test_kv_block_leaves_a_job_for_every_thread():
    assert flash_attention.kv_block(1, 8, 2) == 4
    assert flash_attention.kv_block(1, 8, 1) == 8
    assert flash_attention.kv_block(1, 8, 16) == 1
    assert flash_attention.kv_block(1, 6, 4) == 1    # 6 // 4 heads would leave threads idle
    assert flash_attention.kv_block(3, 6, 2) == 3    # 6 jobs, not 3 for 2 threads
    assert flash_attention.kv_block(9, 6, 2) == 6
    assert flash_attention.kv_block(512, 8, 16) == 8


@pytest.mark.parametrize("threads", [1, 4, 8])
def test_kernel_bits_do_not_depend_on_the_job_split(monkeypatch, threads):
    # 4 K/V heads and 2 queries: blocks of 4, 2 and 1 K/V heads a job
    monkeypatch.setattr(flash_attention, "get_threads", lambda: threads)
    rng = np.random.default_rng(7)
    q, k, v, kpos, qpos = _case(rng, "q8_0", "q4_0", 2, 300, 64, 16, 4)
    want = flash_attention_ref.flash_attention(q, k, v, kpos, qpos, "q8_0", "q4_0", 0.125)
    got = flash_attention.flash_attention(q, k, v, kpos, qpos, "q8_0", "q4_0", 0.125)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_fwht_is_the_scaled_hadamard_matrix_and_its_own_inverse():
    h = np.ones((1, 1))
    while h.shape[0] < 64:   # Sylvester's construction
        h = np.block([[h, h], [h, -h]])
    h = h / 8.0
    x = np.random.default_rng(4).standard_normal((3, 128)).astype(np.float32)
    y = kv_quant.fwht(x, 64)
    assert np.allclose(y.reshape(-1, 64), x.reshape(-1, 64) @ h.T, atol=1e-5)
    assert np.allclose(kv_quant.fwht(y, 64), x, atol=1e-5)
    assert kv_quant.rotation_size(64, True) == 64 and kv_quant.rotation_size(256, True) == 256
    assert kv_quant.rotation_size(192, True) == 64 and kv_quant.rotation_size(96, False) == 0


def test_compiled_fwht_and_q8_0_store_match_numpy():
    rng = np.random.default_rng(5)
    x = _rows(rng, (7, 3, 128))
    x.reshape(-1, 32)[2, :] = np.float32(-3.5)   # a block of equal values: ties of rint
    for n in (64, 128):
        assert np.array_equal(kv_quant_jit.fwht(x, n).view(np.uint32), kv_quant.fwht(x, n).view(np.uint32))
    want = kv_quant.quantize_q8_0(x)
    assert np.array_equal(kv_quant_jit.quantize_q8_0(x), want)
    qx, qd = kv_quant_jit.quantize_q8_0_split(x)
    vals, d, _ = kv_quant.fields("q8_0", want)
    assert np.array_equal(qx.reshape(vals.shape), vals.astype(np.int8))
    assert np.array_equal(qd.view(np.uint32), d.view(np.uint32))


def test_compiled_q4_0_q5_0_and_iq4_nl_stores_match_numpy():
    rng = np.random.default_rng(6)
    x = _rows(rng, (5, 3, 128)) * rng.choice([1e-3, 1.0, 300.0], size=(5, 3, 1)).astype(np.float32)
    x.reshape(-1, 32)[1, :] = 0                                   # an all-zero block: d = 0
    x.reshape(-1, 32)[3, :2] = (np.float32(9.0), np.float32(-9.0))   # the first largest magnitude sets d's sign
    x.reshape(-1, 32)[3, 2:] = 0
    assert np.array_equal(kv_quant_jit.quantize_q4_0(x), kv_quant.quantize_q4_0(x))
    assert np.array_equal(kv_quant_jit.quantize_q5_0(x), kv_quant.quantize_q5_0(x))
    assert np.array_equal(kv_quant_jit.quantize_iq4_nl(x), kv_quant.quantize_iq4_nl(x))


@pytest.mark.parametrize("rot", [64, 128])
def test_compiled_stores_rotate_first_in_the_same_call(rot):
    x = _rows(np.random.default_rng(8), (4, 3, 128))
    rotated = kv_quant.fwht(x, rot)
    for name in ("q8_0", "q4_0", "q5_0", "iq4_nl"):
        store = getattr(kv_quant_jit, f"quantize_{name}")
        assert np.array_equal(store(x, rot), store(rotated)), name
    qx, qd = kv_quant_jit.quantize_q8_0_split(x, rot)
    wx, wd = kv_quant_jit.quantize_q8_0_split(rotated)
    assert np.array_equal(qx, wx) and np.array_equal(qd.view(np.uint32), wd.view(np.uint32))
    assert np.array_equal(x, _rows(np.random.default_rng(8), (4, 3, 128)))   # the input is left as it was


@pytest.mark.parametrize("tk", ["q8_0", "q4_1", "f16"])
def test_kernel_rotates_q_as_asked(tk):
    rng = np.random.default_rng(9)
    q, k, v, kpos, qpos = _case(rng, tk, "q8_0", 2, 50, 64, 4, 2)
    want = flash_attention.flash_attention(kv_quant.fwht(q, 64), k, v, kpos, qpos, tk, "q8_0", 0.125)
    got = flash_attention.flash_attention(q, k, v, kpos, qpos, tk, "q8_0", 0.125, rotate_q=64)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
