"""Turning token bytes back into text: llama.cpp's space clean-up and a streaming decoder."""

from __future__ import annotations

import codecs
import re
from typing import Protocol


class PieceSource(Protocol):
    """What the streaming decoder needs of a tokenizer (edgeinfer.tokenizer.Tokenizer is one)."""

    clean_spaces: bool
    add_space_prefix: bool

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes: ...


# llama_vocab::impl::detokenize's three `clean_spaces` passes, each written as the regex it
# is equivalent to (the in-place loops read only original bytes, or the NUL they wrote).
_PASS1 = re.compile(rb" (?=[?!.,])")          # " ?" " !" " ." " ,"  -> drop the space
_PASS2 = re.compile(rb" ' ")                  # " ' "              -> "'"
_PASS3 = re.compile(rb" '(?=[sm]|re|ve)")     # " 's" " 'm" " 're" " 've" -> drop the space


def clean_spaces(text: bytes) -> bytes:
    """clean_up_tokenization_spaces as llama.cpp applies it to a whole detokenized text."""
    if b" " not in text:
        return text
    text = _PASS1.sub(b"", text)
    text = _PASS2.sub(b"'", text)
    return _PASS3.sub(b"'", text)


class StreamDecoder:
    """Incremental detokenization: `push(id)` returns the text that is final so far.

    Never emits half a UTF-8 character, and `"".join(pushes) + flush()` equals
    `tokenizer.detokenize(ids, skip_special, as_pieces=as_pieces)`: bytes are held back
    while a clean-up rule (a match starts at a space, spans at most 4 bytes) could change them.
    `as_pieces=True` streams the plain pieces, as llama-server does for generated text.
    """

    def __init__(self, tokenizer: PieceSource, skip_special: bool = False,
                 as_pieces: bool = False, shown: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.shown = shown  # control tokens shown even with skip_special (a chat format's markup)
        self.as_pieces = as_pieces
        self._clean = tokenizer.clean_spaces and not as_pieces
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = b""  # raw bytes not yet cleaned and emitted
        self._first = True

    def push(self, token_id: int) -> str:
        tok = self.tokenizer
        piece = tok.token_to_piece(token_id, special=not self.skip_special or token_id in self.shown)
        if self._first:  # llama.cpp strips one leading space from the first piece only
            if tok.add_space_prefix and not self.as_pieces and piece[:1] == b" ":
                piece = piece[1:]
            self._first = False
        self._pending += piece
        if not self._clean:
            out, self._pending = self._pending, b""
            return self._utf8.decode(out)
        # cut where the 3 bytes before it hold no space: no clean-up match can span it
        cut = len(self._pending)
        while cut > 0 and b" " in self._pending[max(cut - 3, 0):cut]:
            cut -= 1
        if cut <= 0:
            return ""
        ready, self._pending = self._pending[:cut], self._pending[cut:]
        return self._utf8.decode(clean_spaces(ready))

    def flush(self) -> str:
        tail = clean_spaces(self._pending) if self._clean else self._pending
        self._pending = b""
        return self._utf8.decode(tail, final=True)
