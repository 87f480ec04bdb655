"""The unigram SentencePiece tokenizer (`tokenizer.ggml.model = "t5"`: XLM-R, bge-m3,
bge-reranker-v2-m3) against llama.cpp's llm_tokenizer_ugm, on XLM-R-shaped vocabularies of
ugm_factory: the precompiled charsmap's normalization (an NFKC-like one built by the test),
the whitespace flags, Viterbi with ties and the unknown-token penalty, user-defined tokens,
unused pieces, BOS / EOS, detokenization; and a corrupt charsmap as one error line."""

from __future__ import annotations

import numpy as np
import pytest
from llama_oracle import importorskip_oracle

from edgeinfer.errors import EdgeInferError, TokenizerError
from edgeinfer.gguf_file import GGUFFile
from edgeinfer.tokenizer import Tokenizer, load_tokenizer
from test_tokenizer_gemma4 import llama_detokenize
from ugm_factory import build_charsmap, nfkc_rules, ugm_vocab, write_ugm_encoder

TEXTS = [
    "", " ", "   ", "\t\n", "hello world", " hello  world ", "  leading", "trailing   ", "a  b   c    d",
    "hello\tworld\nnew\r\nline", "the code search query", "thequeryrank",
    "café naïve Zürich straße über résumé", "cafe\u0301 nai\u0308ve", "e\u0301\u0301", "C\u0327a",
    "ﬁle ﬃ ＡＢＣ １２３ ① ½ ™ …", "\u3000full\u3000width\u3000", "no\u00a0break", "zero\u200bwidth\ufeff",
    "日本語 中文 한국어", "русский мир ελληνικά", "Ω≈ 😀 x ∑", "\U0001F600\U0001F601", "?!?", "....",
    "<ud>", "<ud>x<u", "<u<ud<sep2>y", "a<sep2>b", "<s>hello</s>", "the</s>end<mask>", "[PAD440]",
    "\u2581already\u2581escaped", "xΩ", "a xΩ", "zΩ zΩx", "ΨΨ x", "™ TM ™x", "\x00nul\x00", "ctrl\x01\x02\x7f", "\ufffd", "ß" * 5, "word " * 40,
]
BYTES = [b"\xff", b"bad\xc3(", b"\xe2\x96", b"ok\x80\x80ok", b"\xf0\x9f\x98", b"\xed\xa0\x80x", b"\xc0\xafend"]
FUZZ_ALPHABET = (list("abcdeghilnorstuwxyzABC019.,'-") + [" ", " ", "  ", "\t", "\n"]
                 + ["é", "e\u0301", "ü", "ß", "ﬁ", "Ａ", "①", "½", "\u3000", "\u00a0", "\u200b", "\x00",
                    "😀", "Ω", "日本", "語", "한", "мир", "<ud>", "<u", "</s>", "<s>", "\u2581", "\ufffd",
                    "hello", "world", "code", "rank", "xΩ", "zΩ", "Ψ", "™", "TM"])
CONFIGS = {
    "xlmr": {},
    "keep-spaces": {"remove_extra_whitespaces": False},
    "no-prefix": {"add_space_prefix": False, "remove_extra_whitespaces": False},
    "no-charsmap": {"charsmap": False, "user_defined": False},
}


def fuzz_texts(n: int = 150, seed: int = 1) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(FUZZ_ALPHABET[k] for k in rng.integers(0, len(FUZZ_ALPHABET), rng.integers(1, 24)))
            for _ in range(n)]


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    llama_cpp = importorskip_oracle()
    path = write_ugm_encoder(tmp_path_factory.mktemp("ugm") / f"{request.param}.gguf",
                             ugm_vocab(**CONFIGS[request.param]))
    return load_tokenizer(GGUFFile.open(path)), llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def test_xlmr_flags(pair):
    tok, oracle = pair
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(oracle.model)
    assert tok.model == "t5" and tok.add_bos and tok.add_eos and tok.add_sep
    assert (tok.bos_id, tok.eos_id, tok.sep_id, tok.unk_id) == (0, 2, 2, 3)
    assert (llama_cpp.llama_vocab_get_add_bos(vocab), llama_cpp.llama_vocab_get_add_eos(vocab),
            llama_cpp.llama_vocab_get_add_sep(vocab)) == (True, True, True)
    assert tok.tokenize("") == [0, 2]


@pytest.mark.parametrize("which", ["listed", "bytes", "fuzz"])
def test_tokens_equal_llama_cpp(pair, which):
    tok, oracle = pair
    texts = {"listed": TEXTS, "bytes": BYTES, "fuzz": fuzz_texts()}[which]
    checked = 0
    for text in texts:
        data = text if isinstance(text, bytes) else text.encode()
        for add_special, special in ((True, False), (False, False), (True, True)):
            want = oracle.tokenize(data, add_bos=add_special, special=special)
            got = tok.tokenize(data, add_special=add_special, parse_special=special)
            assert got == want, (text, add_special, special)
            checked += 1
    assert checked == 3 * len(texts)


def test_paths_really_differ(pair):
    """The fixtures exercise what they claim: UNK runs merged, normalization applied."""
    tok, _ = pair
    unk = tok.tokenize("Ω≈ 😀", add_special=False)
    assert tok.unk_id in unk and unk.count(tok.unk_id) < 3
    omega = tok.tokenize("xΩ", add_special=False)   # the UNK penalty decides
    assert tok.token_id("x\u03a9") in omega or not tok.add_space_prefix
    assert tok.unk_id in tok.tokenize("zΩ", add_special=False) or not tok.add_space_prefix
    assert tok.tokenize("Ψ", add_special=False)[-1] == tok.token_id("\u03a8")   # unused pieces match
    if tok._ugm._charsmap is not None:
        assert tok.tokenize("ﬁ", add_special=False) == tok.tokenize("fi", add_special=False)
        assert tok.tokenize("Ａ", add_special=False) == tok.tokenize("A", add_special=False)


@pytest.mark.parametrize("text", TEXTS[:30] + fuzz_texts(20, seed=2))
def test_detokenize_equals_llama_cpp(pair, text):
    tok, oracle = pair
    ids = oracle.tokenize(text.encode(), add_bos=True, special=True)
    for remove_special in (False, True):
        for unparse in (False, True):
            assert tok.detokenize_bytes(ids, skip_special=not unparse, remove_special=remove_special) == \
                llama_detokenize(oracle, ids, remove_special, unparse), (text, remove_special, unparse)


# -- the charsmap is input: corrupt ones are one line --------------------------------------

def _meta(charsmap) -> dict:
    v = ugm_vocab(charsmap=False)
    meta = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": v["tokens"],
            "tokenizer.ggml.scores": v["scores"], "tokenizer.ggml.token_type": v["types"],
            "tokenizer.ggml.add_space_prefix": True, "tokenizer.ggml.unknown_token_id": 3}
    if charsmap is not None:
        meta["tokenizer.ggml.precompiled_charsmap"] = (np.frombuffer(charsmap, np.uint8).copy()
                                                       if isinstance(charsmap, bytes) else charsmap)
    return meta


def _with_unit(blob: bytes, index: int, unit: int) -> bytes:
    units = np.frombuffer(blob, "<u4", count=int.from_bytes(blob[:4], "little") // 4, offset=4).copy()
    units[index] = unit
    return blob[:4] + units.tobytes() + blob[4 + 4 * len(units):]


def _corrupt() -> dict[str, object]:
    good = build_charsmap({b"a": b"b", b"ab": b"X", "ﬁ".encode(): b"fi"})
    size = int.from_bytes(good[:4], "little")
    units = np.frombuffer(good, "<u4", count=size // 4, offset=4)
    root_base = int(units[0]) >> 10
    child = root_base ^ ord("a")                       # the unit of key "a"
    leaf = child ^ (int(units[child]) >> 10)           # its leaf, holding the replacement offset
    return {
        "short": b"\x01\x00",
        "size past the end": (10 ** 6).to_bytes(4, "little") + good[4:],
        "no strings": size.to_bytes(4, "little") + good[4:4 + size],
        "child past the end": _with_unit(good, 0, (1 << 20) << 10),
        "leaf past the strings": _with_unit(good, leaf, (1 << 31) | 10 ** 6),
        "unterminated": good[:-1] + b"Z",
        "not bytes": np.array([1, 2, 3, 4, 5, 6], np.int32),
        "a string": "abc",
    }


@pytest.mark.parametrize("case", list(_corrupt()))
def test_corrupt_charsmap_is_one_line(case):
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_metadata(_meta(_corrupt()[case]))
    line = str(err.value)
    assert "precompiled_charsmap" in line and "\n" not in line


def test_corrupt_charsmap_in_a_file_is_one_line(tmp_path):
    """Through the loader too: an EdgeInferError naming the key, no traceback from deep inside."""
    import edgeinfer

    vocab = ugm_vocab(charsmap=False)
    write = vocab["write"]

    def write_corrupt(w):
        write(w)
        w.add_precompiled_charsmap(_corrupt()["leaf past the strings"])

    vocab["write"] = write_corrupt
    path = write_ugm_encoder(tmp_path / "bad.gguf", vocab)
    with pytest.raises(EdgeInferError, match="precompiled_charsmap is corrupt"):
        edgeinfer.load(str(path), n_ctx=64, backend="reference")


def test_good_charsmap_rules():
    """The builder and the reader agree on every rule; the longest key wins, a byte 0 stops."""
    rules = nfkc_rules()
    tok = Tokenizer.from_metadata(_meta(build_charsmap(rules)))
    cm = tok._ugm._charsmap
    assert all(cm.match(k, 0) == (len(k), v) for k, v in rules.items())
    assert cm.match(b"xe\xcc\x81", 1) == (3, "é".encode()) and cm.match(b"e\x00\xcc\x81", 0) is None
    assert tok._ugm.normalize("  ﬁ  ①\tx ".encode()) == "\u2581\u2581\u2581fi\u2581\u25811\u2581x\u2581".encode()
