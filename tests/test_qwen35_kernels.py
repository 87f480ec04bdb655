"""The gated DeltaNet kernels (kernels_cpu/delta_net.py) against their numpy references, bit
for bit; a prefill chunk equals the same tokens one decode step at a time; the snapshots a
pass takes equal the states stepping reaches. (End to end they reproduce llama.cpp's logits
bit for bit on Q8_0: tests/test_qwen35.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.kernels_cpu import delta_net as dn


def _inputs(rng, n, n_k=2, n_v=4, S=32):
    q = rng.standard_normal((n, n_k, S)).astype(np.float32)
    k = rng.standard_normal((n, n_k, S)).astype(np.float32)
    q, k = dn.l2_norm_reference(q, 1e-6), dn.l2_norm_reference(k, 1e-6)
    v = rng.standard_normal((n, n_v, S)).astype(np.float32)
    beta, g = dn.gates_reference(rng.standard_normal((n, n_v)), rng.standard_normal((n, n_v)),
                                 rng.standard_normal(n_v) * 0.1, -np.exp(rng.standard_normal(n_v)))
    state = (rng.standard_normal((n_v, S, S)) * 0.1).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("S", [32, 64, 128, 48, 16])  # 48, 16: the dot product's tail in double
def test_delta_rule_kernel_equals_reference(S):
    rng = np.random.default_rng(S)
    q, k, v, g, beta, state = _inputs(rng, 9, S=S)
    snap_at = [1, 4, 9]
    want_out, want_state, want_snaps = dn.delta_rule_reference(q, k, v, g, beta, state, snap_at)
    s = state.copy()
    out, got_state, snaps = dn.delta_rule(q, k, v, g, beta, s, snap_at)
    assert got_state is s
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(s, want_state)
    np.testing.assert_array_equal(snaps, want_snaps)


def test_vector_rows_equal_the_scalar_kernel():
    """The row-at-a-time vector kernel (S a multiple of 32) and the scalar one give the same
    bits, including states far from 1 and gates that decay nearly to 0."""
    rng = np.random.default_rng(11)
    q, k, v, g, beta, state = _inputs(rng, 5, n_k=2, n_v=4, S=128)
    state *= np.float32(1e4)
    g[2] = -30.0
    args = [np.ascontiguousarray(a) for a in (q, k, v, g, beta)]
    outs = []
    for kernel in (dn._delta_rule_kernel, dn._delta_rule_rows_kernel):
        s = state.copy()
        out = np.empty((5, 4, 128), np.float32)
        snap = np.array([3, 5], np.int64)
        snaps = np.empty((2,) + s.shape, np.float32)
        kernel(*args, s, out, snap, snaps, 0, 4)
        outs.append((out, s, snaps))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_value_heads_tile_key_heads():
    """value head h reads key head h % n_k (not h // (n_v / n_k))."""
    rng = np.random.default_rng(0)
    q, k, v, g, beta, state = _inputs(rng, 3, n_k=2, n_v=4)
    out, _, _ = dn.delta_rule_reference(q, k, v, g, beta, state.copy())
    # heads 0 and 2 share key head 0: give them one value and state, their outputs agree
    v[:, 2], g[:, 2], beta[:, 2], state[2] = v[:, 0], g[:, 0], beta[:, 0], state[0]
    out, _, _ = dn.delta_rule(q, k, v, g, beta, state.copy())
    np.testing.assert_array_equal(out[:, 2], out[:, 0])
    assert not np.array_equal(out[:, 1], out[:, 0])


def test_a_chunk_equals_decode_steps_and_its_snapshots_equal_the_steps_states():
    rng = np.random.default_rng(1)
    q, k, v, g, beta, state = _inputs(rng, 7)
    chunk_state = state.copy()
    out, _, snaps = dn.delta_rule(q, k, v, g, beta, chunk_state, [2, 5])
    step_state = state.copy()
    for t in range(7):
        o, _, _ = dn.delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], step_state)
        np.testing.assert_array_equal(o[0], out[t])
        if t + 1 == 2:
            np.testing.assert_array_equal(snaps[0], step_state)
        if t + 1 == 5:
            np.testing.assert_array_equal(snaps[1], step_state)
    np.testing.assert_array_equal(step_state, chunk_state)


@pytest.mark.parametrize("n", [6, 2])  # 2: fewer tokens than the window
def test_conv_kernel_equals_reference_and_steps(n):
    rng = np.random.default_rng(2)
    C, K = 96, 4
    window = rng.standard_normal((K - 1, C)).astype(np.float32)
    x = rng.standard_normal((n, C)).astype(np.float32)
    w = dn.conv_weight_t(rng.standard_normal((C, K)).astype(np.float32))
    points = [1, min(3, n)]
    want, want_window, want_snaps = dn.conv_silu_reference(window, x, w, points)
    got, got_window, snaps = dn.conv_silu(window, x, w, points)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_window, want_window)
    np.testing.assert_array_equal(snaps, want_snaps)
    win = window
    for t in range(n):
        o, win, _ = dn.conv_silu(win, x[t:t + 1], w)
        np.testing.assert_array_equal(o[0], got[t])
        if t + 1 in points:
            np.testing.assert_array_equal(win, snaps[points.index(t + 1)])
    np.testing.assert_array_equal(win, got_window)


def test_gates_norms_and_sigmoid_equal_references():
    rng = np.random.default_rng(3)
    b, a = (rng.standard_normal((5, 8)) * 8).astype(np.float32), (rng.standard_normal((5, 8)) * 12).astype(np.float32)
    dt, A = rng.standard_normal(8).astype(np.float32), -np.exp(rng.standard_normal(8)).astype(np.float32)
    for got, want in zip(dn.gates(b, a, dt, A), dn.gates_reference(b, a, dt, A)):
        np.testing.assert_array_equal(got, want)
    x = rng.standard_normal((5, 3, 32)).astype(np.float32)
    np.testing.assert_array_equal(dn.l2_norm(x, 1e-6), dn.l2_norm_reference(x, 1e-6))
    np.testing.assert_allclose(np.linalg.norm(dn.l2_norm(x, 1e-6), axis=-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(dn.sigmoid_mul(x, b[:, :1, None] * x), dn.ReferenceOps.sigmoid_mul(x, b[:, :1, None] * x))
    # softplus past 20 is the identity, as ggml's
    _, g = dn.gates_reference(np.zeros((1, 1)), np.array([[25.0]]), np.zeros(1), np.array([-1.0]))
    assert g[0, 0] == np.float32(-25.0)


def test_dot_product_is_ggmls_lane_order():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((3, 70)).astype(np.float32), rng.standard_normal(70).astype(np.float32)
    got = dn.dot32_reference(a, b)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-5)
