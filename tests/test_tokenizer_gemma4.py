"""Gemma 4's tokenizer (`tokenizer.ggml.model = gemma4`: SentencePiece-style BPE) against
llama.cpp's, on a small vocabulary with its features (gguf_factory.gemma4_vocab): spaces as
U+2581, merges over whole lines, `<0xXX>` byte fallback, newline runs taken whole, BOS forced."""

from __future__ import annotations

import pytest
from llama_oracle import importorskip_oracle

from gguf_factory import TinyShape, gemma4_vocab, write_tiny_model
from edgeinfer.gguf_file import GGUFFile
from edgeinfer.tokenizer import load_tokenizer

TEXTS = ["hello world", " hello  world ", "the café and the world\n\nhello", "\n\n\n", "x\ny",
         "Zürich ¿qué? 日本", "helloworld", "tab\there", "", " ", "<start_of_turn>hello<end_of_turn>",
         "in\n\nthe\n\n\n\nend", "a" * 300]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("g4") / "g4.gguf", "gemma4", "F32",
                            shape=TinyShape(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, head_dim=32,
                                            head_dim_swa=32, n_ff=128), vocab=gemma4_vocab())


@pytest.fixture(scope="module")
def tok(path):
    return load_tokenizer(GGUFFile.open(path))


@pytest.fixture(scope="module")
def oracle(path):
    llama_cpp = importorskip_oracle()
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def test_bos_is_forced_and_spaces_are_escaped(tok):
    from edgeinfer.tokenizer.spm_bpe import SpmBPEFast

    assert isinstance(tok._bpe_fast, SpmBPEFast)  # the fast path is the one tokenize() takes
    assert tok.add_bos and tok.tokenize("hello")[0] == tok.bos_id
    ids = tok.tokenize("hello world", add_special=False)
    assert "".join(tok.token_text(i) for i in ids) == "hello\u2581world" and tok.token_text(ids[-1]) == "\u2581world"
    assert tok.tokenize("\n\n", add_special=False) == [tok.token_id("\n\n")]  # whole, not merged
    assert [tok.token_text(i) for i in tok.tokenize("日", add_special=False)] == ["<0xE6>", "<0x97>", "<0xA5>"]


@pytest.mark.parametrize("text", TEXTS)
def test_tokens_and_text_equal_llama_cpp(tok, oracle, text):
    for add_special, special in ((True, False), (False, False), (True, True)):
        want = oracle.tokenize(text.encode(), add_bos=add_special, special=special)
        assert tok.tokenize(text, add_special=add_special, parse_special=special) == want, (text, add_special)
        assert tok.tokenize_reference(text, add_special, special) == want
    ids = oracle.tokenize(text.encode(), add_bos=True, special=True)
    for remove_special in (False, True):
        for unparse in (False, True):
            assert tok.detokenize_bytes(ids, skip_special=not unparse, remove_special=remove_special) == \
                llama_detokenize(oracle, ids, remove_special, unparse), (text, remove_special, unparse)


def llama_detokenize(oracle, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
    """llama.cpp's own llama_detokenize (Llama.detokenize adds a leading-space strip of its own)."""
    import ctypes

    import llama_cpp

    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_detokenize(oracle._model.vocab, arr, len(ids), buf, len(buf), remove_special, unparse_special)
    assert n >= 0
    return buf.raw[:n]
