"""Embeddings: WordPiece ids and pooled vectors equal llama.cpp's on the same tiny files
(bert, nomic-bert, qwen3 with pooling), the encoder ops against plain numpy, and the
library's input rules (truncation, dimensions, token ids, errors)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from llama_oracle import importorskip_oracle
from gguf_factory import TinyShape, bpe_vocab, write_tiny_model
from gguf_factory_embed import write_tiny_encoder

import edgeinfer
from edgeinfer.backends.base import ReferenceBackend
from edgeinfer.embedding import normalize_vector
from edgeinfer.errors import ContextOverflowError, EdgeInferError
from edgeinfer.gguf_file import GGUFFile
from edgeinfer.tokenizer import load_tokenizer

CORPUS = [c["text"].encode("utf-8", "surrogatepass") if "text" in c else bytes.fromhex(c["hex"])
          for c in json.loads((Path(__file__).parent / "data/tokenizer/corpus.json").read_text())]
EXTRA = ["The unwanted runnning, affable café!", "  中文 e\u0301 ÉCOLE [SEP] x",
         "a\u093eb a\u20ddb a\u200bb 😀 x\u2028y ^`$~| ° Å 한 ẞ İ", "\x00a\tb\n\nc\r\n"]
TEXTS = ["Hello world", "The unwanted runnning, affable café!", "def f(x): return x*2 " * 5, "a"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("embed")
    qwen = TinyShape(n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=256)
    return {
        ("bert", 1): write_tiny_encoder(d / "bert-mean.gguf", "bert", pooling=1),
        ("bert", 2): write_tiny_encoder(d / "bert-cls.gguf", "bert", pooling=2, fused_qkv=True),
        ("nomic-bert", 1): write_tiny_encoder(d / "nomic-mean.gguf", "nomic-bert", pooling=1),
        ("qwen3", 3): write_tiny_model(d / "qwen3-last.gguf", "qwen3", vocab=bpe_vocab("qwen2"), shape=qwen,
                                       extra_metadata={"qwen3.pooling_type": 3}),
        ("qwen3", 1): write_tiny_model(d / "qwen3-mean.gguf", "qwen3", vocab=bpe_vocab("qwen2"), shape=qwen,
                                       extra_metadata={"qwen3.pooling_type": 1}),
    }


def cosine(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_wordpiece_ids_match_llama_cpp(files):
    llama_cpp = importorskip_oracle()
    path = files[("bert", 1)]
    ref = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=128, verbose=False)
    tok = load_tokenizer(GGUFFile.open(path))
    for text in CORPUS + [t.encode() for t in EXTRA]:
        assert tok.tokenize(text) == ref.tokenize(text, add_bos=True, special=False), repr(text)
        assert tok.tokenize(text, add_special=False) == ref.tokenize(text, add_bos=False, special=False), repr(text)


@pytest.mark.parametrize("key", [("bert", 1), ("bert", 2), ("nomic-bert", 1), ("qwen3", 3), ("qwen3", 1)],
                         ids=lambda k: f"{k[0]}-pool{k[1]}")
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_embeddings_match_llama_cpp(files, key, backend):
    llama_cpp = importorskip_oracle()
    path = files[key]
    ref = llama_cpp.Llama(model_path=str(path), embedding=True, pooling_type=key[1], n_ctx=128,
                          n_threads=1, verbose=False)
    want = np.array(ref.embed(TEXTS, normalize=True))
    model = edgeinfer.load(str(path), n_ctx=128, backend=backend, threads=1)
    got = np.array(model.embed(TEXTS))
    assert got.shape == want.shape
    assert cosine(got, want).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_inputs_batched_equal_one_at_a_time(files):
    model = edgeinfer.load(str(files[("bert", 1)]), n_ctx=128, backend="reference")
    together = np.array(model.embed(TEXTS))
    alone = np.array([model.embed(t)[0] for t in TEXTS])
    np.testing.assert_allclose(together, alone, atol=1e-6)
    ids = model.tokenize("Hello world")
    np.testing.assert_allclose(model.embed(ids)[0], together[0], atol=1e-6)   # token-id input
    np.testing.assert_allclose(model.embed([ids, ids])[1], together[0], atol=1e-6)


def test_truncate_dimensions_and_errors(files):
    model = edgeinfer.load(str(files[("bert", 1)]), n_ctx=16, backend="reference")
    long = "hello world " * 20
    with pytest.raises(ContextOverflowError, match="truncate"):
        model.embed(long)
    cut = model.embed(long, truncate=True)[0]
    ids = model.tokenize(long)
    np.testing.assert_allclose(cut, model.embed(ids[:15] + ids[-1:])[0], atol=1e-6)  # [SEP] kept
    short = model.embed("hello", dimensions=8)[0]
    assert len(short) == 8 and abs(np.linalg.norm(short) - 1) < 1e-5
    with pytest.raises(EdgeInferError, match="dimensions"):
        model.embed("hello", dimensions=10_000)
    with pytest.raises(EdgeInferError, match="out of range"):
        model.embed([[1, 2, 99999]])
    raw = model.embed("hello", normalize=False)[0]
    assert abs(np.linalg.norm(raw) - 1) > 1e-3
    with pytest.raises(EdgeInferError, match="cannot generate"):
        model.generate("hello", max_tokens=2)


def test_generation_model_embeds_its_last_token(tmp_path):
    path = write_tiny_model(tmp_path / "plain.gguf", "qwen3", vocab=bpe_vocab("qwen2"),
                            shape=TinyShape(n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=128))
    model = edgeinfer.load(str(path), n_ctx=64, backend="reference")
    v = model.embed(["hello world", "the"])
    assert len(v) == 2 and len(v[0]) == 64


def test_encoder_ops_against_numpy(files):
    be = ReferenceBackend(GGUFFile.open(files[("bert", 1)]))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w, b = be.vector("token_embd_norm.weight"), be.vector("token_embd_norm.bias")
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-12) * w + b
    np.testing.assert_allclose(be.layer_norm(x, "token_embd_norm.weight", "token_embd_norm.bias", 1e-12),
                               want, rtol=1e-5, atol=1e-5)
    g = be.gelu(x)
    exact = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(g, exact, rtol=2e-3, atol=2e-3)   # ggml's F16 table
    q, k, v = (rng.standard_normal((4, 2, 8)).astype(np.float32) for _ in range(3))
    s = np.einsum("thd,shd->hts", q, k) * 0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(be.attention_full(q, k, v, 0.5), np.einsum("hts,shd->thd", p, v), rtol=1e-5, atol=1e-6)


def test_normalize_modes():
    v = np.array([3.0, -4.0], np.float32)
    assert normalize_vector(v, 2).tolist() == pytest.approx([0.6, -0.8])
    assert normalize_vector(v, 1).tolist() == pytest.approx([3 / 7, -4 / 7])
    assert normalize_vector(v, -1).tolist() == [3.0, -4.0]
    assert normalize_vector(v, 0).tolist() == pytest.approx([3 * 32760 / 4, -32760])
    assert normalize_vector(np.zeros(2), 2).tolist() == [0.0, 0.0]


def test_cli_embed_prints_one_json_line_per_text(files, capsys, monkeypatch):
    import io

    from edgeinfer.cli import main

    path = str(files[("bert", 1)])
    assert main(["embed", path, "hello world", "the code", "--backend", "reference", "--dimensions", "4"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["text"] for d in lines] == ["hello world", "the code"] and len(lines[0]["embedding"]) == 4
    monkeypatch.setattr("sys.stdin", io.StringIO("a\n\nb\n"))
    assert main(["embed", path, "--backend", "reference"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(["embed", path, "--backend", "reference", "hello " * 200]) != 0
    assert "truncate" in capsys.readouterr().err
