"""The gated DeltaNet CUDA kernels (kernels_cuda/recurrent.cu) against the numpy references
of kernels_cpu/delta_net.py: the delta rule with its snapshots, tiled key heads and the
state carried across calls; the conv, the gates, the L2 norm and the sigmoid gate.

On the GPU pycuda finds, else on the CUDA emulator (tests/cuda_device.py: every launch run
twice, blocks and threads forward and reversed, and the bytes compared)."""

from __future__ import annotations

import cuda_device
import numpy as np
import pytest
from cuda_device import gpuarray

from edgeinfer.kernels_cpu import delta_net as dn
from edgeinfer.kernels_cuda import launch

cuda_device.require()


pytestmark = pytest.mark.usefixtures("gpu_both_orders")


def _up(a):
    return gpuarray.to_gpu(np.ascontiguousarray(a, np.float32))


def _inputs(rng, n, n_k, n_v, S):
    q = dn.l2_norm_reference(rng.standard_normal((n, n_k, S)).astype(np.float32), 1e-6)
    k = dn.l2_norm_reference(rng.standard_normal((n, n_k, S)).astype(np.float32), 1e-6)
    v = rng.standard_normal((n, n_v, S)).astype(np.float32)
    beta, g = dn.gates_reference(rng.standard_normal((n, n_v)), rng.standard_normal((n, n_v)),
                                 rng.standard_normal(n_v) * 0.1, -np.exp(rng.standard_normal(n_v)))
    state = (rng.standard_normal((n_v, S, S)) * 0.1).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("n,n_k,n_v,S", [(7, 2, 4, 32), (3, 1, 2, 64), (1, 2, 2, 128)])
def test_delta_rule_and_snapshots(n, n_k, n_v, S):
    rng = np.random.default_rng(n * S)
    q, k, v, g, beta, state = _inputs(rng, n, n_k, n_v, S)
    snap_at = [m for m in (1, 3, n) if m <= n]
    snap_at = sorted(set(snap_at))
    want_out, want_state, want_snaps = dn.delta_rule_reference(q, k, v, g, beta, state, snap_at)
    st = _up(state)
    out, snaps = launch.delta_rule(_up(q), _up(k), _up(v), _up(g), _up(beta), st,
                                   gpuarray.to_gpu(np.array(snap_at, np.int32)), len(snap_at))
    np.testing.assert_allclose(out.get(), want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(st.get(), want_state, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(snaps.get()[:len(snap_at)], want_snaps, rtol=1e-4, atol=1e-5)


def test_delta_rule_carries_the_state_across_calls():
    rng = np.random.default_rng(3)
    q, k, v, g, beta, state = _inputs(rng, 6, 2, 4, 32)
    want_out, want_state, _ = dn.delta_rule_reference(q, k, v, g, beta, state)
    st = _up(state)
    outs = []
    for lo, hi in ((0, 4), (4, 5), (5, 6)):  # a prefill chunk, then decode steps
        out, _ = launch.delta_rule(_up(q[lo:hi]), _up(k[lo:hi]), _up(v[lo:hi]), _up(g[lo:hi]), _up(beta[lo:hi]), st)
        outs.append(out.get())
    np.testing.assert_allclose(np.concatenate(outs), want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(st.get(), want_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [1, 5])
def test_conv_silu(n):
    rng = np.random.default_rng(n)
    C, K = 96, 4
    window = rng.standard_normal((K - 1, C)).astype(np.float32)
    x = rng.standard_normal((n, C)).astype(np.float32)
    w_t = dn.conv_weight_t(rng.standard_normal((C, K)).astype(np.float32))
    want, _, _ = dn.conv_silu_reference(window, x, w_t)
    got = launch.conv_silu(_up(np.concatenate([window, x])), _up(w_t)).get()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_gates_norm_and_sigmoid():
    rng = np.random.default_rng(9)
    b, a = (rng.standard_normal((5, 8)) * 8).astype(np.float32), (rng.standard_normal((5, 8)) * 12).astype(np.float32)
    dt, ssm_a = (rng.standard_normal(8) * 0.1).astype(np.float32), -np.exp(rng.standard_normal(8)).astype(np.float32)
    want_beta, want_g = dn.gates_reference(b, a, dt, ssm_a)
    beta, g = launch.delta_gates(_up(b), _up(a), _up(dt), _up(ssm_a))
    np.testing.assert_allclose(beta.get(), want_beta, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g.get(), want_g, rtol=1e-5, atol=1e-5)
    x = rng.standard_normal((6, 3, 64)).astype(np.float32)
    np.testing.assert_allclose(launch.l2_norm_rows(_up(x), 1e-6).get(), dn.l2_norm_reference(x, 1e-6),
                               rtol=1e-5, atol=1e-6)
    gate = (rng.standard_normal((4, 32)) * 5).astype(np.float32)
    y = rng.standard_normal((4, 32)).astype(np.float32)
    np.testing.assert_allclose(launch.sigmoid_mul(_up(y), _up(gate)).get(), y * dn.sigmoid_reference(gate),
                               rtol=1e-5, atol=1e-6)


def test_qkv_split_norm():
    rng = np.random.default_rng(12)
    n, n_k, n_v, S = 3, 2, 4, 32
    xc = rng.standard_normal((n, (2 * n_k + n_v) * S)).astype(np.float32)
    q, k, v = launch.qkv_split_norm(_up(xc), n_k, n_v, S, 1e-6)
    kd = n_k * S
    np.testing.assert_allclose(q.get(), dn.l2_norm_reference(xc[:, :kd].reshape(n, n_k, S), 1e-6), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(k.get(), dn.l2_norm_reference(xc[:, kd:2 * kd].reshape(n, n_k, S), 1e-6),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(v.get(), xc[:, 2 * kd:].reshape(n, n_v, S))
