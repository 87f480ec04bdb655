"""The CPU backend's fused decode layer (norm, SwiGLU MLP, residual) gives the op-by-op path's bits."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.backends.base import Backend
from edgeinfer.engine import Engine, EngineOptions
from edgeinfer.kernels_cpu import fused_layer
from edgeinfer.loader import open_model
from gguf_factory import TinyShape, spm_vocab, write_tiny_model


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "F32"])
def test_norm_swiglu_residual_equals_the_op_by_op_path(qtype, tmp_path, monkeypatch):
    # F32 has no 8-bit fast path: it must take the op-by-op path
    shape = TinyShape(n_embd=512, n_ff=768)
    path = write_tiny_model(tmp_path / "m.gguf", "llama", qtype, shape=shape, vocab=spm_vocab(), seed=3)
    be = Engine(open_model(path), EngineOptions(n_ctx=64, backend="cpu")).backend
    calls = []
    fused_fn = fused_layer.norm_swiglu_residual
    monkeypatch.setattr(fused_layer, "norm_swiglu_residual", lambda *a: calls.append(1) or fused_fn(*a))
    rng = np.random.default_rng(0)
    names = ("blk.1.ffn_norm.weight", 1e-5, "blk.1.ffn_gate.weight", "blk.1.ffn_up.weight",
             "blk.1.ffn_down.weight")
    for scale in (0.1, 3.0, 40.0):
        x = (rng.standard_normal((1, 512)) * scale).astype(np.float32)
        fused = be.norm_swiglu_residual(x, *names)
        assert fused.shape == (1, 512) and fused.dtype == np.float32
        np.testing.assert_array_equal(fused, Backend.norm_swiglu_residual(be, x, *names))
    assert len(calls) == (0 if qtype == "F32" else 3)
    # prefill rows take the op-by-op path
    x2 = rng.standard_normal((3, 512)).astype(np.float32)
    np.testing.assert_array_equal(be.norm_swiglu_residual(x2, *names), Backend.norm_swiglu_residual(be, x2, *names))
    assert len(calls) == (0 if qtype == "F32" else 3)
