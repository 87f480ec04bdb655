"""XLM-R-shaped unigram SentencePiece vocabularies for tests (`tokenizer.ggml.model = "t5"`),
with a precompiled charsmap built here: no sentencepiece, no download.

    vocab = ugm_vocab()                                   # XLM-R's layout and flags
    path = write_ugm_encoder(tmp_path / "x.gguf", vocab)  # a tiny `bert` encoder with it
    blob = build_charsmap({b"\\xef\\xac\\x81": b"fi"})       # SentencePiece's charsmap format

The charsmap is a Darts-clone double array (XCDA) over the keys' bytes, as SentencePiece
writes it: a uint32 size, the 32-bit units (label in bits 0-7, "has a leaf" in bit 8,
BASE in bits 10-30; a leaf unit has bit 31 set and the replacement's offset), then the
NUL-terminated replacement strings. `nfkc_rules` gives NFKC-like rules as
SentencePiece's nmt_nfkc does (from Python's unicodedata, so not byte-equal to it).
"""

from __future__ import annotations

import unicodedata
from collections import deque
from pathlib import Path

import numpy as np

_BLOCK = 256


def build_charsmap(rules: dict[bytes, bytes]) -> bytes:
    """The precompiled charsmap that replaces each key (non-empty, no NUL byte) by its
    value, the longest key winning."""
    strings = bytearray()
    offset_of: dict[bytes, int] = {}
    trie: dict = {}  # byte -> child; None -> the replacement's offset
    for key in sorted(rules):
        if not key or 0 in key:
            raise ValueError(f"charsmap key {key!r}: empty or with a NUL byte")
        value = rules[key]
        if value not in offset_of:
            offset_of[value] = len(strings)
            strings += value + b"\0"
        node = trie
        for c in key:
            node = node.setdefault(c, {})
        node[None] = offset_of[value]

    units = [0]                 # units[0] is the root's
    used = bytearray(b"\1")      # positions taken
    search_from = 1

    def take(p: int) -> None:
        while p >= len(used):
            used.extend(b"\0" * _BLOCK)
            units.extend([0] * _BLOCK)
        used[p] = 1

    def free(p: int) -> bool:
        return p >= len(used) or not used[p]

    def encode_base(unit: int, base: int) -> int:
        if base < 1 << 21:
            return unit | base << 10
        assert base & 0xFF == 0 and base >> 8 < 1 << 21, "double array too large"
        return unit | (base >> 8) << 10 | 1 << 9

    def place(node: dict) -> int:
        """A child base for this node: its children at base ^ label, its leaf (or nothing:
        a base is never shared) at base itself."""
        nonlocal search_from
        need = [0] + [c for c in node if c is not None]
        while not free(search_from):
            search_from += 1
        p = search_from  # first fit: the first free position for the node's last label
        while not (free(p) and all(free(p ^ need[-1] ^ c) for c in need)):
            p += 1
        base = p ^ need[-1]
        for c in need:
            take(base ^ c)
        return base

    queue = deque([(0, trie)])  # (position of the node's unit, node)
    while queue:
        pos, node = queue.popleft()
        base = place(node)
        units[pos] = encode_base(units[pos], pos ^ base)
        if None in node:
            units[base] = (1 << 31) | node[None]
        for c in sorted(k for k in node if k is not None):
            child = node[c]
            units[base ^ c] = c | (1 << 8 if None in child else 0)
            if any(k is not None for k in child) or None in child:
                queue.append((base ^ c, child))
    while len(units) % _BLOCK:
        units.append(0)
    array = np.array(units, "<u4").tobytes()
    return len(array).to_bytes(4, "little") + array + bytes(strings)


def nfkc_rules(extra: bool = True) -> dict[bytes, bytes]:
    """NFKC of every code point of the BMP it changes, and as SentencePiece's nmt_nfkc adds:
    tabs and line breaks to a space, other C0 controls and zero-width characters removed;
    with `extra`, some letter + combining mark pairs composed (keys of two characters)."""
    rules: dict[bytes, bytes] = {}
    for cp in range(0x80, 0x10000):
        if 0xD800 <= cp < 0xE000:
            continue
        ch = chr(cp)
        norm = unicodedata.normalize("NFKC", ch)
        if norm != ch and "\0" not in norm:
            rules[ch.encode()] = norm.encode()
    for cp in list(range(1, 0x20)) + [0x7F]:
        rules[chr(cp).encode()] = b" " if chr(cp) in "\t\n\r\x0b\x0c" else b""
    for ch in "\u200b\u200c\u200d\u2060\ufeff":
        rules[ch.encode()] = b""
    if extra:
        for base in "aeiounyAEIOUc":
            for mark in "\u0300\u0301\u0302\u0308\u0327":
                pair = base + mark
                composed = unicodedata.normalize("NFKC", pair)
                if len(composed) == 1:
                    rules[pair.encode()] = composed.encode()
    return rules


_WORDS = ("the of and to in is you that it was for on are as with they at be this have from "
          "or one had by word but not what all were we when your can said there use each which "
          "hello world code search query document rank café naïve Zürich straße über résumé "
          "日本 日本語 中文 한국어 русский мир ελληνικά fi ffi ... 1/2").split()


def ugm_vocab(*, charsmap: bool = True, add_space_prefix: bool = True, remove_extra_whitespaces: bool = True,
              user_defined: bool = True, seed: int = 0) -> dict:
    """A small vocabulary in XLM-R's layout as llama.cpp's converter writes it: <s> <pad> </s>
    <unk>, then pieces with log-probability scores (on a coarse grid, so many paths tie), a
    few unused pieces (score -10000: [PADn], "Ψ") and <mask>. Characters and word pieces with
    and without the U+2581 word mark; "<sep2>", "<ud>" and "TM" are user-defined tokens with
    `user_defined`. BOS, EOS and SEP added as XLM-R's RobertaProcessing has them."""
    rng = np.random.default_rng(seed)
    tokens = ["<s>", "<pad>", "</s>", "<unk>"]
    types = [3, 3, 3, 2]
    scores = [0.0, 0.0, 0.0, 0.0]
    pieces: list[str] = ["\u2581"]
    chars = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-()/:;\"")
             + list("éüößèàçñ日本語中文한국어русскиймирελληνικά"))
    for c in chars:
        pieces += [c, "\u2581" + c]
    for w in _WORDS:
        pieces += ["\u2581" + w, w]
        if len(w) > 3:
            pieces += ["\u2581" + w[:2], w[:3], w[2:], w[-2:]]
    pieces += ["\u2581\u2581", "\u2581\u2581\u2581", "\u2581\u2581\u2581\u2581"]
    seen = set(tokens)
    for p in pieces:
        if p in seen:
            continue
        seen.add(p)
        tokens.append(p)
        types.append(1)
        # longer pieces likelier per character; a 0.5 grid makes ties common
        scores.append(round((-2.0 - 6.0 * rng.random() - 1.0 / len(p)) * 2) / 2)
    fixed = {"\u2581": -3.0, "\u2581x": -4.0, "x": -4.0, "\u2581z": -4.0, "z": -4.0}  # (for "xΩ", "zΩ" below)
    for k, text in enumerate(tokens):
        scores[k] = fixed.get(text, scores[k])
    # "Ω" alone is unknown: "▁x" + UNK (lowest normal score - 10) loses to "▁" + "xΩ" (lowest
    # - 6, unused so not the lowest itself); an UNK penalty under 5 would turn that round
    tokens.append("x\u03a9")
    types.append(5)
    scores.append(min(sc for sc, t in zip(scores, types) if t == 1) - 6.0)
    # and "▁z" + UNK (lowest - 14) wins over "▁" + "zΩ" (lowest - 17): a penalty over 13 loses
    tokens.append("z\u03a9")
    types.append(5)
    scores.append(scores[-1] - 11.0)
    if user_defined:  # "TM" only comes from normalizing "™": the Viterbi scores it 0, not -20
        for ud in ("<sep2>", "<ud>", "TM"):
            tokens.append(ud)
            types.append(4)
            scores.append(-20.0)
    for i in range(3):
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
        scores.append(-10000.0)
    tokens.append("\u03a8")  # an unused piece still covers its character: no UNK for "Ψ"
    types.append(5)
    scores.append(-10000.0)
    tokens.append("<mask>")
    types.append(3)
    scores.append(0.0)
    blob = build_charsmap(nfkc_rules()) if charsmap else None

    def write(w) -> None:
        w.add_tokenizer_model("t5")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_add_space_prefix(add_space_prefix)
        w.add_remove_extra_whitespaces(remove_extra_whitespaces)
        if blob is not None:
            w.add_precompiled_charsmap(blob)
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
        w.add_unk_token_id(3)
        w.add_sep_token_id(2)
        w.add_pad_token_id(1)
        w.add_mask_token_id(len(tokens) - 1)
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)
        w.add_add_sep_token(True)

    return {"tokens": tokens, "types": types, "scores": scores, "charsmap": blob, "write": write}


def write_ugm_encoder(path: str | Path, vocab: dict | None = None, **kw) -> Path:
    """A tiny random-weight `bert` encoder with a unigram vocabulary (`write_tiny_encoder`'s
    keywords: `pooling=4, classifier=True` for a bge-reranker-v2-m3-shaped cross-encoder)."""
    from gguf_factory_embed import write_tiny_encoder

    return write_tiny_encoder(path, "bert", vocab=vocab or ugm_vocab(), **kw)
