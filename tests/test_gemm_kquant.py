"""gemm_kquant, the prompt GEMM of the 256-element types on AVX2 CPUs: Q4_K tokens get matvec's bits."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from edgeinfer.kernels_cpu import gemm_kquant, gemm_kquant_wide, tile_gemm
from edgeinfer.kernels_cpu.reference import reference_quantize_act
from quant_blocks import random_blocks

MATVEC = importlib.import_module("edgeinfer.kernels_cpu.matvec")
Q4K = K.quant_info(T.Q4_K)


def _gemm(w, X, qt=T.Q4_K):
    """The kernel on its own (any host: the portable IR where AVX2 is missing)."""
    out = np.full((X.shape[0], w.shape[0]), np.nan, np.float32)
    packed = gemm_kquant.pack_activations(*MATVEC.quantize_activation_rows(X, Q4K))
    gemm_kquant.matmul_rows(w, int(qt), 0, w.shape[0] // gemm_kquant.GROUP_ROWS, packed, out)
    return out


def _within_rounding(got, w, qt, X):
    """got equals the float product of the dequantized weights and the 8-bit activations up
    to float rounding."""
    W = K.reference_dequantize(w, qt).astype(np.float64)
    Xq = np.stack([reference_quantize_act(x, 256) for x in X])
    err = np.abs(got - Xq @ W.T)
    assert np.all(err <= 2e-5 * (np.abs(Xq) @ np.abs(W).T) + 1e-30), err.max()


def _readonly(w):
    w.flags.writeable = False
    return w


@pytest.mark.parametrize("n_tok", [1, 5, 70, 300])   # 300: two token tiles, the last partial
def test_each_token_equals_matvec_bit_for_bit(n_tok):
    rng = np.random.default_rng(n_tok)
    w = _readonly(random_blocks(T.Q4_K, 40, 768, rng))   # 5 groups: a wide group (VNNI-512) and one
    X = rng.standard_normal((n_tok, 768)).astype(np.float32) * rng.uniform(0.01, 10, (n_tok, 1)).astype(np.float32)
    got = _gemm(w, X)
    for t in range(n_tok):
        np.testing.assert_array_equal(got[t], K.matvec(w, T.Q4_K, X[t]), err_msg=f"token {t}")
    _within_rounding(got, w, T.Q4_K, X)


@pytest.mark.parametrize("qt", [T.Q6_K, T.Q5_K, T.Q3_K, T.Q2_K, T.IQ4_XS])
@pytest.mark.parametrize("n_tok", [3, 70, 300])
def test_each_type_matches_the_reference(qt, n_tok):
    rng = np.random.default_rng(10 * int(qt) + n_tok)
    w = _readonly(random_blocks(qt, 40, 1024, rng))
    X = rng.standard_normal((n_tok, 1024)).astype(np.float32)
    _within_rounding(_gemm(w, X, qt), w, qt, X)


WIDE_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.Q2_K, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_XS]


@pytest.mark.skipif(not gemm_kquant_wide.enabled(),
                    reason="the 32-row kernels run only with AVX512-VNNI (elsewhere they are not compiled) "
                           "and without EDGEINFER_NO_WIDE_GEMM")
@pytest.mark.parametrize("qt", WIDE_TYPES)
@pytest.mark.parametrize("n_tok", [1, 13, 300])   # 13: a step of 8 and a last 4 (with padding); 300: 3 tiles
def test_wide_groups_have_the_8_row_kernels_bits(qt, n_tok):
    """Rows in groups of 4 (gemm_kquant_wide) against each 8-row group alone: equal bits."""
    rng = np.random.default_rng(7 * int(qt) + n_tok)
    w = _readonly(random_blocks(qt, 72, 512, rng))   # 9 groups: two wide groups and one left
    X = rng.standard_normal((n_tok, 512)).astype(np.float32) * rng.uniform(0.01, 10, (n_tok, 1)).astype(np.float32)
    packed = gemm_kquant.pack_activations(*MATVEC.quantize_activation_rows(X, Q4K))
    wide = np.full((n_tok, 72), np.nan, np.float32)
    gemm_kquant.matmul_rows(w, int(qt), 0, 9, packed, wide)
    narrow = np.full((n_tok, 72), np.nan, np.float32)
    for g in range(9):   # one group a call: never four, so never the wide kernel
        gemm_kquant.matmul_rows(w, int(qt), g, g + 1, packed, narrow)
    np.testing.assert_array_equal(wide, narrow)
    _within_rounding(wide, w, qt, X)


# byte offset and f16 bytes of d (and dmin) in a block, for filling every other byte
_D_BYTES = {T.Q3_K: (110, {108: 0x3C00}), T.Q2_K: (84, {80: 0x3C00, 82: 0x3800}), T.IQ4_XS: (136, {0: 0x3C00})}


@pytest.mark.parametrize("qt", [T.Q3_K, T.Q2_K, T.IQ4_XS])
@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_extreme_codes_scales_and_activations(qt, fill):
    # every byte but d 0x00 or 0xFF: Q3_K's codes -4 / 3 with scales -32 / 31, Q2_K's codes 0 / 3
    # with scales and mins 0 / 15, IQ4_XS's value -127 (|v| . x = 2 * 127 * 127 a pair, the
    # vpmaddubsw edge) / 113 with scales -32 / 31; activation bytes at -127 and 127
    size, ds = _D_BYTES[qt]
    w = np.full((8, 2 * size), fill, np.uint8)
    for at, bits in ds.items():
        for blk in range(2):
            w[:, blk * size + at:blk * size + at + 2] = np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
    w = _readonly(w)
    rng = np.random.default_rng(fill)
    X = np.stack([np.full(512, -1.0, np.float32), np.full(512, 1.0, np.float32),
                  rng.standard_normal(512).astype(np.float32)])
    _within_rounding(_gemm(w, X, qt), w, qt, X)


def test_q5_k_largest_codes_do_not_overflow():
    # every code 31 (nibble 15, fifth bit set), scales and mins 63, activations at +-127:
    # the i16 sums of four vpmaddubsw reach 4 * 2*31*127
    rng = np.random.default_rng(2)
    w = random_blocks(T.Q5_K, 8, 512, rng).reshape(8, 2, 176)
    w[:, :, 4:] = 0xFF
    w = _readonly(np.ascontiguousarray(w.reshape(8, 352)))
    X = np.full((5, 512), -1.0, np.float32)
    X[1] = 1.0
    X[2, ::2] = 0.0
    _within_rounding(_gemm(w, X, T.Q5_K), w, T.Q5_K, X)


def test_q6_k_extreme_codes_and_scales():
    # codes 0 and 63 (the i16 pair sums of two vpmaddubsw reach 2 * 2*63*128 = 32256),
    # scales -128 and 127, activations at -128 and 127
    rng = np.random.default_rng(4)
    w = random_blocks(T.Q6_K, 8, 256, rng)
    w[:4, :192] = 0xFF                                          # code 63
    w[4:, :192] = 0x00                                          # code 0 (value -32)
    w[:, 192:208] = np.array([0x80, 0x7F] * 8, np.uint8)        # scales -128, 127
    w = _readonly(np.ascontiguousarray(w))
    X = np.stack([np.full(256, -1.0, np.float32), np.full(256, 1.0, np.float32),
                  rng.standard_normal(256).astype(np.float32)])
    _within_rounding(_gemm(w, X, T.Q6_K), w, T.Q6_K, X)


def test_largest_codes_scales_and_activations_do_not_overflow():
    # every nibble 15, every 6-bit scale and min 63, every activation byte -128: the i16
    # sums of eight vpmaddubsw reach -30720, the edge the kernel relies on
    rng = np.random.default_rng(1)
    w = random_blocks(T.Q4_K, 8, 512, rng).reshape(8, 2, 144)
    w[:, :, 4:] = 0xFF
    w = _readonly(np.ascontiguousarray(w.reshape(8, 288)))
    X = np.full((6, 512), -1.0, np.float32)
    X[1] = 1.0                                   # +127 bytes
    X[2, ::2] = 0.0                              # half zero
    got = _gemm(w, X)
    for t in range(6):
        np.testing.assert_array_equal(got[t], K.matvec(w, T.Q4_K, X[t]))
    _within_rounding(got, w, T.Q4_K, X)


def test_pack_activations_pads_tokens_and_packs_block_sums():
    rng = np.random.default_rng(2)
    X = rng.standard_normal((5, 512)).astype(np.float32)
    xq, xd, xs = MATVEC.quantize_activation_rows(X, Q4K)
    pq, pd, pb = gemm_kquant.pack_activations(xq, xd, xs)
    assert pq.shape == (2, 8, 256) and pd.shape == (2, 8) and pb.shape == (2, 8, 12)
    np.testing.assert_array_equal(pq[:, :5].transpose(1, 0, 2).reshape(5, 512), xq)
    assert not pq[:, 5:].any() and not pd[:, 5:].any() and not pb[:, 5:].any()
    pairs = pb[:, :5].view(np.int16)                          # block, token, 24 i16
    sums = [xq.reshape(5, 2, 256 // n, n).sum(axis=3).transpose(1, 0, 2) for n in (32, 16)]
    np.testing.assert_array_equal(pairs[:, :, :8], sums[0])
    np.testing.assert_array_equal(pairs[:, :, 8:], sums[1])


@pytest.mark.skipif(not gemm_kquant.host_has_avx2(), reason="gemm_kquant is AVX2 code: this CPU has no AVX2")
def test_long_prompts_take_it_through_matmul_and_matmul_many():
    rng = np.random.default_rng(3)
    ws = [_readonly(random_blocks(T.Q4_K, n, 512, rng)) for n in (16, 40)] + [_readonly(random_blocks(T.Q6_K, 24, 512, rng))]
    qts = [T.Q4_K, T.Q4_K, T.Q6_K]
    X = rng.standard_normal((80, 512)).astype(np.float32)
    assert K.matmul_uses_int8(T.Q4_K, 80, 16) and MATVEC.matmul_path(T.Q4_K, 16, 80) == "kquant"   # not the row kernels
    assert K.matmul_uses_int8(T.Q6_K, 80, 16)
    # rows not in eights: the float GEMM, or the VNNI tiles where there is VNNI
    assert MATVEC.matmul_path(T.Q4_K, 20, 80) == ("tiles" if tile_gemm.has_vnni() else "blas")
    one = K.matmul(ws[0], T.Q4_K, X)
    six = K.matmul(ws[2], T.Q6_K, X)
    many = K.matmul_many(ws, qts, X)                 # Q/K/V with V in Q6_K: one packing
    np.testing.assert_array_equal(one, many[0])
    np.testing.assert_array_equal(six, many[2])
    np.testing.assert_array_equal(six, _gemm(ws[2], X, T.Q6_K))
    for w, got in zip(ws[:2], many[:2]):
        for t in (0, 41, 79):
            np.testing.assert_array_equal(got[t], K.matvec(w, T.Q4_K, X[t]))


@pytest.mark.skipif(not gemm_kquant.host_has_avx2(), reason="gemm_kquant is AVX2 code: this CPU has no AVX2")
def test_short_batches_route_by_size_and_keep_matvec_bits_in_decode_order():
    # a short prompt takes gemm_kquant from 12 tokens (Q4_K from 8 where the 32-row kernels
    # run); a speculative batch (decode_order) only where it keeps matvec's bits: Q4_K, never Q6_K
    rng = np.random.default_rng(5)
    w = _readonly(random_blocks(T.Q4_K, 32, 512, rng))
    w6 = _readonly(random_blocks(T.Q6_K, 32, 512, rng))
    q4k_from = 8 if gemm_kquant_wide.enabled() else 12
    assert MATVEC._Q4K_GEMM_MIN_TOKENS == q4k_from
    for n_tok, q6k_prompt in ((4, False), (8, False), (12, True), (17, True), (40, True)):
        q4k_prompt = q4k_exact = n_tok >= q4k_from
        assert MATVEC._kquant_gemm_for(T.Q4_K, 32, n_tok) == q4k_prompt
        # (Q6_K's crossover is 4 tokens on VNNI hosts, where its GEMM pays sooner)
        assert MATVEC._kquant_gemm_for(T.Q6_K, 32, n_tok) == (q6k_prompt or n_tok >= MATVEC._GEMM_MIN_TOKENS[T.Q6_K])
        with K.decode_order():
            assert MATVEC._kquant_gemm_for(T.Q4_K, 32, n_tok) == q4k_exact
            assert not MATVEC._kquant_gemm_for(T.Q6_K, 32, n_tok)   # its bits differ: the row kernels
        X = rng.standard_normal((n_tok, 512)).astype(np.float32)
        got = K.matmul(w, T.Q4_K, X)         # either path: matvec's bits
        with K.decode_order():
            got6 = K.matmul(w6, T.Q6_K, X)
        for t in range(n_tok):
            np.testing.assert_array_equal(got[t], K.matvec(w, T.Q4_K, X[t]), err_msg=f"Q4_K {n_tok} {t}")
            np.testing.assert_array_equal(got6[t], K.matvec(w6, T.Q6_K, X[t]), err_msg=f"Q6_K {n_tok} {t}")
        assert not MATVEC._in_decode_order()


def test_the_interleaved_copy_gives_the_same_bits():
    from edgeinfer.kernels_cpu import repack
    rng = np.random.default_rng(6)
    w = _readonly(random_blocks(T.Q4_K, 16, 768, rng))
    X = rng.standard_normal((9, 768)).astype(np.float32)
    np.testing.assert_array_equal(_gemm(repack.interleave_q4_k(w), X, 1012), _gemm(w, X))


@pytest.mark.skipif(not gemm_kquant.host_has_avx2(), reason="gemm_kquant is AVX2 code: this CPU has no AVX2")
def test_q3_k_q2_k_iq4_xs_prompts_route_to_it_outside_decode_order():
    # a Q3_K_M-style Q/K/V (Q3_K, Q2_K, IQ4_XS mixed with Q4_K) from 8 tokens: one packing for
    # all, each matrix's rows what the kernel alone gives; fewer tokens, or a speculative
    # batch, the row kernels (matvec's bits)
    rng = np.random.default_rng(6)
    qts = [T.Q3_K, T.Q2_K, T.IQ4_XS]
    ws = [_readonly(random_blocks(qt, 24, 512, rng)) for qt in qts]
    for n_tok in (4, 8, 70):
        X = rng.standard_normal((n_tok, 512)).astype(np.float32)
        for qt in qts:
            assert MATVEC._kquant_gemm_for(qt, 24, n_tok) == (n_tok >= 8)
        many = K.matmul_many(ws, qts, X)
        for w, qt, got in zip(ws, qts, many):
            if n_tok >= 8:
                np.testing.assert_array_equal(got, _gemm(w, X, qt))
            else:
                for t in range(n_tok):
                    np.testing.assert_array_equal(got[t], K.matvec(w, qt, X[t]))
        with K.decode_order():
            exact = K.matmul_many(ws, qts, X[:8])
        for w, qt, got in zip(ws, qts, exact):
            for t in range(min(n_tok, 8)):
                np.testing.assert_array_equal(got[t], K.matvec(w, qt, X[t]))
