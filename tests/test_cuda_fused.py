"""The fused GPU launches give the unfused launches' bits: Q/K/V in one matvec of mixed types,
gate/up with the activation, the residual in a matmul's or a norm's epilogue, RoPE of Q and K
together. The unfused kernels are tested against numpy in test_cuda_kernels.py, so equal bits
make these as right as they are. The model-level parity tests (test_gpu_paged_kv.py,
test_cuda_kernels.py) run the fused path since the families call these ops.
"""

from __future__ import annotations

import cuda_device
import numpy as np
import pytest
from cuda_device import gpuarray
from gguf import GGMLQuantizationType as Q
from gguf_factory import random_blocks

from edgeinfer.kernels_cuda import launch
from edgeinfer.rope import Yarn

cuda_device.require()


pytestmark = pytest.mark.usefixtures("gpu_both_orders")


def _matrix(qtype: Q, n_rows: int, n_cols: int, seed: int):
    rng = np.random.default_rng(seed)
    raw = np.ascontiguousarray(random_blocks(qtype, n_rows, n_cols, rng)).view(np.uint8).reshape(n_rows, -1)
    return gpuarray.to_gpu(raw)


def _x(n: int, n_cols: int, seed: int = 0):
    return gpuarray.to_gpu(np.random.default_rng(seed).standard_normal((n, n_cols)).astype(np.float32))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.F16, Q.Q5_0), (Q.MXFP4, Q.Q4_1)],
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_many_matrices_in_one_launch_give_each_matvecs_bits(types, n):
    n_cols = 256
    rows = [96, 32, 64][:len(types)]
    mats = [(_matrix(t, r, n_cols, i), t, r) for i, (t, r) in enumerate(zip(types, rows))]
    x = _x(n, n_cols)
    got = launch.linear_many(mats, n_cols, x)
    for (w, t, r), y in zip(mats, got):
        assert np.array_equal(y.get(), launch.linear(w, t, r, n_cols, x).get())


@pytest.mark.parametrize("act, unfused", [("silu", launch.silu_mul), ("gelu", launch.gelu_mul)])
@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q4_K), (Q.Q6_K, Q.Q8_0)], ids=lambda ts: "-".join(t.name for t in ts))
def test_gate_up_and_activation_in_one_launch(types, act, unfused):
    n_rows, n_cols = 200, 512
    (tg, tu) = types
    wg, wu = _matrix(tg, n_rows, n_cols, 1), _matrix(tu, n_rows, n_cols, 2)
    x = _x(2, n_cols, 3)
    got = launch.linear_glu((wg, tg), (wu, tu), n_rows, n_cols, x, act).get()
    want = unfused(launch.linear(wg, tg, n_rows, n_cols, x), launch.linear(wu, tu, n_rows, n_cols, x)).get()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("n", [1, 40])  # matvec and GEMM epilogues
def test_the_residual_in_the_matmuls_epilogue(n):
    w = _matrix(Q.Q4_K, 64, 256, 4)
    x, res = _x(n, 256, 5), _x(n, 64, 6)
    got = launch.linear(w, Q.Q4_K, 64, 256, x, res).get()
    assert np.array_equal(got, launch.add(res, launch.linear(w, Q.Q4_K, 64, 256, x)).get())


def test_the_residual_in_the_norms_epilogue():
    x, res = _x(3, 640, 7), _x(3, 640, 8)
    w = gpuarray.to_gpu(np.random.default_rng(9).standard_normal(640).astype(np.float32))
    got = launch.rms_norm(x, w, 1e-6, res).get()
    assert np.array_equal(got, launch.add(res, launch.rms_norm(x, w, 1e-6)).get())


@pytest.mark.parametrize("yarn", [None, Yarn(1.0, 1.2, 3.0, 20.0)], ids=["plain", "yarn"])
@pytest.mark.parametrize("neox", [False, True])
def test_rope_of_q_and_k_in_one_launch(neox, yarn):
    rng = np.random.default_rng(10)
    q = gpuarray.to_gpu(rng.standard_normal((3, 8, 64)).astype(np.float32))
    k = gpuarray.to_gpu(rng.standard_normal((3, 2, 64)).astype(np.float32))
    pos = gpuarray.to_gpu(np.array([5, 6, 90000], np.int32))
    ff = gpuarray.to_gpu((1.0 + rng.random(24)).astype(np.float32))
    args = (48, 10000.0, 0.5, neox, ff, yarn)
    qo, ko = launch.rope_qk(q, k, pos, *args)
    assert np.array_equal(qo.get(), launch.rope(q, pos, *args).get())
    assert np.array_equal(ko.get(), launch.rope(k, pos, *args).get())


def test_the_fused_launchers_refuse_what_they_cannot_take():
    w = _matrix(Q.Q8_0, 32, 64, 11)
    with pytest.raises(ValueError, match="up to 4 tokens"):
        launch.linear_many([(w, Q.Q8_0, 32)], 64, _x(5, 64))
    with pytest.raises(ValueError, match="1..3 matrices"):
        launch.linear_many([(w, Q.Q8_0, 32)] * 4, 64, _x(1, 64))
    with pytest.raises(ValueError, match="up to 4 tokens"):
        launch.linear_glu((w, Q.Q8_0), (w, Q.Q8_0), 32, 64, _x(5, 64), "silu")


@pytest.mark.parametrize("neox", [False, True])
def test_rope_and_the_kv_store_in_one_launch(neox):
    """Q rotated as rope_qk gives it; K rotated and V written into their paged f16 rows as
    kv_store writes them (blocks scattered through a table), and nothing else of the cache touched."""
    rng = np.random.default_rng(12)
    n, hq, hk, hd, bs = 3, 8, 2, 64, 4
    q = gpuarray.to_gpu(rng.standard_normal((n, hq, hd)).astype(np.float32))
    k = gpuarray.to_gpu(rng.standard_normal((n, hk, hd)).astype(np.float32))
    v = gpuarray.to_gpu(rng.standard_normal((n, hk, 48)).astype(np.float32))
    pos = gpuarray.to_gpu(np.array([9, 10, 11], np.int32))
    table = gpuarray.to_gpu(np.array([3, 1, 0, 2], np.int32))
    slots = gpuarray.to_gpu(np.array([7, 8, 9], np.int32))  # across a block boundary
    rope = (48, 10000.0, 1.0, neox, None, None)
    caches = []
    for _ in range(2):
        kc, vc = launch.zeros((4 * bs, hk, hd), np.float16), launch.zeros((4 * bs, hk, 48), np.float16)
        caches.append((kc, vc))
    q_fused = launch.rope_qk_store(q, k, v, pos, *caches[0], table, slots, bs, *rope).get()
    q_plain, k_plain = launch.rope_qk(q, k, pos, *rope)
    launch.kv_store(k_plain, v, *caches[1], table, slots, bs)
    assert np.array_equal(q_fused, q_plain.get())
    for fused, plain in zip(caches[0], caches[1]):
        assert np.array_equal(fused.get(), plain.get())
    assert np.count_nonzero(caches[0][0].get().any(axis=(1, 2))) == n  # only the three rows written
