"""SentencePiece-style BPE (Gemma 4's `tokenizer.ggml.model = "gemma4"`), as llama.cpp runs it.

Unlike GPT-2's byte-level BPE, the vocabulary holds raw UTF-8 text with spaces written as
U+2581, and bytes with no token of their own fall back to `<0xXX>` byte tokens. llama.cpp
(`llama-vocab.cpp`, LLAMA_VOCAB_PRE_TYPE_GEMMA4):
- escapes every space of a text fragment to U+2581 first;
- splits only at newlines (`[^\\n]+|[\\n]+`): the merges run over whole lines;
- a run of newlines that is itself a token is taken whole (the merges would not reach it);
- merges by rank over UTF-8 characters; a symbol left outside the vocabulary becomes the
  `<0xXX>` tokens of its bytes (bytes without one are dropped, as llama.cpp drops them).
Detokenizing turns U+2581 back into spaces and `<0xXX>` into its byte (Tokenizer._piece).
"""

from __future__ import annotations

import re

from edgeinfer.tokenizer.bpe import BPEFast, BPEReference, PreTokenizer, hf_vocab_and_merges, lenient_text

ESCAPED_SPACE = "\u2581"
_LINES = re.compile(r"[^\n]+|\n+")


def lines(data: bytes | str) -> list[str]:
    """The fragment's words: spaces escaped, split into newline runs and the text between.
    Bytes are read as llama.cpp reads them (a bad byte is U+FFFD)."""
    text = data if isinstance(data, str) else lenient_text(data)
    if text is None:  # a code point Python cannot hold (a surrogate): U+FFFD for its bytes
        text = data.decode("utf-8", "replace")
    return _LINES.findall(text.replace(" ", ESCAPED_SPACE))


class SpmBPEReference(BPEReference):
    """Plain-Python SentencePiece-style BPE; `encode(bytes)` -> ids (the checking path)."""

    def encode(self, data: bytes) -> list[int]:
        out: list[int] = []
        for word in lines(data):
            whole = self.id_of.get(word.encode()) if word[0] == "\n" else None
            out += [whole] if whole is not None else self.encode_word(word)
        return out

    @staticmethod
    def byte_token(b: int) -> bytes:
        return b"<0x%02X>" % b  # SentencePiece's byte fallback


class SpmBPEFast(BPEFast):
    """The same with HF `tokenizers` doing the merges (byte fallback on), each distinct line
    merged once and remembered (BPEFast.encode, split into lines); takes bytes or text."""

    MAX_CACHE = 200_000

    def __init__(self, tokens: list[str], merges: list[str], pre: PreTokenizer) -> None:
        from tokenizers import Tokenizer, models

        vocab, pairs = hf_vocab_and_merges(tokens, merges)
        self._tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False, fuse_unk=False,
                                         byte_fallback=True))
        self._vocab = vocab
        self._cache: dict[str, list[int]] = {}
        self.split = lines

    def _word_ids(self, word: str, merged: list[int]) -> list[int]:
        whole = self._vocab.get(word) if word[0] == "\n" else None  # a newline run that is a token
        return [whole] if whole is not None else merged
