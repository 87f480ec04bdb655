"""WordPiece (`tokenizer.ggml.model = "bert"`) as llama.cpp's llm_tokenizer_wpm does it.

Each code point becomes the first code point of its NFD decomposition (so accents go),
lowercased; text splits on whitespace, and punctuation, ASCII symbols and CJK ideographs
become words of their own; control and format characters, combining marks and U+FFFD
are dropped. Each word, with a phantom U+2581 in front (the
converter writes word-initial pieces as "▁piece" and "##piece" as "piece"), is cut into
the longest vocabulary pieces from the left, byte by byte; a word with any piece missing
becomes one [UNK].
"""

from __future__ import annotations

import bisect
import unicodedata

from edgeinfer.tokenizer.unicode import PUNCTUATION, WHITESPACE

_PHANTOM = "\u2581".encode()
_WHITESPACE = frozenset(WHITESPACE)
_PUNCT_STARTS = [a for a, _ in PUNCTUATION]
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_punctuation(cp: int) -> bool:
    k = bisect.bisect_right(_PUNCT_STARTS, cp) - 1
    return k >= 0 and PUNCTUATION[k][0] <= cp <= PUNCTUATION[k][1]


def _lower(ch: str) -> str:
    low = ch.lower()
    return low[0] if low else ch  # one code point for one, as llama.cpp's table


def split_words(text: str) -> list[str]:
    """llama.cpp's llm_tokenizer_wpm_session::preprocess."""
    words = [""]
    for ch in text:
        ch = unicodedata.normalize("NFD", ch)[0]  # llama.cpp keeps the first code point only
        cp = ord(ch)
        if cp in _WHITESPACE:
            if words[-1]:
                words.append("")
            continue
        cat = unicodedata.category(ch)
        if cp == 0xFFFD or cat[0] == "M" or cat in ("Cc", "Cf", "Co", "Cs"):  # controls, marks; not unassigned
            continue
        low = _lower(ch)
        if _is_punctuation(cp) or (cp < 0x7F and cat[0] == "S") or any(a <= cp <= b for a, b in _CJK):
            if words[-1]:
                words.append("")
            words[-1] = low
            words.append("")
        else:
            words[-1] += low
    return [w for w in words if w]


class WordPiece:
    """Greedy longest-match WordPiece over a vocabulary of byte strings."""

    def __init__(self, id_of: dict[bytes, int], unk_id: int | None) -> None:
        self._id_of = id_of
        self._unk = unk_id
        self._max_len = max((len(t) for t in id_of), default=1)

    def encode(self, text: bytes, out: list[int]) -> None:
        for word in split_words(text.decode("utf-8", "replace")):
            data = _PHANTOM + word.encode("utf-8", "surrogatepass")
            n, start, i = len(data), len(out), 0
            while i < n:
                for j in range(min(n, i + self._max_len + 1), i, -1):
                    tid = self._id_of.get(data[i:j])
                    if tid is not None:
                        out.append(tid)
                        i = j
                        break
                else:  # a piece is missing: the whole word is unknown
                    del out[start:]
                    break
            if len(out) == start and self._unk is not None:
                out.append(self._unk)
