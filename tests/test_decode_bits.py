"""Speculative verification runs the drafted tokens as one batch under decode_bits and
keeps the tokens a plain decode would have chosen, seeded sampling included. That holds only
if every row of the batch has exactly the bits of decoding its token alone: every matrix
(float routers and F16 tensors as well as the quantized ones), attention, recurrent state
and experts, in every family."""

import numpy as np
import pytest

from edgeinfer.engine import Engine, EngineOptions
from edgeinfer.loader import open_model
from gguf_factory import ARCHITECTURES, TinyShape, bpe_vocab, gemma4_vocab, spm_vocab, write_tiny_model


def _vocab(arch: str) -> dict:
    if arch == "gemma4":
        return gemma4_vocab()
    if arch.startswith("qwen35"):
        return bpe_vocab("qwen35")
    return bpe_vocab("qwen2") if arch.startswith("qwen") else spm_vocab()


def _batch_and_steps(path, n_batch: int):
    engine = Engine(open_model(path), EngineOptions(n_ctx=128, backend="cpu"))
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, engine.config.n_vocab, 30)
    batch = rng.integers(0, engine.config.n_vocab, n_batch)
    kv = engine.new_cache()
    engine.prefill(prompt, kv)
    n = kv.n_used
    got = engine.forward(batch, np.arange(n, n + n_batch), kv, logits_for=np.arange(n_batch), decode_bits=True)
    kv = engine.new_cache()
    engine.prefill(prompt, kv)
    want = np.stack([engine.decode(int(t), kv) for t in batch])
    return got, want


# F32: float routers and matrices; Q8_0 and Q4_K: the quantized rows (Q4_K repacked on
# AVX-512 hosts), with the F16/F32 tensors a tiny Q4_K file keeps where rows are not 256 wide
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_verified_batch_has_each_tokens_decode_bits(arch, qtype, tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", arch, qtype, vocab=_vocab(arch),
                            shape=TinyShape(n_layer=4))
    got, want = _batch_and_steps(path, 6)
    assert np.array_equal(got, want), f"max |diff| {np.abs(got - want).max():.3g}"


# every quantized type: inside decode_order no batch up to the row kernels' limit takes a
# GEMM of another summation order (dense or expert matrices), whatever the row count
def test_every_quant_type_keeps_the_row_kernels_in_decode_order():
    import importlib

    from edgeinfer.kernels_cpu import decode_order, quant_types

    matvec = importlib.import_module("edgeinfer.kernels_cpu.matvec")
    for qt in quant_types.fast_types():
        for n_rows in (256, 2048, 2056):
            for n_tok in (2, 8, 17, 64):
                with decode_order():
                    assert matvec.matmul_uses_rows(qt, n_tok, n_rows), (qt.name, n_rows, n_tok)
                    assert matvec._expert_gemm_path([int(qt)], n_rows, n_tok) is None
