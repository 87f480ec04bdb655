"""The gpt-4o / o200k pre-tokenizer split (`tokenizer.ggml.pre` gpt-4o, llama4, kanana2,
talkie, minimax-m2: gpt-oss, Llama 4) as llama.cpp runs it.

llama.cpp has no hand-written splitter for this regex (`unicode_regex_split_custom` does not
know it): it runs

    [^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|...)?
    |[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|...)?
    |\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+

through std::regex (ECMAScript: backtracking, first alternative that matches wins) over the
"collapsed" text: ASCII stays itself, every other code point becomes one byte for its class
(whitespace -> \\v, letter -> 0xD2, number -> 0xD1, anything else -> a byte no class has).
What that means, unlike the HF/tiktoken regex:

- a non-ASCII letter is both "not a-z" and "not A-Z": Greek, Cyrillic, CJK, ... letters of
  either case are upper and lower at once; only ASCII has case;
- combining marks (\\p{M}) are not letters: "e\\u0301t" splits as "e", "\\u0301t";
- \\s is ASCII whitespace plus llama.cpp's Unicode whitespace table.

`split_gpt4o` below is that regex worked out by hand (what the backtracking settles on at
each position), in plain Python over code points; `CollapsedSplitter` does what llama.cpp
does, collapse then regex, with Python's `re` (also backtracking, same alternative order).
Neither recurses, so neither has llama.cpp's limit: std::regex recurses once per character
of a match and overflows an 8 MB stack on runs of about 25k letters, spaces or symbols.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_CR, _LF, _SP, _APOS, _SLASH = 13, 10, 32, 39, 47
_S, _T, _M, _D = (ord(c) for c in "stmd")
_TWO = {(ord(a), ord(b)) for a, b in ("re", "ve", "ll")}

# flags as bpe.cpt_class gives them
_LETTER, _NUMBER, _SPACE = 1, 2, 4


def _is_lower(c: int) -> bool:  # [a-z]: the only code points `[^a-z]` rejects
    return 97 <= c <= 122


def _is_upper(c: int) -> bool:
    return 65 <= c <= 90


def _lower(c: int) -> int:
    return c + 32 if _is_upper(c) else c


def _contraction(cp: list[int], n: int, e: int) -> int:
    """End of (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])? at e."""
    if e + 1 < n and cp[e] == _APOS:
        c1 = _lower(cp[e + 1])
        if c1 in (_S, _T, _M, _D):
            return e + 2
        if e + 2 < n and (c1, _lower(cp[e + 2])) in _TWO:
            return e + 3
    return e


def _match_end(cp: list[int], fl: list[int], n: int, i: int) -> int:
    """End of the regex's match at i (one always exists: every code point is in some branch)."""
    c, f = cp[i], fl[i]
    # branches 1-2: [^\r\n\p{L}\p{N}]? then letters. A non-letter taken by the optional
    # class cannot start the letters either, so no backtracking into it can help.
    j = i + 1 if not f & (_LETTER | _NUMBER) and c != _CR and c != _LF else i
    if j < n and fl[j] & _LETTER:
        k = j  # ((?=\p{L})[^a-z])* greedy: letters other than a-z
        while k < n and fl[k] & _LETTER and not _is_lower(cp[k]):
            k += 1
        if k < n and _is_lower(cp[k]):  # ((?=\p{L})[^A-Z])+ takes over at the a-z
            e = k
            while e < n and fl[e] & _LETTER and not _is_upper(cp[e]):
                e += 1
            return _contraction(cp, n, e)
        # the run ends in a non-letter: the star gives back letters until the plus can take
        # one, i.e. up to the last non-ASCII letter (which is "not A-Z" too)
        d = k - 1
        while d >= j and cp[d] < 128:
            d -= 1
        if d >= j:
            return _contraction(cp, n, d + 1)
        # only A-Z: branch 2, ((?=\p{L})[^a-z])+ then an empty [^A-Z]* (a non-letter follows)
        return _contraction(cp, n, k)
    if f & _NUMBER:  # \p{N}{1,3}
        e = i + 1
        while e < n and e - i < 3 and fl[e] & _NUMBER:
            e += 1
        return e
    # ' ?[^\s\p{L}\p{N}]+[\r\n/]*'
    j = i + 1 if c == _SP else i
    if j < n and not fl[j] & (_LETTER | _NUMBER | _SPACE):
        e = j + 1
        while e < n and not fl[e] & (_LETTER | _NUMBER | _SPACE):
            e += 1
        while e < n and cp[e] in (_CR, _LF, _SLASH):
            e += 1
        return e
    # c is whitespace here. \s*[\r\n]+: up to the run's last CR/LF
    m = i
    last_rn = -1
    while m < n and fl[m] & _SPACE:
        if cp[m] == _CR or cp[m] == _LF:
            last_rn = m
        m += 1
    if last_rn >= 0:
        return last_rn + 1
    if m == n:  # \s+(?!\S) at the end of the text: the whole run
        return n
    return max(m - 1, i + 1)  # \s+(?!\S) leaves the last space to the next word; else \s+


def split_gpt4o(cpts: list[int], flags: list[int]) -> list[int]:
    """Word lengths (in code points); flags[i] is cpt_class(cpts[i]) (letter 1, number 2,
    whitespace 4: ASCII whitespace is exactly what std::regex's \\s takes)."""
    n = len(cpts)
    out: list[int] = []
    pos = 0
    while pos < n:
        end = _match_end(cpts, flags, n, pos)
        out.append(end - pos)
        pos = end
    return out


# -- collapse, then regex (the fast path) -------------------------------------------------------

_L, _N, _WS, _OTHER = "\xd2", "\xd1", "\x0b", "\xd0"  # llama.cpp's collapsed class bytes
_ENDING = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
# llama.cpp's collapsed regex, \p{L} = [\xd2A-Za-z] and \p{N} = [\xd10-9], with each
# (?=[\p{L}])[^a-z] written as the class it equals, [A-Z\xd2] (Python's re runs a plain
# class repeat much faster than a repeated group). re.ASCII: \s is [ \t\n\v\f\r], as
# std::regex's in the C locale.
COLLAPSED_REGEX = re.compile(
    f"[^\\r\\n{_L}A-Za-z{_N}0-9]?[A-Z{_L}]*[a-z{_L}]+{_ENDING}"
    f"|[^\\r\\n{_L}A-Za-z{_N}0-9]?[A-Z{_L}]+[a-z{_L}]*{_ENDING}"
    f"|[{_N}0-9]{{1,3}}| ?[^\\s{_L}A-Za-z{_N}0-9]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    re.ASCII)


class _Collapse(dict):
    """str.translate table: code point -> its collapsed character, filled on first sight."""

    MAX = 1 << 16  # distinct code points kept (hostile text could name every one)

    def __init__(self, classify: Callable[[int], int]) -> None:
        super().__init__((c, chr(c)) for c in range(128))
        self._classify = classify

    def __missing__(self, cpt: int) -> str:
        f = self._classify(cpt)
        ch = _WS if f & _SPACE else _L if f & _LETTER else _N if f & _NUMBER else _OTHER
        if len(self) < self.MAX:
            self[cpt] = ch
        return ch


class CollapsedSplitter:
    """`str -> list[str]` words as llama.cpp splits them: one character per code point in
    the collapsed text, so its match lengths cut the original text."""

    def __init__(self, classify: Callable[[int], int]) -> None:
        self._collapse = _Collapse(classify)  # classify: bpe.cpt_class

    def __call__(self, text: str) -> list[str]:
        if text.isascii():
            return COLLAPSED_REGEX.findall(text)
        words: list[str] = []
        pos = 0
        for w in COLLAPSED_REGEX.findall(text.translate(self._collapse)):
            end = pos + len(w)
            words.append(text[pos:end])
            pos = end
        return words
