"""kernels_cpu.attention_f32_ggml: libmtmd's non-flash encoder attention in ggml's order, bit for bit.

The softmax against its numpy twin (attention_f32_ggml_ref) and the whole attention against
the oracle's own ggml graph (tests/ggml_attention_oracle.py). The shapes take both of
ggml's paths for the weighted values (tinyBLAS: a key count that is a multiple of its vector
and a head size of 4; vec_dot_f32 otherwise), head sizes with and without vec_dot's tail,
and key counts with and without leftovers past the softmax's last vector."""
from __future__ import annotations

import ggml_attention_oracle as gao
import numpy as np
import pytest
from ggml_lib import oracle_ggml

from edgeinfer.kernels_cpu import attention_f32_ggml, attention_f32_ggml_ref


@pytest.mark.parametrize("n", [1, 7, 16, 33, 100])
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_softmax_rows_equal_the_reference(n, scale):
    rng = np.random.default_rng(n)
    s = (rng.standard_normal((5, n)) * 4).astype(np.float32)
    want = attention_f32_ggml_ref.softmax_rows(s, scale)
    got = s.copy()
    attention_f32_ggml.softmax_rows(got, np.float32(scale))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n,n_head,d", [(9, 2, 16), (37, 3, 72), (64, 2, 64), (50, 1, 36), (48, 2, 18), (81, 2, 16)])
def test_attention_equals_ggml_s_graph(n, n_head, d):
    rng = np.random.default_rng(n * 100 + d)
    q, k, v = (rng.standard_normal((n, n_head, d)).astype(np.float32) for _ in range(3))
    scale = 1.0 / np.sqrt(d)
    want = gao.attention_f32(oracle_ggml(), q, k, v, scale)
    got = attention_f32_ggml.attention(q, k, v, scale)
    np.testing.assert_array_equal(got, want)
