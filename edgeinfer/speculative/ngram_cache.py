"""An n-gram cache: how often each token followed each 1..4-token n-gram, kept in memory
and saved to disk, as llama.cpp's common/ngram-cache builds for lookup decoding.

Memory is bounded: at most MAX_NGRAMS n-grams (500,000: about 80 MB of Python objects, measured)
and MAX_SUCCESSORS following tokens each. Past the first cap the oldest-added quarter of
the n-grams is dropped (the dynamic cache keeps what is recent); past the second the
least-seen successor goes.

The file (`save` / `load`) is this project's own, little-endian:

    magic "EINGRAM\\x01" | u32 n_vocab | 32 bytes: SHA-256 of the vocabulary's token texts
    | u32 n_max (4) | u64 n_ngrams | u64 n_successors
    | int32[n_ngrams][4]  the n-grams, padded after their last token with -1
    | int32[n_ngrams]     successors per n-gram (1..MAX_SUCCESSORS)
    | int32[n_successors] successor tokens | int32[n_successors] their counts (>= 1)

Every value is checked before use (sizes against the file's length, tokens against the
vocabulary, counts, duplicates): a file that fails is refused with one line naming it and
the problem (`NgramCacheError`), as is one made with another vocabulary.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from edgeinfer.errors import EdgeInferError

NGRAM_MIN, NGRAM_MAX = 1, 4
MAX_NGRAMS = 500_000
MAX_SUCCESSORS = 8
MAX_COUNT = 1 << 30
MAGIC = b"EINGRAM\x01"
_HEADER = struct.Struct("<8sI32sIQQ")


class NgramCacheError(EdgeInferError):
    """A cache file edgeinfer cannot use: one line naming the file and the problem."""


def vocab_digest(tokenizer) -> bytes:
    """SHA-256 over the vocabulary's token texts, in id order (a cache's token ids mean
    something only with the vocabulary it was made with)."""
    h = hashlib.sha256()
    for text in tokenizer._texts:
        b = text if isinstance(text, bytes) else str(text).encode("utf-8", "surrogateescape")
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return h.digest()


class NgramCache:
    """n-gram (1..4 token ids) -> {next token: count}."""

    def __init__(self, n_vocab: int, digest: bytes = b"", max_ngrams: int = MAX_NGRAMS) -> None:
        if n_vocab <= 0:
            raise ValueError(f"n_vocab must be positive, got {n_vocab}")
        self.n_vocab = int(n_vocab)
        self.digest = digest
        self.max_ngrams = max_ngrams
        self._bits = max(1, (self.n_vocab - 1).bit_length())
        # packed n-gram (a leading 1 bit, then each token in _bits bits) -> its successors:
        # one as an int (token << 32 | count: most n-grams have one), several as {token: count}
        self.table: dict[int, int | dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.table)

    def key(self, ngram: Sequence[int]) -> int:
        k = 1
        for t in ngram:
            k = (k << self._bits) | t
        return k

    def unpack(self, key: int) -> list[int]:
        out = []
        mask = (1 << self._bits) - 1
        while key > 1:
            out.append(key & mask)
            key >>= self._bits
        return out[::-1]

    # -- building -------------------------------------------------------------------------
    def add(self, ngram_key: int, token: int, count: int = 1) -> None:
        table = self.table
        part = table.get(ngram_key)
        if part is None:
            if len(table) >= self.max_ngrams:
                self._evict()
            table[ngram_key] = token << 32 | count
            return
        if type(part) is int:
            if part >> 32 == token:
                table[ngram_key] = token << 32 | min((part & 0xFFFFFFFF) + count, MAX_COUNT)
                return
            part = table[ngram_key] = {part >> 32: part & 0xFFFFFFFF}
        c = part.get(token)
        if c is not None:
            part[token] = min(c + count, MAX_COUNT)
            return
        if len(part) >= MAX_SUCCESSORS:
            del part[min(part, key=part.__getitem__)]
        part[token] = count

    def successors(self, ngram_key: int) -> dict[int, int]:
        """{token: count} after the n-gram ({} when never seen)."""
        part = self.table.get(ngram_key)
        if part is None:
            return {}
        if type(part) is int:
            return {part >> 32: part & 0xFFFFFFFF}
        return part

    def top(self, ngram_key: int) -> tuple[int, int, int] | None:
        """(most frequent successor, its count, all counts), or None when never seen."""
        part = self.table.get(ngram_key)
        if part is None:
            return None
        if type(part) is int:
            c = part & 0xFFFFFFFF
            return part >> 32, c, c
        tok = max(part, key=part.__getitem__)
        return tok, part[tok], sum(part.values())

    def _evict(self) -> None:
        """Drop the oldest-added quarter of the n-grams (dicts keep insertion order)."""
        drop = max(1, len(self.table) // 4)
        for k in [k for _, k in zip(range(drop), self.table)]:
            del self.table[k]

    def update(self, tokens: Sequence[int], start: int = 0) -> None:
        """Count every n-gram of `tokens` followed by a token at index >= start."""
        toks = [int(t) for t in tokens]
        for e in range(max(start, NGRAM_MIN), len(toks)):
            nxt = toks[e]
            for k in self.suffix_keys(toks, e):
                self.add(k, nxt)

    def suffix_keys(self, toks: Sequence[int], end: int) -> list[int]:
        """Packed keys of toks[end-1:end], toks[end-2:end], ... up to NGRAM_MAX tokens."""
        keys = []
        k = 1
        for n in range(1, min(NGRAM_MAX, end) + 1):
            k = self._prepend(k, toks[end - n], n - 1)
            keys.append(k)
        return keys

    def _prepend(self, key: int, token: int, n_old: int) -> int:
        """Key of (token, *old) from the key of old (n_old tokens)."""
        shift = self._bits * n_old
        return (((1 << self._bits) | token) << shift) | (key ^ (1 << shift))

    def merge(self, other: "NgramCache") -> None:
        for k in other.table:
            for tok, c in other.successors(k).items():
                self.add(k, tok, c)

    # -- drafting -------------------------------------------------------------------------
    def best(self, tail: Sequence[int], n: int) -> tuple[int, int, int] | None:
        """(most frequent next token, its count, all counts) after the last n tokens of
        `tail`, or None when that n-gram was never seen."""
        if n > len(tail):
            return None
        return self.top(self.key(tail[len(tail) - n:]))

    # -- files ----------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        n = len(self.table)
        keys = np.full((n, NGRAM_MAX), -1, dtype="<i4")
        n_succ = np.empty(n, dtype="<i4")
        toks: list[int] = []
        counts: list[int] = []
        for i, k in enumerate(self.table):
            part = self.successors(k)
            ng = self.unpack(k)
            keys[i, :len(ng)] = ng
            n_succ[i] = len(part)
            toks.extend(part.keys())
            counts.extend(part.values())
        head = _HEADER.pack(MAGIC, self.n_vocab, self.digest.ljust(32, b"\0")[:32], NGRAM_MAX, n, len(toks))
        return b"".join((head, keys.tobytes(), n_succ.tobytes(), np.asarray(toks, dtype="<i4").tobytes(),
                         np.asarray(counts, dtype="<i4").tobytes()))

    def save(self, path: str | Path) -> None:
        """Write the cache atomically (a temp file renamed over `path`)."""
        from edgeinfer.atomic_file import write_atomically

        data = self.to_bytes()
        write_atomically(Path(path), lambda f: f.write(data))

    @classmethod
    def from_bytes(cls, data: bytes, name: str, n_vocab: int | None = None,
                   digest: bytes | None = None, max_ngrams: int = MAX_NGRAMS) -> "NgramCache":
        """Parse and check a saved cache; `n_vocab` / `digest` (the model's) when known."""
        def bad(problem: str) -> NgramCacheError:
            return NgramCacheError(f"lookup cache {name}: {problem}")

        if len(data) < _HEADER.size or not data.startswith(MAGIC):
            raise bad("not an edgeinfer n-gram cache (bad magic or too short)")
        magic, f_vocab, f_digest, n_max, n_keys, n_total = _HEADER.unpack_from(data)
        if n_max != NGRAM_MAX:
            raise bad(f"n-grams of up to {n_max} tokens; this version reads {NGRAM_MAX}")
        if not 0 < f_vocab <= 1 << 24:
            raise bad(f"vocabulary size {f_vocab} is out of range")
        if n_vocab is not None and (f_vocab != n_vocab or (digest is not None and f_digest != digest)):
            what = f"{f_vocab} tokens, the model has {n_vocab}" if f_vocab != n_vocab else "other token texts"
            raise bad(f"made with another vocabulary ({what}); rebuild it for this model")
        if n_keys > max_ngrams:
            raise bad(f"{n_keys} n-grams, more than the cap of {max_ngrams}")
        if n_total > n_keys * MAX_SUCCESSORS:
            raise bad(f"{n_total} successors for {n_keys} n-grams (at most {MAX_SUCCESSORS} each)")
        want = _HEADER.size + 4 * (NGRAM_MAX * n_keys + n_keys + 2 * n_total)
        if len(data) != want:
            raise bad(f"{len(data)} bytes where the header implies {want} (truncated or corrupt)")
        off = _HEADER.size
        keys = np.frombuffer(data, "<i4", NGRAM_MAX * n_keys, off).reshape(n_keys, NGRAM_MAX)
        off += keys.nbytes
        n_succ = np.frombuffer(data, "<i4", n_keys, off)
        off += n_succ.nbytes
        toks = np.frombuffer(data, "<i4", n_total, off)
        counts = np.frombuffer(data, "<i4", n_total, off + toks.nbytes)
        # n-grams: 1..4 tokens in [0, n_vocab), then only -1 padding
        valid = (keys >= 0) & (keys < f_vocab)
        lengths = valid.sum(axis=1)
        if n_keys and (lengths.min() < NGRAM_MIN or
                       not np.array_equal(valid, np.arange(NGRAM_MAX) < lengths[:, None]) or
                       not np.all(keys[~valid] == -1)):
            raise bad("an n-gram holds a token id outside the vocabulary or bad padding")
        if n_keys and (n_succ.min() < 1 or n_succ.max() > MAX_SUCCESSORS):
            raise bad(f"an n-gram has {int(n_succ.min())}..{int(n_succ.max())} successors "
                      f"(1..{MAX_SUCCESSORS} allowed)")
        if int(n_succ.sum(dtype=np.int64)) != n_total:
            raise bad("successor counts do not add up to the header's total")
        if n_total and (toks.min() < 0 or toks.max() >= f_vocab):
            raise bad("a successor token id is outside the vocabulary")
        if n_total and (counts.min() < 1 or counts.max() > MAX_COUNT):
            raise bad("a count is out of range")
        cache = cls(f_vocab, f_digest, max_ngrams)
        tok_list, cnt_list = toks.tolist(), counts.tolist()
        i = 0
        table = cache.table
        for row, ln, ns in zip(keys.tolist(), lengths.tolist(), n_succ.tolist()):
            k = cache.key(row[:ln])
            if k in table:
                raise bad("a duplicated n-gram")
            if ns == 1:
                table[k] = tok_list[i] << 32 | cnt_list[i]
            else:
                part = dict(zip(tok_list[i:i + ns], cnt_list[i:i + ns]))
                if len(part) != ns:
                    raise bad("a duplicated successor")
                table[k] = part
            i += ns
        return cache

    @classmethod
    def load(cls, path: str | Path, n_vocab: int | None = None, digest: bytes | None = None,
             max_ngrams: int = MAX_NGRAMS) -> "NgramCache":
        p = Path(path)
        data = read_regular_file(p, _HEADER.size + 4 * (NGRAM_MAX + 1 + 2 * MAX_SUCCESSORS) * max_ngrams)
        return cls.from_bytes(data, str(p), n_vocab, digest, max_ngrams)


def read_regular_file(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them (one-line errors otherwise)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise NgramCacheError(f"lookup cache {path}: no such file") from None
    except OSError as exc:
        raise NgramCacheError(f"lookup cache {path}: {exc.strerror or exc}") from None
    import stat as _stat

    if not _stat.S_ISREG(st.st_mode):
        raise NgramCacheError(f"lookup cache {path}: not a regular file")
    if st.st_size > limit:
        raise NgramCacheError(f"lookup cache {path}: {st.st_size} bytes, more than the limit of {limit}")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise NgramCacheError(f"lookup cache {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise NgramCacheError(f"lookup cache {path}: more than the limit of {limit} bytes")
    return data


def from_tokens(token_lists: Iterable[Sequence[int]], n_vocab: int, digest: bytes = b"") -> NgramCache:
    cache = NgramCache(n_vocab, digest)
    for toks in token_lists:
        cache.update(toks)
    return cache
