"""The compiled attention (kernels_cpu/kv_attention.py) against the numpy reference
(Backend.attention), which spells out llama.cpp's rounding order: they must agree bit for
bit, and both must be a correct softmax attention (checked against float64 math)."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.backends.base import Backend
from edgeinfer.kernels_cpu.ggml_math_ref import SLOTS
from edgeinfer.kernels_cpu.ggml_math_ref import expf_nonpositive as ggml_expf
from edgeinfer.kernels_cpu import kv_attention
from edgeinfer.kernels_cpu.blas_sgemm import sgemm_address


class _Cache:
    def __init__(self, k, v, pos):
        self.k, self.v, self.pos = k, v, pos

    def layer_view(self, layer):
        return self.k, self.v, self.pos


def _case(rng, n, S, n_head, n_kv, hd, hdv):
    q = (rng.standard_normal((n, n_head, hd)) * 2).astype(np.float32)
    k = (rng.standard_normal((S, n_kv, hd)) * 2).astype(np.float16)
    v = rng.standard_normal((S, n_kv, hdv)).astype(np.float16)
    return q, k, v


def _float64_attention(q, k, v, kpos, qpos, scale, window):
    q16 = q.astype(np.float16).astype(np.float64)
    group = q.shape[1] // k.shape[1]
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for t, p in enumerate(qpos):
        ok = (kpos <= p) & ((p - kpos < window) if window else True)
        for h in range(q.shape[1]):
            s = k[ok, h // group].astype(np.float64) @ q16[t, h] * scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[ok, h // group].astype(np.float64)
    return out


@pytest.mark.parametrize("n,S,n_head,n_kv,hd,hdv,window", [
    (1, 37, 4, 1, 256, 256, 0),      # Gemma 3 270M decode shape
    (1, 300, 8, 2, 64, 64, 0),       # more keys than one 256-key pad
    (6, 13, 8, 2, 64, 64, 4),        # prefill rows, sliding window
    (3, 40, 6, 3, 80, 48, 0),        # head size with leftovers past 64, hd_v != hd
    (2, 2, 2, 2, 32, 32, 0),
    # the 16-key kernels: whole steps and leftovers, every head size they are built for
    (1, 1000, 32, 8, 64, 64, 0),     # a Llama-1B decode deep in a context
    (3, 600, 4, 1, 256, 256, 100),   # Gemma: a window inside a long cache
    (2, 517, 16, 4, 128, 128, 0),
    (1, 70, 4, 2, 32, 32, 0),
])
def test_kernel_equals_reference_bit_for_bit(n, S, n_head, n_kv, hd, hdv, window):
    rng = np.random.default_rng(S + hd)
    q, k, v = _case(rng, n, S, n_head, n_kv, hd, hdv)
    kpos, qpos = np.arange(S), np.arange(S - n, S)
    want = Backend(None).attention(q, _Cache(k, v, kpos), 0, qpos, 0.125, window)
    got = kv_attention.attention(q, k, v, kpos, qpos, 0.125, window)
    np.testing.assert_array_equal(got, want)
    exact = _float64_attention(q, k, v, kpos, qpos, 0.125, window)
    np.testing.assert_allclose(got, exact, atol=3e-3 * np.abs(exact).max())  # F16 weights


def test_masked_and_padded_keys_contribute_nothing():
    rng = np.random.default_rng(3)
    q, k, v = _case(rng, 1, 20, 4, 2, 64, 64)
    kpos = np.arange(20)
    full = kv_attention.attention(q, k, v, kpos, np.array([9]), 0.125)
    # keys after the query (positions 10..19) are masked: garbage there changes nothing
    k2, v2 = k.copy(), v.copy()
    k2[10:], v2[10:] = 7.0, -3.0
    np.testing.assert_array_equal(kv_attention.attention(q, k2, v2, kpos, np.array([9]), 0.125), full)


@pytest.mark.parametrize("seed", [178, 746, 954, 1039])
def test_window_keeps_the_softmax_groups_of_eight_slots(seed):
    # the softmax sums weights in groups of 8 slots counted from slot 0; a window that
    # starts inside a group must not regroup them (these cases' last bits differ if it does)
    rng = np.random.default_rng(seed)
    S, window = 64, int(rng.integers(20, 50))
    q = (rng.standard_normal((1, 4, 32)) * 1.5).astype(np.float32)
    k = (rng.standard_normal((S, 1, 32)) * 1.5).astype(np.float16)
    v = rng.standard_normal((S, 1, 32)).astype(np.float16)
    kpos, qpos = np.arange(S), np.array([S - 1])
    assert (S - window) % 8   # the window's first slot is inside a group
    want = Backend(None).attention(q, _Cache(k, v, kpos), 0, qpos, 0.125, window)
    np.testing.assert_array_equal(kv_attention.attention(q, k, v, kpos, qpos, 0.125, window), want)


def test_decode_kernel_sees_keys_by_position_in_any_slot_order():
    # after a context shift the cache's slots are not in position order: the kernel must
    # mask by position (garbage in masked slots changes nothing) and keep slot j's place
    # in the sums, as the reference does
    rng = np.random.default_rng(11)
    S = 300
    q, k, v = _case(rng, 2, S, 8, 2, 64, 64)
    kpos = rng.permutation(S) + 40
    kpos[rng.choice(S, 30, replace=False)] = 10_000          # slots not yet visible
    qpos = np.array([200, 330])
    for window in (0, 64):
        want = Backend(None).attention(q, _Cache(k, v, kpos), 0, qpos, 0.125, window)
        np.testing.assert_array_equal(kv_attention.attention(q, k, v, kpos, qpos, 0.125, window), want)
        k2, v2 = k.copy(), v.copy()
        hidden = kpos > qpos.max()
        k2[hidden], v2[hidden] = 9.0, -5.0
        np.testing.assert_array_equal(kv_attention.attention(q, k2, v2, kpos, qpos, 0.125, window), want)


def test_ggml_expf_is_exp():
    x = -np.linspace(0, 80, 100001, dtype=np.float32)
    e = ggml_expf(x)
    np.testing.assert_allclose(e, np.exp(x.astype(np.float64)), rtol=3e-7)
    assert ggml_expf(np.array([-np.inf, -200.0], np.float32)).tolist() == [0.0, 0.0]
    assert ggml_expf(np.array([0.0], np.float32))[0] == 1.0


def test_f16_cache_is_required():
    q = np.zeros((1, 1, 32), np.float32)
    k = np.zeros((1, 1, 32), np.float32)
    with pytest.raises(TypeError, match="F16"):
        kv_attention.attention(q, k, k, np.array([0]), np.array([0]), 1.0)


def test_rope_cache_follows_ggml_float32_angles():
    from edgeinfer.kernels_cpu.ops import rope_cache

    pos = np.array([0, 1, 7, 500, 32000])
    cos, sin = rope_cache(pos, 64, 10000.0, 0.5, None)
    # the angle is a float32 running product, as ggml_rope_cache_init computes it
    scale = np.float32(np.float64(10000.0) ** np.float64(np.float32(-2.0) / np.float32(64)))
    for t, p in enumerate(pos):
        theta = np.float32(p)
        for i in range(32):
            th = np.float32(np.float32(0.5) * theta)
            assert abs(cos[t, i] - np.cos(np.float64(th))) <= 1e-7 and abs(sin[t, i] - np.sin(np.float64(th))) <= 1e-7
            theta = np.float32(theta * scale)
    # and it is a rotation by the intended angle, up to float32 accuracy at small positions
    inv = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(cos[:4], np.cos(0.5 * pos[:4, None] * inv), atol=1e-5)


def test_backend_rope_rotates_pairs():
    x = np.random.default_rng(0).standard_normal((3, 2, 16)).astype(np.float32)
    pos = np.array([0, 3, 9])
    for mode in ("neox", "normal"):
        out = Backend(None).rope(x, pos, 16, 10000.0, 1.0, mode, None)
        np.testing.assert_array_equal(out[0], x[0])  # position 0 is the identity
        np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_blas_path_agrees_with_exact_path():
    rng = np.random.default_rng(5)
    q, k, v = _case(rng, 70, 90, 4, 1, 64, 64)
    kpos, qpos = np.arange(90), np.arange(20, 90)
    for window in (0, 16):
        exact = kv_attention.attention(q, k, v, kpos, qpos, 0.125, window)
        fast = kv_attention.attention_blas(q, k, v, kpos, qpos, 0.125, window)
        np.testing.assert_allclose(fast, exact, atol=2e-3 * np.abs(exact).max())


def test_vector_and_scalar_f16_dots_agree():
    rng = np.random.default_rng(9)
    for n in (32, 256, 96):
        k = rng.standard_normal(n).astype(np.float16).view(np.uint16)
        q = rng.standard_normal(n).astype(np.float16).astype(np.float32)
        nv = n - n % SLOTS   # the vector part (ggml adds the rest in double)
        scalar = kv_attention.dot_f16_scalar(k, q, nv, np.zeros(SLOTS, np.float32), SLOTS)
        if kv_attention._VECTOR_F16:
            assert kv_attention.dot_f16_vector(k, q, nv) == scalar
        exact = k[:nv].view(np.float16).astype(np.float64) @ q[:nv].astype(np.float64)
        assert abs(scalar - exact) <= 1e-5 * np.abs(q).sum() * 4


def test_blas_path_split_across_threads_agrees():
    from edgeinfer.kernels_cpu import get_threads, set_threads

    rng = np.random.default_rng(6)
    q, k, v = _case(rng, 150, 200, 4, 2, 64, 64)
    kpos, qpos = np.arange(200), np.arange(50, 200)
    before = get_threads()
    try:
        set_threads(1)
        one = kv_attention.attention_blas(q, k, v, kpos, qpos, 0.125, 32)
        set_threads(2)
        two = kv_attention.attention_blas(q, k, v, kpos, qpos, 0.125, 32)
    finally:
        set_threads(before)
    # BLAS may block a smaller row count differently (last-bit differences), nothing more
    np.testing.assert_allclose(two, one, rtol=1e-3, atol=1e-3 * np.abs(one).max())


def test_blas_path_blocks_see_only_their_keys_in_any_slot_order():
    # slots out of position order (as after a context shift) and a window: each query
    # block gathers the keys it sees instead of slicing a prefix
    rng = np.random.default_rng(8)
    q, k, v = _case(rng, 150, 180, 4, 2, 64, 64)
    kpos = rng.permutation(180)
    qpos = np.arange(30, 180)
    for window in (0, 40):
        exact = _float64_attention(q, k, v, kpos, qpos, 0.125, window)
        fast = kv_attention.attention_blas(q, k, v, kpos, qpos, 0.125, window)
        np.testing.assert_allclose(fast, exact, atol=2e-3 * np.abs(exact).max())


_THREADS_AFTER_BLAS_ATTENTION = """
import os, numpy as np
from edgeinfer.kernels_cpu import kv_attention, matvec, set_threads
set_threads(2)
matvec(np.zeros((8, 32), np.float32).view(np.uint8), 0, np.ones(32, np.float32))  # main's team
before = len(os.listdir("/proc/self/task"))
rng = np.random.default_rng(0)
q = rng.standard_normal((256, 4, 64)).astype(np.float32)
k = rng.standard_normal((256, 1, 64)).astype(np.float16)
kv_attention.attention_blas(q, k, k, np.arange(256), np.arange(256), 0.125)
print(len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_blas_attention_starts_no_openmp_team_on_the_worker_threads():
    # A Numba parallel region entered from a worker thread gives it its own OpenMP team;
    # with more OpenMP threads than cores libgomp stops spinning and every later decode
    # step slowed ~1.8x. The prefill attention runs on the main team where it can call
    # numpy's sgemm from Numba (no thread added), else on the pool's 2 threads.
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    added = subprocess.run([sys.executable, "-c", _THREADS_AFTER_BLAS_ATTENTION], env=env,
                           capture_output=True, text=True, check=True).stdout.split()[-1]
    assert int(added) == (0 if sgemm_address() else 2)


def test_blas_attention_on_the_team_and_on_the_pool_agree(monkeypatch):
    # the team's pieces (KV head x query block, numpy's sgemm called from Numba) against the
    # pool's numpy products and the exact kernel: GQA groups, two KV heads, windows, sinks
    if not sgemm_address():
        pytest.skip("numpy's BLAS has no 64-bit-integer cblas_sgemm: attention_blas keeps its pool path")
    rng = np.random.default_rng(11)
    q, k, v = _case(rng, 150, 170, 6, 2, 64, 64)
    kpos, qpos = np.arange(170), np.arange(20, 170)
    sinks = rng.standard_normal(6).astype(np.float32)
    for window, sk in ((0, None), (40, None), (0, sinks)):
        team = kv_attention.attention_blas(q, k, v, kpos, qpos, 0.125, window, sk)
        with monkeypatch.context() as m:
            m.setattr(kv_attention, "sgemm_address", lambda: 0)
            pool = kv_attention.attention_blas(q, k, v, kpos, qpos, 0.125, window, sk)
        exact = kv_attention.attention(q, k, v, kpos, qpos, 0.125, window, sk)
        scale = np.abs(exact).max()
        np.testing.assert_allclose(team, pool, atol=1e-4 * scale)
        np.testing.assert_allclose(team, exact, atol=2e-3 * scale)


def test_sgemm_from_numba_matches_numpy():
    from numba import njit

    from edgeinfer.kernels_cpu.blas_sgemm import sgemm

    fn = sgemm_address()
    if not fn:
        pytest.skip("numpy's BLAS has no 64-bit-integer cblas_sgemm")

    @njit
    def products(fn, a, b, bt, c1, c2):
        # rows 1.. of a (5 x 7 at a stride of 9), b's block from offset 3 (7 x 4, stride 6),
        # and bt (4 x 7 at a stride of 8) taken transposed
        sgemm(fn, 0, 5, 4, 7, a, 9, 9, b, 3, 6, c1, 0, 4)
        sgemm(fn, 1, 5, 4, 7, a, 9, 9, bt, 0, 8, c2, 0, 4)

    rng = np.random.default_rng(2)
    a = rng.standard_normal((6, 9)).astype(np.float32)
    b = rng.standard_normal((8, 6)).astype(np.float32)
    bt = rng.standard_normal((4, 8)).astype(np.float32)
    c1, c2 = np.zeros((5, 4), np.float32), np.zeros((5, 4), np.float32)
    products(fn, a, b, bt, c1, c2)
    a_ = a.reshape(-1)[9:9 + 5 * 9].reshape(5, 9)[:, :7].astype(np.float64)
    b_ = b.reshape(-1)[3:3 + 7 * 6].reshape(7, 6)[:, :4].astype(np.float64)
    np.testing.assert_allclose(c1, a_ @ b_, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c2, a_ @ bt[:, :7].astype(np.float64).T, rtol=1e-5, atol=1e-5)


class _SinkBackend(Backend):
    """The numpy reference with one named vector: the heads' attention sinks."""

    def __init__(self, sinks):
        super().__init__(None)
        self._sinks = sinks

    def vector(self, name):
        assert name == "sinks"
        return self._sinks


def _float64_sink_attention(q, k, v, kpos, qpos, scale, window, sinks):
    q16 = q.astype(np.float16).astype(np.float64)
    group = q.shape[1] // k.shape[1]
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for t, p in enumerate(qpos):
        ok = (kpos <= p) & ((p - kpos < window) if window else True)
        for h in range(q.shape[1]):
            s = k[ok, h // group].astype(np.float64) @ q16[t, h] * scale
            mx = max(s.max(), sinks[h])
            w = np.exp(s - mx)
            out[t, h] = (w / (w.sum() + np.exp(sinks[h] - mx))) @ v[ok, h // group].astype(np.float64)
    return out


@pytest.mark.parametrize("n,S,n_head,n_kv,hd,hdv,window", [
    (1, 37, 8, 2, 64, 64, 0),        # decode: the 16-key kernels
    (5, 300, 8, 2, 64, 64, 16),      # prefill rows, sliding window (gpt-oss's even layers)
    (3, 40, 6, 3, 80, 48, 0),        # the per-key loops
])
def test_sinks_kernel_equals_reference_and_float64(n, S, n_head, n_kv, hd, hdv, window):
    rng = np.random.default_rng(S + 7)
    q, k, v = _case(rng, n, S, n_head, n_kv, hd, hdv)
    # some sinks far above every score (they take most of the weight), some far below
    sinks = (rng.standard_normal(n_head) * 3).astype(np.float32)
    sinks[0], sinks[-1] = 40.0, -40.0
    kpos, qpos = np.arange(S), np.arange(S - n, S)
    want = _SinkBackend(sinks).attention(q, _Cache(k, v, kpos), 0, qpos, 0.125, window, sinks="sinks")
    got = kv_attention.attention(q, k, v, kpos, qpos, 0.125, window, sinks)
    np.testing.assert_array_equal(got, want)
    exact = _float64_sink_attention(q, k, v, kpos, qpos, 0.125, window, sinks)
    np.testing.assert_allclose(got, exact, atol=3e-3 * np.abs(exact).max() + 1e-6)
    plain = kv_attention.attention(q, k, v, kpos, qpos, 0.125, window)
    assert np.abs(got[:, 0]).max() < 0.1 * np.abs(plain[:, 0]).max()  # a big sink drains head 0
    blas = kv_attention.attention_blas(q, k, v, kpos, qpos, 0.125, window, sinks)
    np.testing.assert_allclose(blas, got, atol=2e-3 * np.abs(got).max() + 1e-6)


def test_no_sinks_is_the_same_as_minus_infinity_sinks():
    rng = np.random.default_rng(3)
    q, k, v = _case(rng, 2, 50, 4, 2, 64, 64)
    kpos, qpos = np.arange(50), np.arange(48, 50)
    none = kv_attention.attention(q, k, v, kpos, qpos, 0.125, 0)
    inf = kv_attention.attention(q, k, v, kpos, qpos, 0.125, 0, np.full(4, -np.inf, np.float32))
    np.testing.assert_array_equal(none, inf)
    with pytest.raises(ValueError, match="3 attention sinks for 4 heads"):
        kv_attention.attention(q, k, v, kpos, qpos, 0.125, 0, np.zeros(3, np.float32))
