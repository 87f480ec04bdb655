"""Q4_K_X8, the CPU backend's copy of Q4_K matrices with rows interleaved in eights.

Every kernel must read it as it reads the file's Q4_K and give the same bits: the
decode matvec (one and several matrices a region, the fused FFN block), the <= 64-token
row path, the prefill tiles, dequantization and row lookup.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from edgeinfer.engine import Engine, EngineOptions
from edgeinfer.kernels_cpu import fused_layer, repack
from edgeinfer.kernels_cpu.matvec import prepare_group
from edgeinfer.kernels_cpu.quant_types import RepackedType
from edgeinfer.loader import open_model
from gguf_factory import TinyShape, spm_vocab, write_tiny_model
from quant_blocks import random_blocks

X8 = RepackedType.Q4_K_X8


def _pair(rng, n_rows, n_cols):
    w = random_blocks(T.Q4_K, n_rows, n_cols, rng)
    return w, repack.interleave_q4_k(w)


def test_layout_is_heads_then_pieces_of_every_row():
    rng = np.random.default_rng(0)
    w, wx = _pair(rng, 16, 512)
    assert wx.shape == w.shape and wx.dtype == np.uint8
    for g in range(2):
        for b in range(2):
            blk = wx[8 * g:8 * g + 8].reshape(-1)[1152 * b:1152 * (b + 1)]
            for k in range(8):
                row = w[8 * g + k, 144 * b:144 * (b + 1)]
                assert np.array_equal(blk[16 * k:16 * k + 16], row[:16]), (g, b, k)
                for t in range(8):
                    assert np.array_equal(blk[128 + 128 * t + 16 * k:][:16], row[16 + 16 * t:32 + 16 * t])
    assert np.array_equal(repack.deinterleave_q4_k(wx), w)


def test_interleave_rejects_rows_not_in_eights():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="eights"):
        repack.interleave_q4_k(random_blocks(T.Q4_K, 12, 256, rng))
    with pytest.raises(ValueError, match="groups of 8"):
        K.matvec(random_blocks(T.Q4_K, 12, 256, rng), X8, np.zeros(256, np.float32))


@pytest.mark.parametrize("n_rows,n_cols", [(8, 256), (24, 768), (40, 512), (136, 2048)])
def test_matvec_and_dequantization_give_the_q4_k_bits(n_rows, n_cols):
    rng = np.random.default_rng(n_rows)
    w, wx = _pair(rng, n_rows, n_cols)
    for scale in (0.01, 1.0, 300.0):
        x = (rng.standard_normal(n_cols) * scale).astype(np.float32)
        np.testing.assert_array_equal(K.matvec(wx, X8, x), K.matvec(w, T.Q4_K, x))
    np.testing.assert_array_equal(K.dequantize_rows(wx, X8, n_cols, 0, n_rows),
                                  K.dequantize_rows(w, T.Q4_K, n_cols, 0, n_rows))
    ids = np.array([n_rows - 1, 0, 3, 5, 7], np.int64)
    np.testing.assert_array_equal(K.get_rows(wx, X8, n_cols, ids), K.get_rows(w, T.Q4_K, n_cols, ids))
    # and the values are the GGUF blocks' (the numpy reference of the original)
    np.testing.assert_array_equal(K.dequantize_rows(wx, X8, n_cols, 0, n_rows),
                                  K.reference_dequantize(w, T.Q4_K).astype(np.float32))


@pytest.mark.parametrize("n_tok", [1, 5, 64, 100])   # the row path up to 64 tokens, tiles beyond
def test_matmul_gives_the_q4_k_bits(n_tok):
    rng = np.random.default_rng(n_tok)
    w, wx = _pair(rng, 40, 512)
    X = rng.standard_normal((n_tok, 512)).astype(np.float32)
    np.testing.assert_array_equal(K.matmul(wx, X8, X), K.matmul(w, T.Q4_K, X))
    q6 = random_blocks(T.Q6_K, 16, 512, rng)
    got = K.matmul_many([wx, q6, wx], [X8, T.Q6_K, X8], X)
    want = K.matmul_many([w, q6, w], [T.Q4_K, T.Q6_K, T.Q4_K], X)
    for g, e in zip(got, want):
        np.testing.assert_array_equal(g, e)


def test_several_matrices_a_region_and_the_fused_ffn_block():
    rng = np.random.default_rng(5)
    (g, gx), (u, ux) = _pair(rng, 48, 512), _pair(rng, 48, 512)
    x = rng.standard_normal(512).astype(np.float32)
    q6 = random_blocks(T.Q6_K, 24, 512, rng)
    got = K.matvec_many([gx, q6, ux], [X8, T.Q6_K, X8], x)
    want = K.matvec_many([g, q6, u], [T.Q4_K, T.Q6_K, T.Q4_K], x)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # gate/up 256 x 512 and down 512 x 256 around a residual of 512
    g, gx = _pair(rng, 256, 512)
    u, ux = _pair(rng, 256, 512)
    d, dx = _pair(rng, 512, 256)
    norm = rng.standard_normal(512).astype(np.float32)
    fused = fused_layer.norm_swiglu_residual(x, norm, 1e-5, prepare_group([gx, ux], [X8, X8]),
                                             prepare_group([dx], [X8])[0])
    plain = fused_layer.norm_swiglu_residual(x, norm, 1e-5, prepare_group([g, u], [T.Q4_K, T.Q4_K]),
                                             prepare_group([d], [T.Q4_K])[0])
    np.testing.assert_array_equal(fused, plain)


def test_repack_takes_only_q4_k_in_eights_where_the_host_gains(monkeypatch):
    rng = np.random.default_rng(1)
    w = random_blocks(T.Q4_K, 16, 256, rng)
    for host in (True, False):
        monkeypatch.setattr(repack, "host_repacks", lambda host=host: host)
        got, qt = repack.repack(w, T.Q4_K)
        if host:
            assert qt == X8 and not got.flags.writeable
            np.testing.assert_array_equal(got, repack.interleave_q4_k(w))
        else:
            assert qt == T.Q4_K and got is w
        for other in (random_blocks(T.Q4_K, 12, 256, rng), random_blocks(T.Q6_K, 16, 256, rng)):
            kept, kept_qt = repack.repack(other, T.Q4_K if other.shape[1] == 144 else T.Q6_K)
            assert kept is other and kept_qt != X8


@pytest.mark.parametrize("host", [True, False])
def test_the_cpu_backend_gives_the_same_tokens_with_and_without_the_copy(host, tmp_path, monkeypatch):
    # a Q4_K model (its 8-row matrices become Q4_K_X8 where the host repacks); the logits
    # must equal those of the file's layout, for a prompt (tiles) and decoded tokens
    path = write_tiny_model(tmp_path / "m.gguf", "llama", "Q4_K", shape=TinyShape(n_embd=256, n_ff=512),
                            vocab=spm_vocab(), seed=4)
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(repack, "host_repacks", lambda on=on: on and host)
        eng = Engine(open_model(path), EngineOptions(n_ctx=128, backend="cpu"))
        kv = eng.new_cache()
        out = [eng.prefill(np.arange(3, 83), kv)]
        out += [eng.decode(t, kv) for t in (5, 9, 11)]
        logits[on] = np.stack([np.asarray(o).reshape(-1) for o in out])
        kinds = {qt for _, qt in eng.backend._weights.values()}
        assert (X8 in kinds) == (on and host), kinds
        if on and host:   # copied at load, every Q4_K matrix with rows in eights
            fresh = Engine(open_model(path), EngineOptions(n_ctx=128, backend="cpu")).backend
            want = {n for n, t in fresh.gguf.tensors.items() if t.qtype == T.Q4_K and t.n_rows % 8 == 0}
            assert want and {n for n, (_, qt) in fresh._weights.items() if qt == X8} == want
    np.testing.assert_array_equal(logits[True], logits[False])
