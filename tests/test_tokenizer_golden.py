"""edgeinfer's tokenizer against llama.cpp's, token for token.

Goldens (`tests/data/tokenizer/golden_*.json`) come from `scripts/make_tokenizer_goldens.py`
with llama-cpp-python as the oracle; these tests only read them (no llama_cpp needed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgeinfer.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data" / "tokenizer"
CORPUS = json.loads((DATA / "corpus.json").read_text())
VOCABS = ("gemma3", "llama3", "qwen25", "llama3_gpt2", "llama3_default", "tiny_spm")


def corpus_input(entry: dict) -> bytes:
    if "hex" in entry:
        return bytes.fromhex(entry["hex"])
    return entry["text"].encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    import vocab_models
    return {name: vocab_models.tokenizer(name) for name in VOCABS}


def golden(name: str) -> dict:
    path = DATA / f"golden_{name}.json"
    if not path.exists():
        pytest.skip(f"{path.name} missing: run scripts/make_tokenizer_goldens.py")
    return json.loads(path.read_text())


def test_corpus_matches_goldens():
    for name in VOCABS:
        g = golden(name)
        assert [e["name"] for e in g["entries"]] == [e["name"] for e in CORPUS], name


@pytest.mark.parametrize("name", VOCABS)
def test_tokenize_matches_llama_cpp(tokenizers, name):
    tok, g = tokenizers[name], golden(name)
    mismatches = []
    for entry, gold in zip(CORPUS, g["entries"]):
        data = corpus_input(entry)
        for add in (True, False):
            for parse in (False, True):
                key = f"ids_{'bos' if add else 'nobos'}_{'special' if parse else 'plain'}"
                got = tok.tokenize(data, add_special=add, parse_special=parse)
                if got != gold[key]:
                    mismatches.append((entry["name"], key, got[:12], gold[key][:12]))
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]}"


@pytest.mark.parametrize("name", ("llama3", "qwen25", "llama3_gpt2", "llama3_default"))
def test_bpe_reference_path_matches_llama_cpp(tokenizers, name):
    """The plain-Python BPE (used for text that is not valid UTF-8) on the whole corpus."""
    tok, g = tokenizers[name], golden(name)
    for entry, gold in zip(CORPUS, g["entries"]):
        assert tok.tokenize_reference(corpus_input(entry), True, True) == gold["ids_bos_special"], entry["name"]


@pytest.mark.parametrize("name", VOCABS)
def test_detokenize_matches_llama_cpp(tokenizers, name):
    tok, g = tokenizers[name], golden(name)
    for entry, gold in zip(CORPUS, g["entries"]):
        ids = gold["ids_bos_special"]
        assert tok.detokenize_bytes(ids).hex() == gold["detok_render"], entry["name"]
        assert tok.detokenize_bytes(ids, skip_special=True).hex() == gold["detok_skip"], entry["name"]
        assert tok.detokenize_bytes(ids, skip_special=True, remove_special=True).hex() == \
            gold["detok_remove"], entry["name"]
        assert tok.detokenize_bytes(gold["ids_nobos_plain"], skip_special=True).hex() == \
            gold["detok_plain"], entry["name"]


@pytest.mark.parametrize("name", VOCABS)
def test_token_pieces_match_llama_cpp(tokenizers, name):
    tok, g = tokenizers[name], golden(name)
    assert tok.vocab_size == g["n_vocab"]
    for tid, (with_special, without) in g["pieces"].items():
        assert tok.token_to_piece(int(tid), special=True).hex() == with_special, tid
        assert tok.token_to_piece(int(tid), special=False).hex() == without, tid


@pytest.mark.parametrize("name", VOCABS)
def test_special_ids_and_eog_match_llama_cpp(tokenizers, name):
    tok, g = tokenizers[name], golden(name)
    special = g["special"]
    for key in ("bos_id", "eos_id", "pad_id", "fim_pre_id", "fim_suf_id", "fim_mid_id",
                "fim_pad_id", "fim_rep_id", "fim_sep_id"):
        expected = special[key] if special[key] >= 0 else None
        assert getattr(tok, key) == expected, key
    assert tok.add_bos == special["add_bos"] and tok.add_eos == special["add_eos"]
    assert sorted(tok.eog_ids) == g["eog"]
    assert all(tok.is_eog(t) for t in g["eog"])
    # llama.cpp picks EOT by walking a hash map when the file names none; any EOG token it
    # could pick is fine, but both must agree when the file does name it
    assert special["eot_id"] < 0 or tok.eot_id in tok.eog_ids
