"""Unigram SentencePiece (`tokenizer.ggml.model = "t5"`: T5, XLM-R and the bge-m3 /
bge-reranker-v2-m3 cross-encoders) as llama.cpp's llm_tokenizer_ugm runs it.

1. Normalize, one input prefix at a time: a prefix along the user-defined tokens' trie is
   kept as it is (the trie's depth, whether a token ends there or not); else the longest
   key of the precompiled charsmap (an XOR-compressed double array, XCDA) is replaced by
   its string; else one valid UTF-8 character is kept, or one bad byte becomes U+FFFD.
   Spaces (0x20 only) become U+2581; `add_space_prefix` puts one before the first
   non-space, `remove_extra_whitespaces` one before every run of non-spaces and none else.
2. Viterbi over UTF-8 characters of the normalized bytes: every token (normal, user-defined
   or unused) that starts at a character boundary challenges the best path to its end with
   its score (user-defined tokens score 0); a character no token covers alone takes UNK at
   the lowest normal score minus 10. Sums are doubles, ties keep the first path found.
3. Back from the end, a run of UNKs becomes one.

The charsmap is someone else's input: its header and every node a walk can reach are checked
once, at load, so a corrupt one is one TokenizerError line, never an index error later.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from edgeinfer.errors import TokenizerError

_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)  # by the lead byte's high nibble
_ESCAPED_SPACE = "\u2581".encode()
_REPLACEMENT = "\ufffd".encode()
_NEG = -sys.float_info.max  # llama.cpp's -DBL_MAX: below every sum of token scores
_UNK_PENALTY = np.float32(10.0)
_HEAD = 4  # tokens of 4+ bytes are looked up by the longest token sharing their first 4
_KEY = "tokenizer.ggml.precompiled_charsmap"

# token attribute bits (llama_token_attr), as edgeinfer.tokenizer.TokenAttr
_UNUSED, _NORMAL, _USER_DEFINED = 1 << 1, 1 << 2, 1 << 4


def charsmap_bytes(value: Any) -> bytes | None:
    """The `tokenizer.ggml.precompiled_charsmap` metadata value as bytes (None: absent).
    llama.cpp takes an array of int8 or uint8 only."""
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype in (np.int8, np.uint8):
        return value.astype(np.uint8).tobytes()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise TokenizerError(f"{_KEY} must be an array of bytes (int8 or uint8)")


def _base(unit: int) -> int:
    """An XCDA unit's BASE (bits 10-30, shifted left 8 more where bit 9 is set), as uint32."""
    return ((unit >> 10) << ((unit & (1 << 9)) >> 6)) & 0xFFFFFFFF


class Charsmap:
    """SentencePiece's precompiled charsmap: a uint32 size, that many bytes of XCDA units,
    then NUL-terminated replacement strings the leaves point into."""

    def __init__(self, blob: bytes) -> None:
        if len(blob) < 4:
            raise TokenizerError(f"{_KEY} is corrupt: {len(blob)} bytes, too small for its size header")
        size = int.from_bytes(blob[:4], "little")
        if size + 4 >= len(blob):
            raise TokenizerError(f"{_KEY} is corrupt: its double array of {size} bytes does not fit "
                                 f"in the charsmap's {len(blob)} bytes")
        units = np.frombuffer(blob, "<u4", count=size // 4, offset=4)
        self._strings = blob[4 + size:]
        self._units: list[int] = units.tolist()
        self._root = _base(self._units[0]) if self._units else 0
        # leaf state -> its replacement, for every leaf a walk can reach (checked below)
        self._replacement: dict[int, bytes] = {}
        if self._units:
            self._check(units.astype(np.uint64))

    def _check(self, units: np.ndarray) -> None:
        """Walk every node reachable from the root, a level at a time: each child index a byte
        leads to must lie in the array, and each leaf must point at a terminated string (else
        llama.cpp throws in the middle of tokenizing, on the first text that reaches it)."""
        n = len(units)
        labels = np.arange(1, 256, dtype=np.uint64)  # byte 0 ends a walk
        nuls = np.flatnonzero(np.frombuffer(self._strings, np.uint8) == 0)
        seen: set[int] = set()
        frontier = np.array([self._root], np.uint64)
        while frontier.size:
            seen.update(frontier.tolist())
            pos = frontier[:, None] ^ labels[None, :]  # (states, 255) child indexes
            if int(pos.max()) >= n:
                raise TokenizerError(f"{_KEY} is corrupt: a node of its double array points "
                                     f"past its {n} entries")
            unit = units[pos]
            hit = (unit & np.uint64((1 << 31) | 0xFF)) == labels[None, :]
            pos, unit = pos[hit], unit[hit]
            nxt = (pos ^ ((unit >> np.uint64(10)) << ((unit & np.uint64(1 << 9)) >> np.uint64(6)))) \
                & np.uint64(0xFFFFFFFF)
            leaf = nxt[((unit >> np.uint64(8)) & np.uint64(1)) == 1]
            if leaf.size:
                if int(leaf.max()) >= n:
                    raise TokenizerError(f"{_KEY} is corrupt: a leaf of its double array points "
                                         f"past its {n} entries")
                offsets = (units[leaf] & np.uint64((1 << 31) - 1)).astype(np.int64)
                ends = np.searchsorted(nuls, offsets)
                if (offsets >= len(self._strings)).any() or (ends >= len(nuls)).any():
                    raise TokenizerError(f"{_KEY} is corrupt: a replacement string lies outside its "
                                         f"{len(self._strings)} bytes or is not terminated")
                for state, start, end in zip(leaf.tolist(), offsets.tolist(), nuls[ends].tolist()):
                    self._replacement[state] = self._strings[start:end]
            frontier = np.unique(nxt)
            if seen:
                frontier = frontier[~np.isin(frontier, np.fromiter(seen, np.uint64, len(seen)))]

    def match(self, data: bytes, start: int) -> tuple[int, bytes] | None:
        """(bytes matched, replacement) of the longest charsmap key at data[start:], or None."""
        units = self._units
        if not units:
            return None
        node, best = self._root, None
        for k in range(start, len(data)):
            c = data[k]
            if c == 0:
                break
            node ^= c
            unit = units[node]
            if unit & 0x800000FF != c:
                break
            node ^= _base(unit)
            if unit & 0x100:
                best = (k - start + 1, node)
        return None if best is None else (best[0], self._replacement[best[1]])


class Unigram:
    """One vocabulary's UGM tokenizer. `types` are the token attributes as the file gives
    them (before the special-token fix-ups, as llama.cpp builds its tries);
    `finish` takes the final attributes and the UNK id once the vocabulary knows them."""

    def __init__(self, texts: list[bytes], scores: list[float], attrs: list[int], charsmap: bytes | None,
                 add_space_prefix: bool, remove_extra_whitespaces: bool, escape_whitespaces: bool = True,
                 treat_whitespace_as_suffix: bool = False) -> None:
        self._charsmap = Charsmap(charsmap) if charsmap else None
        self._space = _ESCAPED_SPACE if escape_whitespaces else b" "
        self._prepend = add_space_prefix and not treat_whitespace_as_suffix
        self._append = add_space_prefix and treat_whitespace_as_suffix
        self._merge = remove_extra_whitespaces
        self._scores = scores
        matched = _NORMAL | _USER_DEFINED | _UNUSED
        self._id_of: dict[bytes, int] = {}  # the token trie's contents: the last of duplicates wins
        self._longest: dict[bytes, int] = {}  # first _HEAD bytes -> the longest such token
        self._ud_prefixes: set[bytes] = set()  # every prefix of a user-defined token
        kinds = np.asarray(attrs, np.int64)
        normal = np.asarray(scores, np.float32)[(kinds & _NORMAL) != 0]
        min_score = normal.min() if normal.size else np.finfo(np.float32).max
        for tid in np.flatnonzero(kinds & matched).tolist():
            text = texts[tid]
            self._id_of[text] = tid
            if len(text) >= _HEAD:
                head = text[:_HEAD]
                if len(text) > self._longest.get(head, 0):
                    self._longest[head] = len(text)
        for tid in np.flatnonzero(kinds & _USER_DEFINED).tolist():
            self._ud_prefixes.update(texts[tid][:k] for k in range(1, len(texts[tid]) + 1))
        # float arithmetic, as llama.cpp's `float unknown_token_score`
        self._unk_score = float(np.float32(min_score) - _UNK_PENALTY)
        self._ud_max = max(map(len, self._ud_prefixes), default=0)
        self._unk: int | None = None
        self._token_score: dict[int, float] = {}

    def finish(self, attrs: list[int], unk_id: int | None) -> None:
        self._unk = unk_id
        self._token_score = {tid: 0.0 if attrs[tid] & _USER_DEFINED else self._scores[tid]
                             for tid in self._id_of.values()}

    # -- normalization ----------------------------------------------------------------------

    def normalize(self, data: bytes) -> bytes:
        """llm_tokenizer_ugm_session::normalize."""
        pieces: list[bytes] = []
        i, n = 0, len(data)
        charsmap = self._charsmap
        while i < n:
            if self._ud_max:  # the depth along the user-defined tokens' trie
                k = 0
                while k < self._ud_max and i + k < n and data[i:i + k + 1] in self._ud_prefixes:
                    k += 1
                if k:
                    pieces.append(data[i:i + k])
                    i += k
                    continue
            hit = charsmap.match(data, i) if charsmap is not None else None
            if hit is not None:
                pieces.append(hit[1])
                i += hit[0]
                continue
            size = _valid_utf8_len(data, i)
            if size:
                pieces.append(data[i:i + size])
                i += size
            else:
                pieces.append(_REPLACEMENT)
                i += 1
        text = b"".join(pieces)
        space = self._space
        if self._merge:  # a space before every run of non-spaces, none else
            out = b"".join(space + word for word in text.split(b" ") if word)
        else:
            out = text.replace(b" ", space)
            if self._prepend:
                lead = len(text) - len(text.lstrip(b" "))
                if lead < len(text):
                    cut = lead * len(space)
                    out = out[:cut] + space + out[cut:]
        return out + space if self._append else out

    # -- Viterbi ------------------------------------------------------------------------------

    def encode(self, data: bytes, out: list[int]) -> None:
        """Append the token ids of one raw-text fragment."""
        norm = self.normalize(data)
        n = len(norm)
        if n == 0:
            return
        unk = -1 if self._unk is None else self._unk
        id_of, longest, token_score = self._id_of, self._longest, self._token_score
        unk_score = self._unk_score
        best_score = [_NEG] * (n + 1)
        best_token = [unk] * (n + 1)
        best_from = [0] * (n + 1)
        best_score[0] = 0.0
        i = 0
        while i < n:
            width = min(_UTF8_LEN[norm[i] >> 4], n - i)
            here = best_score[i]
            whole = False
            # every token at norm[i:], shortest first (the order llama.cpp's trie walk meets them)
            last = min(n - i, _HEAD - 1)
            if n - i >= _HEAD:
                last = max(last, min(n - i, longest.get(norm[i:i + _HEAD], 0)))
            for end in range(i + 1, i + last + 1):
                tid = id_of.get(norm[i:end])
                if tid is None:
                    continue
                if end - i == width:
                    whole = True
                score = here + token_score[tid]
                if score > best_score[end]:
                    best_score[end], best_token[end], best_from[end] = score, tid, i
            if not whole:
                end = i + width
                score = here + unk_score
                if score > best_score[end]:
                    best_score[end], best_token[end], best_from[end] = score, unk, i
            i += width
        ids: list[int] = []
        prev_unknown, j = False, n
        while True:
            tid = best_token[j]
            unknown = tid == unk
            if not (prev_unknown and unknown):
                ids.append(tid)
            if best_from[j] == 0:
                break
            prev_unknown, j = unknown, best_from[j]
        if unk < 0 and unk in ids:
            raise TokenizerError("the vocabulary has no unknown token for text none of its tokens covers")
        ids.reverse()
        out += ids


def _valid_utf8_len(data: bytes, i: int) -> int:
    """Length of the valid UTF-8 character at data[i:] as llama.cpp's unicode_cpt_from_utf8
    reads one (lead byte, continuation bytes present and 10xxxxxx; overlongs and surrogates
    pass), or 0."""
    b = data[i]
    if b < 0x80:
        return 1
    if b & 0x40 == 0:  # a stray continuation byte
        return 0
    if b & 0x20 == 0:
        size = 2
    elif b & 0x10 == 0:
        size = 3
    elif b & 0x08 == 0:
        size = 4
    else:
        return 0
    if i + size > len(data):
        return 0
    for k in range(i + 1, i + size):
        if data[k] & 0xC0 != 0x80:
            return 0
    return size
