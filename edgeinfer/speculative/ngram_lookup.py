"""`--draft lookup` with a lookup corpus: drafts from the request's own tokens, the
session's earlier requests, a static corpus file and a dynamic cache file.

Sources, tried for each drafted token in this order of trust:
- the context (this request's prompt and answer so far, and the draft before this token):
  the longest of its last 4..1 tokens that occurred earlier in the context gives the token
  that followed its last occurrence (prompt lookup, as `PromptLookup`);
- the n-gram caches (edgeinfer.speculative.ngram_cache), where they match a longer n-gram
  than the context did, or one as long where their drafts have been kept more often than
  the context's lately (a moving score per source, from `accept`): the session's (every earlier request of this process, with
  the `--lookup-cache-dynamic` file's n-grams), then the static one (`--lookup-cache-static`:
  a text or code file tokenized with the model's tokenizer, or a saved cache). A cache's
  most frequent successor is drafted when it was seen often enough (MIN_SAMPLES) and is a
  large enough share of what followed (MIN_PERCENT): a 3- or 4-gram seen once is enough,
  a single token needs 4 sightings at 75%, as llama.cpp's strict thresholds.

Drafting stops at the first token no source offers. The session cache learns a request's
tokens when the next request begins and when the drafter is closed; the dynamic file is
then written atomically (at `close()`, which runs at interpreter exit too).

llama.cpp's `--lookup-cache-static` / `--lookup-cache-dynamic` name the same files; its
files have no header naming their vocabulary, so this project writes its own format.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from edgeinfer.speculative.ngram_cache import (MAGIC, MAX_NGRAMS, NGRAM_MAX, NgramCache, NgramCacheError,
                                               read_regular_file, vocab_digest)

MAX_TEXT_BYTES = 8 << 20  # a static text corpus (the tokenizer reads about 0.5 MB/s)
MIN_SAMPLES = {1: 4, 2: 2, 3: 1, 4: 1}    # sightings of an n-gram before a cache drafts from it
MIN_PERCENT = {1: 75, 2: 66, 3: 50, 4: 50}  # share of them its most frequent successor needs
CONTEXT, SESSION, STATIC = 0, 1, 2  # the sources, for the scores that break ties


@dataclass(frozen=True)
class LookupCorpus:
    """`--draft lookup` with its corpus files (what `edgeinfer.load(draft=...)` takes)."""

    static: str | None = None   # text/code file or saved cache (read only)
    dynamic: str | None = None  # saved cache, read if present, written at the end

    def __str__(self) -> str:
        return "lookup"

    def check_files(self) -> None:
        """Cheap checks before a model loads (the full ones need its vocabulary)."""
        if self.static is not None:
            p = Path(self.static)
            if not p.exists():
                raise NgramCacheError(f"lookup corpus {p}: no such file")
            read_regular_file(p, max(MAX_TEXT_BYTES, _cache_bytes_limit()))
        if self.dynamic is not None:
            p = Path(self.dynamic)
            if p.exists():
                head = read_regular_file(p, _cache_bytes_limit())[:len(MAGIC)]
                if head and head != MAGIC:
                    raise NgramCacheError(f"lookup cache {p}: not an edgeinfer n-gram cache "
                                          f"(the dynamic cache is written by edgeinfer)")
            elif not p.parent.is_dir():
                raise NgramCacheError(f"lookup cache {p}: no such directory {p.parent}")


def _cache_bytes_limit() -> int:
    from edgeinfer.speculative.ngram_cache import _HEADER, MAX_SUCCESSORS

    return _HEADER.size + 4 * (NGRAM_MAX + 1 + 2 * MAX_SUCCESSORS) * MAX_NGRAMS


def load_static(path: str, tokenizer, n_vocab: int, digest: bytes) -> NgramCache:
    """A saved cache (checked against the vocabulary), or a UTF-8 text file's n-grams."""
    p = Path(path)
    data = read_regular_file(p, max(MAX_TEXT_BYTES, _cache_bytes_limit()))
    if data.startswith(MAGIC):
        return NgramCache.from_bytes(data, str(p), n_vocab, digest)
    if len(data) > MAX_TEXT_BYTES:
        raise NgramCacheError(f"lookup corpus {p}: {len(data)} bytes of text, more than the limit of "
                              f"{MAX_TEXT_BYTES}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NgramCacheError(f"lookup corpus {p}: neither UTF-8 text nor an edgeinfer n-gram cache "
                              f"(byte {exc.start} is not UTF-8)") from None
    if "\0" in text:
        raise NgramCacheError(f"lookup corpus {p}: a binary file, neither text nor an edgeinfer n-gram cache")
    cache = NgramCache(n_vocab, digest)
    cache.update(tokenizer.tokenize(text, add_special=False))
    return cache


def load_dynamic(path: str, n_vocab: int, digest: bytes) -> NgramCache:
    """The dynamic cache file's n-grams; an empty cache when the file does not exist yet."""
    p = Path(path)
    if not p.exists():
        if not p.parent.is_dir():
            raise NgramCacheError(f"lookup cache {p}: no such directory {p.parent}")
        return NgramCache(n_vocab, digest)
    data = read_regular_file(p, _cache_bytes_limit())
    if not data:
        return NgramCache(n_vocab, digest)
    return NgramCache.from_bytes(data, str(p), n_vocab, digest)


class _Memory:
    """What the session learns and the dynamic file gets: kept apart from the drafter so
    that its `close` runs when the drafter is collected or the interpreter exits."""

    def __init__(self, session: NgramCache, path: str | None) -> None:
        self.session = session
        self.path = path
        self.tokens: list[int] = []              # this request's tokens, as far as indexed
        self.live: Sequence[int] | None = None   # the decode loop's history (observe)
        self.dirty = False
        self.closed = False

    def commit(self) -> None:
        toks = list(self.live) if self.live is not None else list(self.tokens)
        self.live = None
        self.tokens = []
        n_vocab = self.session.n_vocab
        if len(toks) > 1:
            self.session.update([t for t in toks if 0 <= t < n_vocab])
            self.dirty = True

    def close(self) -> None:
        if self.closed:
            return
        self.commit()
        self.closed = True
        if self.path is not None and self.dirty:
            try:
                self.session.save(self.path)
            except OSError as exc:
                print(f"edgeinfer: lookup cache {self.path} not saved: {exc.strerror or exc}", file=sys.stderr)


class NgramLookup:
    """The lookup drafter (see the module docstring); one request at a time."""

    name = "lookup"
    CHEAP = True   # a proposal costs no forward pass (Speculation proposes while decoding plainly too)

    def __init__(self, n_vocab: int, digest: bytes = b"", static: NgramCache | None = None,
                 session: NgramCache | None = None, dynamic_path: str | None = None) -> None:
        self.n_vocab = n_vocab
        self.static = static
        self._mem = _Memory(session if session is not None else NgramCache(n_vocab, digest), dynamic_path)
        self._keys = self._mem.session  # key packing (the same for every cache of this vocabulary)
        self._ctx: dict[int, int] = {}  # packed n-gram -> index of the token after its last occurrence
        self._score = {CONTEXT: 0.6, SESSION: 0.5, STATIC: 0.5}  # moving share of each source's kept tokens
        self._sources: list[int] = []  # the source of each token of the last proposal
        # the dynamic file is written when the session ends: close(), the drafter collected,
        # or the interpreter exiting
        self._finalizer = weakref.finalize(self, self._mem.close)

    @property
    def session(self) -> NgramCache:
        """Every earlier request's n-grams (and the dynamic file's)."""
        return self._mem.session

    @property
    def dynamic_path(self) -> str | None:
        return self._mem.path

    @classmethod
    def for_model(cls, model, corpus: LookupCorpus | None = None) -> "NgramLookup":
        """The drafter for `model`, its files read and checked against its vocabulary."""
        n_vocab = int(model.config.n_vocab)
        tok = model.tokenizer
        digest = vocab_digest(tok)
        static = session = None
        if corpus is not None and corpus.static is not None:
            static = load_static(corpus.static, tok, n_vocab, digest)
        if corpus is not None and corpus.dynamic is not None:
            session = load_dynamic(corpus.dynamic, n_vocab, digest)
        return cls(n_vocab, digest, static, session, corpus.dynamic if corpus is not None else None)

    # -- the Drafter protocol ------------------------------------------------------------
    def begin(self, prompt: Sequence[int]) -> None:
        self._mem.commit()  # the last request: the session learns it
        self._ctx = {}

    def observe(self, context: Sequence[int]) -> None:
        """The decode loop's token list (it grows in place): what the session learns."""
        self._mem.live = context

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if k <= 0 or not context:
            return []
        self._sync(context)
        tail = self._mem.tokens[-NGRAM_MAX:]
        out: list[int] = []
        self._sources = sources = []
        while len(out) < k:
            got = self._next(tail)
            if got is None:
                break
            tok, src = got
            out.append(tok)
            sources.append(src)
            tail = tail[1:] + [tok] if len(tail) >= NGRAM_MAX else tail + [tok]
        return out

    def accept(self, n_drafted: int, n_accepted: int) -> None:
        """Score each source by how often its tokens were kept (it breaks ties)."""
        score = self._score
        for i, src in enumerate(self._sources[:n_drafted]):
            if i > n_accepted:
                break  # after the first rejected token nothing was tested
            score[src] = 0.9 * score[src] + (0.1 if i < n_accepted else 0.0)
        self._sources = []

    def close(self) -> None:
        """The session ends: learn the last request, write the dynamic file (atomically)."""
        self._finalizer()

    # -- internals ------------------------------------------------------------------------
    def _sync(self, context: Sequence[int]) -> None:
        toks = self._mem.tokens
        n_old = len(toks)
        if len(context) < n_old or (n_old and context[n_old - 1] != toks[-1]):
            toks, n_old = [], 0  # not a continuation of what was indexed
            self._mem.tokens, self._ctx = toks, {}
        toks.extend(int(t) for t in context[n_old:])
        ctx, keys = self._ctx, self._keys
        for e in range(max(n_old, 1), len(toks)):
            for key in keys.suffix_keys(toks, e):
                ctx[key] = e

    def _next(self, tail: list[int]) -> tuple[int, int] | None:
        """(token, source) for the next position after `tail`, or None."""
        keys = self._keys.suffix_keys(tail, len(tail))  # 1-gram, 2-gram, ... of the tail
        n_ctx, tok_ctx = 0, None
        for n in range(len(keys), 0, -1):
            e = self._ctx.get(keys[n - 1])
            if e is not None:
                n_ctx, tok_ctx = n, self._mem.tokens[e]
                break
        score = self._score
        for n in range(len(keys), max(n_ctx - 1, 0), -1):
            for src, cache in ((SESSION, self._mem.session), (STATIC, self.static)):
                if cache is None:
                    continue
                if n == n_ctx and score[src] <= score[CONTEXT]:
                    continue  # a tie goes to the context unless this source has been righter
                got = cache.top(keys[n - 1])
                if got is None:
                    continue
                tok, count, total = got
                if tok == tok_ctx and n == n_ctx:
                    continue
                if total >= MIN_SAMPLES[n] and 100 * count >= MIN_PERCENT[n] * total:
                    return tok, src
        return None if tok_ctx is None else (tok_ctx, CONTEXT)

def is_lookup(draft) -> bool:
    return isinstance(draft, LookupCorpus) or draft == "lookup"
