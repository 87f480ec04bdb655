"""Byte-level BPE (`tokenizer.ggml.model = gpt2`) as llama.cpp runs it.

Two paths that must agree token for token:

- the reference: a line-by-line port of llama.cpp's pre-tokenizer splitters
  (`unicode_regex_split_custom_llama3/qwen2/gpt2` and the `default` regex chain in
  `src/unicode.cpp`; the gpt-4o regex, which llama.cpp runs through std::regex, worked out
  in `gpt4o.py`) and of its bigram merge loop (`llm_tokenizer_bpe_session`), in plain
  Python; it also takes input that is not valid UTF-8 the way llama.cpp does (each bad byte
  becomes U+FFFD, surrogates pass through);
- the fast path (llama3, qwen2, gpt2, gpt4o splitters; any input whose lenient decoding has
  no surrogate, Python's str cannot carry those to UTF-8): the same split as one
  Python `re` regex over llama.cpp's own Unicode tables (an ASCII-only regex for ASCII
  text; for gpt4o llama.cpp's own regex over its "collapsed" text), then each distinct word
  merged once by HF `tokenizers` (Rust) and remembered.

`tests/test_tokenizer.py` compares the two on random text; the goldens compare both with
llama.cpp.
"""

from __future__ import annotations

import heapq
import re
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

from edgeinfer.tokenizer import unicode as U
from edgeinfer.tokenizer.gpt4o import CollapsedSplitter, split_gpt4o
from edgeinfer.errors import TokenizerError

# -- pre-tokenizer names (llama.cpp `llama_vocab::impl::load`) --------------------------

@dataclass(frozen=True)
class PreTokenizer:
    split: str            # which splitter: llama3 | qwen2 | qwen35 | gpt2 | gpt4o | default
    ignore_merges: bool   # a word that is itself a token skips the merges (Llama 3)
    clean_spaces: bool    # detokenize removes " ." style spaces (clean_up_tokenization_spaces)
    add_bos: bool | None  # llama.cpp's default when the file has no add_bos_token key


_LLAMA3 = PreTokenizer("llama3", True, True, True)
_QWEN2 = PreTokenizer("qwen2", False, False, None)
_QWEN35 = PreTokenizer("qwen35", False, False, None)  # qwen2's, letter runs take combining marks
_GPT2 = PreTokenizer("gpt2", False, True, None)
_DEFAULT = PreTokenizer("default", False, True, None)
_GPT4O = PreTokenizer("gpt4o", False, False, None)
_GEMMA4 = PreTokenizer("gemma4", False, True, True)  # SentencePiece-style BPE: edgeinfer.tokenizer.spm_bpe

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **{n: _LLAMA3 for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                            "pixtral", "midm-2.0", "lfm2", "jina-v5-nano")},
    **{n: _QWEN2 for n in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2")},
    "qwen35": _QWEN35,
    **{n: _GPT2 for n in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                          "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo")},
    **{n: _GPT4O for n in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")},
    **{n: _GEMMA4 for n in ("gemma4", "granite-embed-multi-311m")},
    "default": _DEFAULT,
    "": _DEFAULT,
}


def pre_tokenizer_for(name: str) -> PreTokenizer:
    try:
        return PRE_TOKENIZERS[name]
    except KeyError:
        known = ", ".join(sorted(n for n in PRE_TOKENIZERS if n))
        raise TokenizerError(f"unsupported pre-tokenizer tokenizer.ggml.pre={name!r} "
                             f"(edgeinfer knows: {known})") from None


# -- llama.cpp's character classes ---------------------------------------------------------

_WS = frozenset(U.WHITESPACE)


def _table(ranges) -> tuple[list[int], list[int]]:
    return [a for a, _ in ranges], [b for _, b in ranges]


_L, _N, _P, _M = _table(U.LETTER), _table(U.NUMBER), _table(U.PUNCTUATION), _table(U.MARK)


def _in(table, cpt: int) -> bool:
    starts, ends = table
    i = bisect_right(starts, cpt) - 1
    return i >= 0 and cpt <= ends[i]


@lru_cache(maxsize=65536)
def cpt_class(cpt: int) -> int:
    """1 = letter, 2 = number, 4 = whitespace (llama.cpp's unicode_cpt_flags)."""
    return (1 if _in(_L, cpt) else 0) | (2 if _in(_N, cpt) else 0) | (4 if cpt in _WS else 0)


def decode_utf8_lenient(data: bytes) -> list[int]:
    """llama.cpp's `unicode_cpts_from_utf8`: no checks for surrogates/overlongs, bad byte -> U+FFFD."""
    out: list[int] = []
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        if b < 0x80:
            out.append(b)
            i += 1
            continue
        need = -1 if not b & 0x40 else 1 if not b & 0x20 else 2 if not b & 0x10 else 3 if not b & 0x08 else -1
        if need < 0 or i + need >= n or any((data[i + k] & 0xC0) != 0x80 for k in range(1, need + 1)):
            out.append(0xFFFD)
            i += 1
            continue
        cpt = b & (0x1F, 0x0F, 0x07)[need - 1]
        for k in range(1, need + 1):
            cpt = (cpt << 6) | (data[i + k] & 0x3F)
        out.append(cpt)
        i += need + 1
    return out


def lenient_text(data: bytes) -> str | None:
    """The text llama.cpp makes of bytes that are not valid UTF-8 (`decode_utf8_lenient`), or
    None where a code point has no UTF-8 in Python (a surrogate, or above U+10FFFF)."""
    cpts = decode_utf8_lenient(data)
    if any(0xD800 <= c <= 0xDFFF or c > 0x10FFFF for c in cpts):
        return None
    return "".join(map(chr, cpts))


def cpt_to_utf8(cpt: int) -> bytes:
    """llama.cpp's `unicode_cpt_to_utf8` (encodes surrogates too)."""
    if cpt <= 0x7F:
        return bytes((cpt,))
    if cpt <= 0x7FF:
        return bytes((0xC0 | (cpt >> 6), 0x80 | (cpt & 0x3F)))
    if cpt <= 0xFFFF:
        return bytes((0xE0 | (cpt >> 12), 0x80 | ((cpt >> 6) & 0x3F), 0x80 | (cpt & 0x3F)))
    if cpt <= 0x10FFFF:
        return bytes((0xF0 | (cpt >> 18), 0x80 | ((cpt >> 12) & 0x3F),
                      0x80 | ((cpt >> 6) & 0x3F), 0x80 | (cpt & 0x3F)))
    raise TokenizerError(f"invalid code point 0x{cpt:X} in input text")


# -- reference splitters (ports of src/unicode.cpp) ----------------------------------------

_CONTRACTION_1 = frozenset(map(ord, "sStTmMdD"))
_CONTRACTION_2 = {(ord(a), ord(b)) for a, b in ("re", "ve", "ll")}
_CR, _LF, _SP, _APOS = 13, 10, 32, 39


def _lower_ascii(c: int) -> int:
    return c + 32 if 65 <= c <= 90 else c


def split_llama3(cpts: list[int], max_digits: int | None = 3, marks_are_letters: bool = False) -> list[int]:
    """Word lengths (in code points) of llama.cpp's llama3 splitter; max_digits=1 is qwen2,
    and with marks_are_letters qwen35 (unicode_regex_split_custom_qwen35: [\\p{L}\\p{M}]+ letter
    runs, and [^\\s\\p{L}\\p{M}\\p{N}] punctuation: a combining mark counts as a letter in
    every branch)."""
    n = len(cpts)
    flags = [cpt_class(c) | (1 if marks_are_letters and _in(_M, c) else 0) for c in cpts] + [0]
    cp = cpts + [-1]
    out: list[int] = []
    prev = 0
    pos = 0

    def add(end: int) -> int:
        nonlocal prev
        length = end - prev
        if length > 0:
            out.append(length)
        prev = end
        return length

    while pos < n:
        c, f = cp[pos], flags[pos]
        if c == _APOS and pos + 1 < n:
            c1 = _lower_ascii(cp[pos + 1])
            if c1 in (115, 116, 109, 100):  # s t m d
                pos += add(pos + 2)
                continue
            if pos + 2 < n and (c1, _lower_ascii(cp[pos + 2])) in _CONTRACTION_2:
                pos += add(pos + 3)
                continue
        if not (c == _CR or c == _LF or f & 2):
            if f & 1 or flags[pos + 1] & 1:
                pos += 1
                while flags[pos] & 1:
                    pos += 1
                add(pos)
                continue
        if f & 2:
            if max_digits == 1:
                pos += 1
            else:
                ini = pos
                while flags[pos] & 2:
                    pos += 1
                    if pos - ini >= 3:
                        add(pos)
                        ini = pos
            add(pos)
            continue
        f2 = flags[pos + 1] if c == _SP else f
        in_range2 = pos + 1 < n if c == _SP else True
        if not (f2 & 7) and in_range2:
            pos += c == _SP
            while pos < n and not (flags[pos] & 7):
                pos += 1
            while pos < n and cp[pos] in (_CR, _LF):
                pos += 1
            add(pos)
            continue
        nws = 0
        last_rn = 0
        while pos + nws < n and flags[pos + nws] & 4:
            if cp[pos + nws] in (_CR, _LF):
                last_rn = pos + nws + 1
            nws += 1
        if last_rn > 0:
            pos = last_rn
            add(pos)
            continue
        if nws > 1 and pos + nws < n:
            pos += nws - 1
            add(pos)
            continue
        if nws > 0:
            pos += nws
            add(pos)
            continue
        pos += 1
        add(pos)
    return out


def split_gpt2(cpts: list[int]) -> list[int]:
    """Word lengths of llama.cpp's gpt2 splitter ('s|'t|...| ?\\p{L}+| ?\\p{N}+|...)."""
    n = len(cpts)
    flags = [cpt_class(c) for c in cpts] + [0]
    cp = cpts + [-1]
    out: list[int] = []
    prev = 0
    pos = 0

    def add(end: int) -> int:
        nonlocal prev
        length = end - prev
        if length > 0:
            out.append(length)
        prev = end
        return length

    while pos < n:
        c, f = cp[pos], flags[pos]
        if c == _APOS and pos + 1 < n:
            c1 = cp[pos + 1]
            if c1 in (115, 116, 109, 100):
                pos += add(pos + 2)
                continue
            if pos + 2 < n and (c1, cp[pos + 2]) in _CONTRACTION_2:
                pos += add(pos + 3)
                continue
        in_range2 = pos + 1 < n if c == _SP else True
        f2 = flags[pos + 1] if c == _SP else f
        if f2 & 1 and in_range2:
            pos += c == _SP
            while pos < n and flags[pos] & 1:
                pos += 1
            add(pos)
            continue
        if f2 & 2 and in_range2:
            pos += c == _SP
            while pos < n and flags[pos] & 2:
                pos += 1
            add(pos)
            continue
        if not (f2 & 7) and in_range2:
            pos += c == _SP
            while pos < n and not (flags[pos] & 7):
                pos += 1
            add(pos)
            continue
        nws = 0
        while pos + nws < n and flags[pos + nws] & 4:
            nws += 1
        if nws > 1 and pos + nws < n:
            pos += nws - 1
            add(pos)
            continue
        if nws > 0:
            pos += nws
            add(pos)
            continue
        pos += 1
        add(pos)
    return out


def _class_body(*tables, extra: str = "") -> str:
    """Python-`re` character-class body for the union of range tables."""
    parts = [extra]
    for ranges in tables:
        for a, b in ranges:
            parts.append(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}")
    return "".join(parts)


def _default_regexes() -> list[re.Pattern]:
    """llama.cpp's default BPE pre-tokenizer: std::regex over its 'collapsed' text."""
    ascii_punct = "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}"
    p_non_ascii = [(max(a, 128), b) for a, b in U.PUNCTUATION if b >= 128]
    p_non_ascii = [(a, b) for a, b in p_non_ascii if not any(a <= w <= b for w in U.WHITESPACE)]
    n_non_ascii = [(max(a, 128), b) for a, b in U.NUMBER if b >= 128]
    punct = re.compile("[" + ascii_punct + "\\$\\+<=>\\^~\\|" + _class_body(p_non_ascii) + "]+")
    numbers = re.compile("[0-9" + _class_body(n_non_ascii) + "]+")
    digits3 = re.compile("[0-9][0-9][0-9]")
    return [punct, numbers, digits3]


_DEFAULT_RES: list[re.Pattern] | None = None


def _regex_split(text: str, pattern: re.Pattern, lengths: list[int]) -> list[int]:
    """llama.cpp's unicode_regex_split_stl: matches and the gaps between them become words."""
    out: list[int] = []
    start = 0
    for length in lengths:
        seg = text[start:start + length]
        idx = 0
        for m in pattern.finditer(seg):
            if m.start() > idx:
                out.append(m.start() - idx)
            out.append(m.end() - m.start())
            idx = m.end()
        if idx < length:
            out.append(length - idx)
        start += length
    return out


def split_words(cpts: list[int], split: str) -> list[list[int]]:
    """Pre-tokenize code points into words with the named llama.cpp splitter."""
    global _DEFAULT_RES
    if split == "llama3":
        lengths = split_llama3(cpts, 3)
    elif split == "qwen2":
        lengths = split_llama3(cpts, 1)
    elif split == "qwen35":
        lengths = split_llama3(cpts, 1, marks_are_letters=True)
    elif split == "gpt2":
        lengths = split_gpt2(cpts)
    elif split == "gpt4o":
        lengths = split_gpt4o(cpts, [cpt_class(c) for c in cpts])
    else:  # default: four regexes in sequence, each splitting the previous pieces
        if _DEFAULT_RES is None:
            _DEFAULT_RES = _default_regexes()
        # std::regex sees each code point as one unit; non-BMP/surrogates are fine in a str.
        text = "".join(chr(c) if c <= 0x10FFFF else "\uFFFD" for c in cpts)
        ws_text = "".join("\x0b" if (ord(ch) > 0x7F and cpt_class(ord(ch)) & 4) else ch for ch in text)
        lengths = _regex_split(ws_text, _DEFAULT_RES[0], [len(cpts)] if cpts else [])
        gpt2_lengths: list[int] = []
        start = 0
        for length in lengths:
            gpt2_lengths += split_gpt2(cpts[start:start + length])
            start += length
        lengths = _regex_split(ws_text, _DEFAULT_RES[1], gpt2_lengths)
        lengths = _regex_split(ws_text, _DEFAULT_RES[2], lengths)
    words, start = [], 0
    for length in lengths:
        words.append(cpts[start:start + length])
        start += length
    return words


# -- byte-level mapping (GPT-2) -------------------------------------------------------------

def _bytes_to_unicode() -> list[str]:
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = [""] * 256
    for b, c in zip(bs, cs):
        table[b] = chr(c)
    return table


BYTE_TO_CHAR: list[str] = _bytes_to_unicode()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def byte_encode(data: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in data)


def _split_merge(m: str) -> tuple[str, str]:
    pos = m.find(" ", 1)
    return (m[:pos], m[pos + 1:]) if pos >= 0 else ("", "")


# -- reference merge loop (llm_tokenizer_bpe_session::tokenize) ----------------------------

class BPEReference:
    """Plain-Python llama.cpp BPE over one vocabulary; `encode(bytes)` -> ids."""

    def __init__(self, id_of: dict[bytes, int], merges: list[str], pre: PreTokenizer) -> None:
        self.id_of = id_of
        self.pre = pre
        self._merges = merges
        self._ranks: dict[tuple[str, str], int] | None = None  # built on first use
        self._cache: dict[str, list[int]] = {}

    @property
    def ranks(self) -> dict[tuple[str, str], int]:
        if self._ranks is None:
            ranks: dict[tuple[str, str], int] = {}
            for i, m in enumerate(self._merges):
                ranks.setdefault(_split_merge(m), i)  # std::map::emplace keeps the first
            self._ranks = ranks
        return self._ranks

    def encode(self, data: bytes) -> list[int]:
        out: list[int] = []
        for word in split_words(decode_utf8_lenient(data), self.pre.split):
            out += self.encode_word(byte_encode(b"".join(cpt_to_utf8(c) for c in word)))
        return out

    def encode_word(self, word: str) -> list[int]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        ids = [self._token_or_bytes(s, out=[]) for s in self.merge(word)]
        flat = [i for part in ids for i in part]
        if len(self._cache) < 200_000:
            self._cache[word] = flat
        return flat

    def _token_or_bytes(self, sym: str, out: list[int]) -> list[int]:
        raw = sym.encode("utf-8", "surrogatepass")
        tid = self.id_of.get(raw)
        if tid is not None:
            out.append(tid)
            return out
        for b in raw:  # llama.cpp looks each byte of the symbol's UTF-8 up as a string
            tid = self.id_of.get(self.byte_token(b))
            if tid is not None:
                out.append(tid)
        return out

    @staticmethod
    def byte_token(b: int) -> bytes:
        """The vocabulary text of byte b's fallback token (GPT-2's byte-level character)."""
        return bytes((b,))

    def merge(self, word: str) -> list[str]:
        if self.pre.ignore_merges and word.encode("utf-8", "surrogatepass") in self.id_of:
            return [word]
        syms = list(word)
        n = len(syms)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        if n:
            nxt[-1] = -1
        heap: list[tuple[int, int, int, str]] = []
        ranks = self.ranks

        def add(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            rank = ranks.get((syms[left], syms[right]))
            if rank is not None:
                heapq.heappush(heap, (rank, left, right, syms[left] + syms[right]))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, right, text = heapq.heappop(heap)
            if not syms[left] or not syms[right] or syms[left] + syms[right] != text:
                continue
            syms[left] = text
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])
        return [s for s in syms if s]


# -- fast path: Python `re` split + HF tokenizers merges ----------------------------------

def _re_class(tables, extra: str = "", negate: bool = False) -> str:
    return "[" + ("^" if negate else "") + extra + _class_body(*tables) + "]"


def split_regex(split: str, ascii_only: bool = False) -> str:
    """The split as one regex over llama.cpp's tables (Python `re` syntax).

    With `ascii_only` the classes are cut down to ASCII: the same matches on ASCII text,
    about ten times faster than the full Unicode classes.
    """
    ws_all = [(c, c) for c in U.WHITESPACE]
    if ascii_only:
        clip = lambda rs: [(a, min(b, 127)) for a, b in rs if a < 128]  # noqa: E731
        letter, number, ws = clip(U.LETTER), clip(U.NUMBER), clip(ws_all)
    else:
        letter, number, ws = U.LETTER, U.NUMBER, ws_all
    if split == "qwen35":  # qwen2's regex with [\p{L}\p{M}] for \p{L} (no ASCII marks)
        letter = list(letter) + ([] if ascii_only else list(U.MARK))
        split = "qwen2"
    L, N, S = _re_class([letter]), _re_class([number]), _re_class([ws])
    not_S = _re_class([ws], negate=True)
    not_rn_L_N = _re_class([letter, number], extra="\\r\\n", negate=True)
    not_S_L_N = _re_class([ws, letter, number], negate=True)
    if split in ("llama3", "qwen2"):
        digits = "{1,3}" if split == "llama3" else ""
        return ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                f"|{not_rn_L_N}?{L}+|{N}{digits}| ?{not_S_L_N}+[\\r\\n]*"
                f"|{S}*[\\r\\n]+|{S}+(?!{not_S})|{S}+")
    if split == "gpt2":
        return f"'s|'t|'re|'ve|'m|'ll|'d| ?{L}+| ?{N}+| ?{not_S_L_N}+|{S}+(?!{not_S})|{S}+"
    raise ValueError(split)


class FastSplitter:
    """`str -> list[str]` words, the same as the reference splitter on valid text."""

    def __init__(self, split: str) -> None:
        self.split = split
        if split == "gpt4o":  # llama.cpp's own way: a regex over "collapsed" text
            self._collapsed: CollapsedSplitter | None = CollapsedSplitter(cpt_class)
            return
        self._collapsed = None
        self._full = re.compile(split_regex(split))
        self._ascii = re.compile(split_regex(split, ascii_only=True))
        # llama3/qwen2 only: no match crosses a newline followed by a non-space, so text
        # cut there splits the same; then each ASCII-only piece takes the fast regex.
        not_ws = _re_class([[(c, c) for c in U.WHITESPACE]], negate=True)
        self._lines = re.compile(f"(?<=\\n)(?={not_ws})") if split in ("llama3", "qwen2", "qwen35") else None

    def __call__(self, text: str) -> list[str]:
        if self._collapsed is not None:
            return self._collapsed(text)
        if text.isascii():
            return self._ascii.findall(text)
        if self._lines is None:
            return self._full.findall(text)
        words: list[str] = []
        for part in self._lines.split(text):
            words += (self._ascii if part.isascii() else self._full).findall(part)
        return words


def hf_vocab_and_merges(tokens: list[str], merges: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """HF `tokenizers`' BPE vocabulary and merge pairs as llama.cpp reads the GGUF: of two equal
    texts the last id wins (token_to_id); "a b" splits at the first space after index 0 and a
    repeated pair keeps its first rank (dict.fromkeys does both orders the same way)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab[t] = i
    return vocab, list(dict.fromkeys(_split_merge(m) for m in merges))


class BPEFast:
    """Split with `FastSplitter`, merge each distinct word once with HF `tokenizers` (Rust)
    and remember it; takes text (the caller decodes, see `lenient_text`)."""

    MAX_CACHE = 500_000

    def __init__(self, tokens: list[str], merges: list[str], pre: PreTokenizer) -> None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        if pre.split not in ("llama3", "qwen2", "qwen35", "gpt2", "gpt4o"):
            raise ValueError(f"no fast path for the {pre.split} splitter")
        vocab, pairs = hf_vocab_and_merges(tokens, merges)
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges,
                           fuse_unk=False, byte_fallback=False)
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._tok = tok
        self.split = FastSplitter(pre.split)
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        words = self.split(text)
        cache = self._cache
        missing = [w for w in dict.fromkeys(words) if w not in cache]
        if missing:
            if len(cache) + len(missing) > self.MAX_CACHE:
                cache.clear()
            for word, enc in zip(missing, self._tok.encode_batch(missing, add_special_tokens=False)):
                cache[word] = self._word_ids(word, enc.ids)
        out: list[int] = []
        for w in words:
            out += cache[w]
        return out

    def _word_ids(self, word: str, merged: list[int]) -> list[int]:
        """A word's ids from HF's merges (a subclass may take some words whole)."""
        return merged
