"""gpt-oss's tokenizer (o200k_harmony, `tokenizer.ggml.pre = gpt-4o`) against llama.cpp.

Three oracles, all llama-cpp-python's own build: its `unicode_regex_split` for the words
(`llama_split_oracle.py`, in a subprocess), its tokenizer over a small vocabulary with the
harmony special tokens and over the real o200k_harmony vocabulary (from the `quicktok` data,
as vocab_models builds Llama 3's), and its EOG set. Texts with runs under ~20k characters
only: llama.cpp's std::regex recurses per character and crashes on longer ones.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import pytest
from llama_oracle import importorskip_oracle
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gguf_factory import bpe_vocab, merge_chains, write_tiny_model
from edgeinfer.errors import TokenizerError
from edgeinfer.gguf_file import GGUFFile
from edgeinfer.tokenizer import TokenAttr, Tokenizer, load_tokenizer
from edgeinfer.tokenizer.bpe import FastSplitter, byte_encode, cpt_class, cpt_to_utf8, \
    decode_utf8_lenient, lenient_text, split_words
from edgeinfer.tokenizer.gpt4o import split_gpt4o

# llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GPT4O
_ENDING = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
GPT4O_REGEX = (
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+" + _ENDING +
    "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*" + _ENDING +
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")

HARMONY = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
           "<|start|>", "<|end|>", "<|message|>", "<|call|>")

CORPUS: list[bytes] = [s.encode("utf-8", "surrogatepass") for s in (
    "", "Hello world", "I'm sure they'RE fine, DON'T we'LL it'S O'NEIL's 'd'",
    "HELLOмирABC ПРИВЕТworld worldПРИВЕТ camelCaseXMLHttpRequest iPhone McDONALD's",
    "αβγ ΑΒΓ Γειά σου Κόσμε ǅemal ǈ ʰʲ ß ẞ ﬁ", "日本語のテキスト 中文字 한국어 ภาษาไทย",
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया বাংলা తెలుగు",
    "e\u0301t cafe\u0301 \u0301\u0301a Z\u0335\u0321a\u0336l\u0337g\u0338o n\u0303o",
    "😀👍🏽👨\u200d👩\u200d👧🇩🇪 hi😀there 😀😀 a😀b ☃️ ©®™",
    "1234567890 ٣٤٥ ①②③ ½²³ ⅓ 12ab34 a1b2 x²", "9" * 3001 + "a",
    "   \t\t  a  \n  b \u00a0\u3000x\u2009y\u0085z\u2028 ", "trailing spaces   ",
    "!!!???... a!\n/b //comment http://x.y/z?q=1&r=2 ' '' ''' #$%^&*()_+=-~`|\\",
    "line1\r\nline2\r\n\r\n\n\r\r\n  \r\n\t\n  end", "\x00\x01\x1c\x1d\x1e\x1f\x7f\x0b\x0c",
    "<|start|>assistant<|channel|>final<|message|>Hi there<|end|><|return|><|call|>"
    "<|constrain|>json <|startoftext|><|endoftext|><|start",
    "def f(x):\n    return x**2  # square\n\tif x:\n\t\tprint(f'{x!r}')\n",
    "\ud800 lone \udfff surrogates", "a" * 5000 + " " * 5000 + "!" * 5000 + "é" * 3000 + "X",
    "A" * 4000 + "é" + "B" * 4000, "\n" * 3000 + " " * 100 + "\r\n" * 1000,
)] + [bytes.fromhex(h) for h in (
    "fffe41", "c328", "e282", "eda080", "f09f98", "8080c0af", "f8888080806162", "c0", "41e2")]


def _gen(rng: random.Random, n: int) -> str:
    alphabet = ("aAzZ  \t\n\r'sStTmMreRElLvVdD0123456789.,!?;:-_()[]{}<>|/\\\"#$%&*+=@^`~\x0b"
                "éüßñçøÆŒ日本語한국ابתनमस्तेกЖжΩωΓα😀👍🏽\u200d🇩🇪\u0301\u0308\u00a0\u3000\u2009\u0085"
                "\u200b\ufeffſK²⅓٣ǅʰ")
    return "".join(rng.choice(alphabet) * rng.choice((1, 1, 1, 2, 3)) for _ in range(n))


RANDOM_TEXTS = [_gen(random.Random(seed), 1 + seed % 60) for seed in range(400)]


# -- vocabularies ------------------------------------------------------------------------------

def _add_word(tokens: list[str], merges: list[str], word: bytes) -> None:
    """Merges that build `word` left to right (bpe_vocab's way), so it shows up as one token
    when a split keeps it whole."""
    merges += merge_chains(tokens, [byte_encode(word)])


def small_harmony_vocab(pre: str = "gpt-4o", specials: tuple[str, ...] = HARMONY,
                        eos: str = "<|return|>") -> dict:
    """bpe_vocab plus words that straddle the gpt-4o split's edges, plus `specials` (CONTROL)."""
    base = bpe_vocab(pre)
    n_normal = base["types"].count(1)
    tokens, merges = base["tokens"][:n_normal], list(base["merges"])
    for word in ("Hello", "HELLO", " world", "world", "мир", "ПРИВЕТ", "αβγ", "ab", " a",
                 "aa",
                 "é", "e\u0301", "\u0301t", "!!", "!!!", " !", "!\n", "!\n/", "//", "\n\n", "  ",
                 "   ", "\r\n", " \n", "123", "12", "99", "'s", "'S", "'re", "'ll", "n't", "😀",
                 "😀😀", " \u3000", "\u3000x", "日本", "\tif", "AB", "XML", "Http", "Xé"):
        _add_word(tokens, merges, word.encode())
    n_normal = len(tokens)
    tokens += list(specials)
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges,
            "types": [1] * n_normal + [3] * len(specials), "bos": n_normal,
            "eos": tokens.index(eos), "add_bos": False}


@lru_cache(maxsize=None)
def o200k_harmony_vocab() -> dict:
    """The real o200k_harmony: 199998 ranked tokens, specials up to 201087 (gpt-oss GGUFs)."""
    import vocab_models
    v = vocab_models._vocab("o200k", vocab_models.read_specials("o200k_harmony"), "all", 201088)
    v.update(pre="gpt-4o", bos=199998, eos=200002, add_bos=False)
    return v


class Oracle:
    """llama.cpp over one GGUF, vocabulary only (the tests without an oracle run without it)."""

    def __init__(self, path: Path) -> None:
        self.ll = ll = importorskip_oracle()
        self.model = ll.Llama(str(path), vocab_only=True, verbose=False)
        self.vocab = ll.llama_model_get_vocab(self.model._model.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
        n_max = 2 * len(data) + 16
        buf = (self.ll.llama_token * n_max)()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        assert n >= 0, n
        return list(buf[:n])

    def eog(self) -> list[int]:
        return [t for t in range(self.n_vocab) if self.ll.llama_vocab_is_eog(self.vocab, t)]

    def attr(self, tid: int) -> int:
        return int(self.ll.llama_vocab_get_attr(self.vocab, tid))


def _gguf(path: Path, vocab: dict) -> Path:
    return write_tiny_model(path, arch="llama", qtype="F32", vocab=vocab)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Tokenizer, Oracle]:
    path = _gguf(tmp_path_factory.mktemp("gpt4o") / "small.gguf", small_harmony_vocab())
    return load_tokenizer(GGUFFile.open(path)), Oracle(path)


@pytest.fixture(scope="module")
def o200k(tmp_path_factory) -> tuple[Tokenizer, Oracle]:
    pytest.importorskip("quicktok")
    import vocab_models
    path = tmp_path_factory.mktemp("gpt4o") / "o200k_harmony.gguf"
    write_tiny_model(path, arch="llama", qtype="Q8_0", shape=vocab_models._SHAPE,
                     vocab=o200k_harmony_vocab(),
                     extra_metadata={"tokenizer.ggml.padding_token_id": 199999})
    return load_tokenizer(GGUFFile.open(path)), Oracle(path)


# -- the split itself ----------------------------------------------------------------------------

def llama_cpp_words(texts: list[bytes]) -> list[list[bytes]]:
    importorskip_oracle()
    req = json.dumps({"regex": GPT4O_REGEX, "texts": [t.hex() for t in texts]})
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("llama_split_oracle.py"))],
                          input=req, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [[bytes.fromhex(w) for w in words] for words in json.loads(proc.stdout)]


def reference_words(data: bytes) -> list[bytes]:
    return [b"".join(map(cpt_to_utf8, w)) for w in split_words(decode_utf8_lenient(data), "gpt4o")]


def test_split_matches_llama_cpp_regex_split():
    """Word for word against llama.cpp's unicode_regex_split: the reference on every text
    (invalid UTF-8 included), the fast regex on the valid ones."""
    texts = CORPUS + [t.encode() for t in RANDOM_TEXTS]
    fast = FastSplitter("gpt4o")
    for data, expected in zip(texts, llama_cpp_words(texts)):
        assert reference_words(data) == expected, data[:80]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert [w.encode() for w in fast(text)] == expected, data[:80]


def test_split_is_llama_cpps_not_the_unicode_regex():
    """Where llama.cpp's collapsed std::regex and the HF / tiktoken regex part ways."""
    def words(text: str) -> list[str]:
        return [w.decode() for w in reference_words(text.encode())]

    assert words("e\u0301t") == ["e", "\u0301t"]            # a mark is not a letter
    assert words("HELLOмирABC") == ["HELLOмир", "ABC"]       # non-ASCII letters have no case
    assert words("αβΓδ") == ["αβΓδ"]                         # (HF: "αβ", "Γδ")
    assert words("!!\n/x  y") == ["!!\n/", "x", " ", " y"]
    assert words("ab  \r\n  c") == ["ab", "  \r\n", " ", " c"]
    assert words("12345") == ["123", "45"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=50) | st.lists(st.sampled_from(list("aZé Γ\u0301\n\r/!1'sT\t\u3000😀")),
                                          max_size=50).map("".join))
def test_fast_split_equals_reference(text):
    expected = [w.decode() for w in reference_words(text.encode())]
    assert FastSplitter("gpt4o")(text) == expected


def test_split_of_100kb_is_fast_and_linear():
    """Long runs (what makes a backtracking regex quadratic) at 100 kB, both paths."""
    rng = random.Random(1)
    prose = " ".join(_gen(rng, 12) for _ in range(8000))[:100_000]
    for text in (prose, "a" * 100_000, " " * 100_000 + "x", "!" * 100_000, "9" * 100_000,
                 "A" * 50_000 + "é" + "B" * 50_000, "é" + "A" * 100_000, "\r\n " * 33_000,
                 "日本語" * 33_000, "e\u0301" * 50_000, "😀" * 50_000):
        start = time.perf_counter()
        fast = FastSplitter("gpt4o")(text)
        t_fast = time.perf_counter() - start
        start = time.perf_counter()
        cpts = list(map(ord, text))
        lengths = split_gpt4o(cpts, [cpt_class(c) for c in cpts])
        t_ref = time.perf_counter() - start
        assert list(map(len, fast)) == lengths, text[:20]
        assert t_fast < 0.5 and t_ref < 2.0, (text[:20], t_fast, t_ref)


# -- tokens --------------------------------------------------------------------------------------

def _compare(tok: Tokenizer, oracle: Oracle, texts: list[bytes], reference: bool) -> None:
    mismatches = []
    for data in texts:
        for add, parse in ((True, True), (False, False), (True, False)):
            expected = oracle.tokenize(data, add, parse)
            got = tok.tokenize(data, add, parse)
            if got != expected:
                mismatches.append((data[:40], add, parse, got[:10], expected[:10]))
            if reference and tok.tokenize_reference(data, add, parse) != expected:
                mismatches.append(("reference", data[:40], add, parse))
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]}"


def _outcome(tokenize, data: bytes):
    """The tokens, or the one-line error (a sequence decoding above U+10FFFF: llama.cpp refuses
    it too, "invalid codepoint")."""
    try:
        return tokenize(data, False, True)
    except TokenizerError as exc:
        return f"error: {exc}"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=40) | st.text(max_size=30).map(lambda t: t.encode() + b"\xc3"))
@example(b"a\xf4\x90\x80\x80b")  # 4 bytes that decode to 0x110000: both paths refuse it alike
def test_fast_path_equals_reference_on_any_bytes(small, data):
    """Bytes that are not UTF-8 take the fast path too (their lenient decoding)."""
    tok, _ = small
    assert _outcome(tok.tokenize, data) == _outcome(tok.tokenize_reference, data)


def test_lenient_text_leaves_surrogates_to_the_reference():
    assert lenient_text(b"a\xffb\xc3") == "a\ufffdb\ufffd"
    assert lenient_text(b"\xc0\xaf") == "/"           # an overlong llama.cpp decodes
    assert lenient_text("\ud800".encode("utf-8", "surrogatepass")) is None
    assert lenient_text(b"\xf7\xbf\xbf\xbf") is None  # above U+10FFFF


def test_small_vocab_tokenizes_like_llama_cpp(small):
    tok, oracle = small
    assert tok.vocab_size == oracle.n_vocab
    _compare(tok, oracle, CORPUS + [t.encode() for t in RANDOM_TEXTS], reference=True)


@pytest.mark.slow
def test_o200k_harmony_tokenizes_like_llama_cpp(o200k):
    tok, oracle = o200k
    assert tok.vocab_size == oracle.n_vocab == 201088
    _compare(tok, oracle, CORPUS + [t.encode() for t in RANDOM_TEXTS[:150]], reference=False)
    _compare(tok, oracle, CORPUS[:20] + [t.encode() for t in RANDOM_TEXTS[150:200]], reference=True)


@pytest.mark.slow
def test_o200k_harmony_100kb_prompt_is_fast(o200k):
    tok, oracle = o200k
    rng = random.Random(2)
    prose = ("The quick brown fox can't jump; ПРИВЕТ мир 日本語 😀 12345678 !!\n/ "
             * 1600)[:100_000]
    mixed = "".join(_gen(rng, 40) for _ in range(2500))[:100_000]
    for text in (prose, mixed, "a" * 100_000, " " * 100_000, "7" * 100_000, "?!" * 50_000,
                 "日本語" * 33_000):
        for data in (text.encode(), b"\xff" + text.encode()):  # valid, then not UTF-8
            tok._fragments = type(tok._fragments)()  # cold: no cached fragment or word
            tok._bpe_fast._cache.clear()
            start = time.perf_counter()
            ids = tok.tokenize(data, add_special=False)
            elapsed = time.perf_counter() - start
            assert elapsed < 2.0, (text[:20], elapsed)
            assert tok.detokenize_bytes(ids) == data.decode("utf-8", "replace").encode()
    # the 100 kB prose in full against llama.cpp (no run in it is long enough to crash it)
    assert tok.tokenize(prose) == oracle.tokenize(prose.encode(), True, False)


# -- special tokens and the EOG set --------------------------------------------------------------

def _special_state(tok: Tokenizer, oracle: Oracle, texts: list[str]) -> None:
    assert sorted(tok.eog_ids) == oracle.eog()
    for text in texts:
        tid = tok.token_id(text)
        assert tok.token_attr(tid) == oracle.attr(tid), text


@pytest.mark.slow
def test_harmony_eog_set_matches_llama_cpp(small, o200k):
    tok, oracle = small
    ids = {t: tok.token_id(t) for t in HARMONY}
    # <|return|> and <|call|> end a turn; <|end|> only ends a message, so it is not EOG
    assert tok.eog_ids == {ids["<|endoftext|>"], ids["<|return|>"], ids["<|call|>"]}
    assert not tok.is_eog(ids["<|end|>"])
    _special_state(tok, oracle, list(HARMONY))
    # and the harmony tags llama.cpp always renders/parses (USER_DEFINED) are parsed alike
    _compare(tok, oracle, [b"<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>"
                           b"analysis<|message|>x<|call|> to=functions.f <|constrain|>json"], True)
    tok, oracle = o200k
    _special_state(tok, oracle, list(HARMONY))
    assert sorted(tok.eog_ids) == [199999, 200002, 200012]


@pytest.mark.parametrize("specials,eos", [
    (("<|endoftext|>", "<|end|>", "<|call|>"), "<|endoftext|>"),  # no <|return|>: <|end|> stays
    (("<|endoftext|>", "<|end|>", "<|return|>"), "<|return|>"),
    # <|calls|> counts as <|call|> in both of llama.cpp's checks
    (("<|endoftext|>", "<|end|>", "<|return|>", "<|calls|>"), "<|endoftext|>"),
    (("<|endoftext|>", "<|end|>", "<|call|>", "<|flush|>"), "<|endoftext|>"),
    (("<|endoftext|>", "<|end|>", "<|calls|>", "<|flush|>"), "<|end|>"),  # an EOS <|end|> too
    (("<|endoftext|>", "<|return|>", "<|call|>"), "<|return|>"),
])
def test_end_token_rule_matches_llama_cpp(tmp_path, specials, eos):
    path = _gguf(tmp_path / "v.gguf", small_harmony_vocab(specials=specials, eos=eos))
    tok, oracle = load_tokenizer(GGUFFile.open(path)), Oracle(path)
    _special_state(tok, oracle, list(specials))
    _compare(tok, oracle, [("".join(specials) + " x<|end|>y").encode()], reference=True)


@pytest.mark.parametrize("pre", ["llama4", "kanana2", "talkie", "minimax-m2"])
def test_gpt4o_aliases(tmp_path, pre):
    path = _gguf(tmp_path / "v.gguf", small_harmony_vocab(pre=pre))
    tok, oracle = load_tokenizer(GGUFFile.open(path)), Oracle(path)
    assert tok.clean_spaces is False
    _compare(tok, oracle, CORPUS[:12], reference=False)
    assert tok.detokenize(tok.tokenize("a , b .", add_special=False)) == "a , b ."
    assert TokenAttr.CONTROL & tok.token_attr(tok.token_id("<|return|>"))
