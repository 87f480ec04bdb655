"""F16 and BF16 matrices on a long prompt: the row tiles split across the kernels' threads (each
converting its own rows) give the one-thread result bit for bit, and the float64 product's
values (BF16: of the activations rounded to BF16, as ggml's vec_dot_type for it is)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from edgeinfer.kernels_cpu import bf16_ggml_ref


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_half_weights_split_across_threads(qtype):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 96)).astype(np.float32)
    if qtype == T.F16:
        raw = w.astype(np.float16).view(np.uint8)
        wf = w.astype(np.float16).astype(np.float64)
    else:
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        raw = bits.view(np.uint8)
        wf = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    raw = raw.reshape(300, -1)
    X = rng.standard_normal((80, 96)).astype(np.float32)   # past the row kernels' 64 tokens
    before = K.get_threads()
    try:
        K.set_threads(1)
        one = K.matmul(raw, qtype, X)
        K.set_threads(2)
        two = K.matmul(raw, qtype, X)
    finally:
        K.set_threads(before)
    np.testing.assert_array_equal(one, two)
    Xw = X if qtype == T.F16 else bf16_ggml_ref.widen(bf16_ggml_ref.to_bf16(X))
    want = Xw.astype(np.float64) @ wf.T
    assert np.abs(two - want).max() <= 1e-4 * np.abs(want).max()
