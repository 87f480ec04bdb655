"""The tokenizer of a GGUF model, built from its `tokenizer.ggml.*` metadata alone.

Token for token what llama.cpp's `llama_tokenize` / `llama_detokenize` produce (the
golden tests in `tests/test_tokenizer_golden.py` hold us to that):

- `llama` vocabularies (Gemma, Llama 2, Mistral): SentencePiece-style BPE with scores and
  `<0xXX>` byte fallback (`spm.py`);
- `gpt2` vocabularies (Llama 3, Qwen): byte-level BPE with merges and the pre-tokenizer
  `tokenizer.ggml.pre` names (`bpe.py`);
- `bert` vocabularies: WordPiece (`wpm.py`);
- `t5` vocabularies (T5, XLM-R rerankers such as bge-reranker-v2-m3): unigram SentencePiece
  with the precompiled charsmap's normalization (`ugm.py`).

Special tokens: control and user-defined tokens are cut out of the text first, longest
first (llama.cpp's `tokenizer_st_partition`); user-defined ones always, control ones only
with `parse_special=True`. Text works on bytes throughout: a `str` is UTF-8 encoded with
`surrogatepass`, so lone surrogates reach the tokenizer as llama.cpp would see them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from itertools import repeat
from typing import Any, Mapping

import numpy as np

from edgeinfer.tokenizer.detokenize import StreamDecoder, clean_spaces
from edgeinfer.errors import TokenizerError
from edgeinfer.metadata import meta_bool, meta_float_array, meta_int, meta_int_array, meta_str, meta_str_array
from edgeinfer.tokenizer.bpe import CHAR_TO_BYTE, BPEFast, BPEReference, lenient_text, pre_tokenizer_for
from edgeinfer.tokenizer.spm import SPMSession
from edgeinfer.tokenizer.spm_bpe import SpmBPEFast, SpmBPEReference
from edgeinfer.tokenizer.ugm import Unigram, charsmap_bytes
from edgeinfer.tokenizer.wpm import WordPiece

__all__ = ["Tokenizer", "StreamDecoder", "load_tokenizer", "TokenAttr"]


def _watching(fragments, cancel: threading.Event):
    """The fragments, with `cancel` looked at every 4096 bytes tokenized: a set Event stops
    the work with a TokenizerError."""
    unchecked = 0
    for frag in fragments:
        unchecked += 1 if isinstance(frag, int) else len(frag)
        if unchecked >= 4096:
            unchecked = 0
            if cancel.is_set():
                raise TokenizerError("tokenizing stopped: the request was cancelled")
        yield frag


class TokenAttr:
    """llama.cpp's `llama_token_attr` bits."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


# GGUF token type -> attribute (llama_token_type -> llama_token_attr)
_TYPE_TO_ATTR = {0: TokenAttr.UNDEFINED, 1: TokenAttr.NORMAL, 2: TokenAttr.UNKNOWN,
                 3: TokenAttr.CONTROL, 4: TokenAttr.USER_DEFINED, 5: TokenAttr.UNUSED,
                 6: TokenAttr.BYTE}

_SPECIAL_KEYS = {  # attribute name -> GGUF key suffix(es), later keys override earlier ones
    "bos_id": ("bos_token_id",), "eos_id": ("eos_token_id",), "eot_id": ("eot_token_id",),
    "eom_id": ("eom_token_id",), "unk_id": ("unknown_token_id",),
    "sep_id": ("seperator_token_id",), "pad_id": ("padding_token_id",),
    "mask_id": ("mask_token_id",),
    "fim_pre_id": ("fim_pre_token_id", "prefix_token_id"),
    "fim_suf_id": ("fim_suf_token_id", "suffix_token_id"),
    "fim_mid_id": ("fim_mid_token_id", "middle_token_id"),
    "fim_pad_id": ("fim_pad_token_id",), "fim_rep_id": ("fim_rep_token_id",),
    "fim_sep_id": ("fim_sep_token_id",),
}

# Texts llama.cpp recognizes when the file does not name the token (llama-vocab.cpp).
_AUTO_DETECT = {
    "eot_id": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
               "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
               "<end_of_utterance>"),
    "eom_id": ("<|eom_id|>",),
    "fim_pre_id": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                   "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf_id": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                   "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid_id": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                   "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep_id": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
_SPACE = " ".encode()
_ESCAPED_SPACE = "\u2581".encode()


class _FragmentCache:
    """Token ids of recently seen long text fragments.

    A chat client resends the whole conversation each turn, and the template puts special
    tokens between messages, which cut the text into per-message fragments that are
    tokenized independently (llama.cpp's tokenizer_st_partition). Re-tokenizing 3000 tokens
    of unchanged history took ~60 ms a turn in pure Python; with this only the new
    message is tokenized. Exact by construction: a fragment's ids depend on its bytes only.
    """

    MIN_BYTES = 64        # shorter fragments are cheaper to tokenize than to hash and keep
    MAX_ENTRIES = 1024

    def __init__(self) -> None:
        self._ids: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, frag: bytes) -> tuple[int, ...] | None:
        if len(frag) < self.MIN_BYTES:
            return None
        with self._lock:
            ids = self._ids.get(frag)
            if ids is not None:
                self._ids.move_to_end(frag)
            return ids

    def put(self, frag: bytes, ids: list[int]) -> None:
        if len(frag) < self.MIN_BYTES:
            return
        with self._lock:
            self._ids[frag] = tuple(ids)
            if len(self._ids) > self.MAX_ENTRIES:
                self._ids.popitem(last=False)


class Tokenizer:
    """Text <-> token ids for one vocabulary. Build with `from_metadata` or `load_tokenizer`."""

    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    sep_id: int | None
    pad_id: int | None
    mask_id: int | None
    fim_pre_id: int | None
    fim_suf_id: int | None
    fim_mid_id: int | None
    fim_pad_id: int | None
    fim_rep_id: int | None
    fim_sep_id: int | None

    def __init__(self, model: str, tokens: list[str], types: list[int] | None,
                 scores: list[float] | None, merges: list[str] | None, pre: str,
                 meta: Mapping[str, Any]) -> None:
        self.model = model
        self.pre = pre
        self._fragments = _FragmentCache()
        n = len(tokens)
        if n == 0:
            raise TokenizerError("tokenizer.ggml.tokens is empty")
        # token text as bytes, as llama.cpp keeps it (the GGUF parser has already replaced
        # invalid UTF-8 with U+FFFD, so this is plain UTF-8)
        # (per-token work below runs in C where it can: a vocabulary has up to 262k tokens)
        texts = list(map(str.encode, tokens, repeat("utf-8", n), repeat("surrogateescape", n)))
        if not all(texts):
            texts = [t if t else f"[EMPTY_{i}]".encode() for i, t in enumerate(texts)]
        self._texts = texts
        # last one wins, as llama.cpp's token_to_id
        self._id_of: dict[bytes, int] = dict(zip(texts, range(n)))
        if types is not None and len(types) < n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        if scores is not None and len(scores) < n:
            raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
        self._attrs = (list(map(_TYPE_TO_ATTR.get, map(int, types[:n]), repeat(TokenAttr.UNDEFINED, n)))
                       if types is not None else [TokenAttr.NORMAL] * n)
        self._scores = list(map(float, scores[:n])) if scores is not None else [0.0] * n

        def flag(key: str, default: bool) -> bool:
            return meta_bool(meta, f"tokenizer.ggml.{key}", default)

        self._escaped_spaces = model in ("llama", "bert", "t5")  # U+2581 for spaces, not GPT-2's byte characters
        spm_style = False  # SentencePiece-style BPE (Gemma 4's pre-tokenizer)
        if model == "llama":
            self.add_bos, self.add_eos = True, False
            self.add_space_prefix = flag("add_space_prefix", True)
            self.clean_spaces = False
            defaults = {"bos_id": 1, "eos_id": 2, "unk_id": 0}
            self._spm = SPMSession(self._id_of, self._scores, n)
            self._bpe_ref = self._bpe_fast = None
        elif model in ("gpt2", "gemma4"):
            # "gemma4" is SentencePiece-style BPE (edgeinfer.tokenizer.spm_bpe); llama.cpp takes
            # that pre-tokenizer for it whatever tokenizer.ggml.pre says
            spec = pre_tokenizer_for("gemma4" if model == "gemma4" else pre)
            self.add_bos = bool(spec.add_bos) if spec.add_bos is not None else False
            self.add_eos = False
            self.add_space_prefix = flag("add_space_prefix", False)
            self.clean_spaces = spec.clean_spaces
            defaults = {"bos_id": 11, "eos_id": 11} if model == "gpt2" else {}
            if merges is None:
                raise TokenizerError(f"{model} tokenizer without tokenizer.ggml.merges")
            self._spm = None
            spm_style = spec.split == "gemma4"
            self._escaped_spaces = spm_style
            self._bpe_ref = (SpmBPEReference if spm_style else BPEReference)(self._id_of, list(merges), spec)
            try:
                self._bpe_fast = (SpmBPEFast if spm_style else BPEFast)(list(tokens), list(merges), spec)
            except Exception:  # noqa: BLE001 - a vocabulary HF rejects still works, slower
                self._bpe_fast = None
        elif model == "bert":  # WordPiece: [CLS] text [SEP]
            self.add_bos, self.add_eos = True, False
            self.add_space_prefix, self.clean_spaces = False, False
            defaults = {"bos_id": 101, "unk_id": 100, "sep_id": 102, "pad_id": 0, "mask_id": 103}
            self._spm = self._bpe_ref = self._bpe_fast = None
        elif model == "t5":  # unigram SentencePiece (T5, XLM-R): text </s>
            self.add_bos, self.add_eos = False, True
            self.add_space_prefix, self.clean_spaces = flag("add_space_prefix", False), False
            defaults = {"eos_id": 1, "unk_id": 2, "pad_id": 0}
            self._spm = self._bpe_ref = self._bpe_fast = None
            # built before the special-token fix-ups below change attributes, as llama.cpp's tries
            self._ugm = Unigram(texts, self._scores, list(self._attrs),
                                charsmap_bytes(meta.get("tokenizer.ggml.precompiled_charsmap")),
                                self.add_space_prefix, flag("remove_extra_whitespaces", False))
        else:
            raise TokenizerError(f"unsupported tokenizer model tokenizer.ggml.model={model!r} "
                                 f"(edgeinfer supports 'llama', 'gpt2', 'gemma4', 'bert' and 't5')")
        if model != "t5":
            self._ugm = None
        # llama-server's rerank pairs put SEP between query and document where this is set
        self.add_sep = flag("add_sep_token", model == "bert")
        # llama.cpp forces BOS on for Gemma 4's pre-tokenizer whatever add_bos_token says
        self.add_bos = True if spm_style else flag("add_bos_token", self.add_bos)
        self.add_eos = flag("add_eos_token", self.add_eos)
        self._init_special_ids(defaults, meta)
        self._wpm = WordPiece(self._id_of, self.unk_id) if model == "bert" else None
        self._init_eog()
        if self._ugm is not None:
            self._ugm.finish(self._attrs, self.unk_id)
        special_mask = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN
        self._special_order = sorted(  # stable: equal lengths stay in id order
            np.flatnonzero(np.array(self._attrs, dtype=np.int64) & special_mask).tolist(),
            key=lambda i: -len(texts[i]))
        # first 4 bytes of each special token of 4+ bytes, as little-endian uint32, in
        # _special_order: _partition skips the tokens whose prefix is not in the text
        long4 = [i for i in self._special_order if len(texts[i]) >= 4]
        self._special_prefix = (np.frombuffer(b"".join(texts[i][:4] for i in long4), "<u4")
                                if long4 else np.zeros(0, "<u4"))
        self._special_prefix_rank = {tid: k for k, tid in enumerate(long4)}
        self._pieces: dict[int, bytes] = {}  # token_to_piece(special=True), filled on demand

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata (key -> value, as `GGUFFile.metadata`)."""
        model = meta_str(meta, "tokenizer.ggml.model", None)
        tokens = meta_str_array(meta, "tokenizer.ggml.tokens", None)
        if model is None or tokens is None:
            raise TokenizerError("the file has no tokenizer (tokenizer.ggml.model/tokens missing)")
        types = meta_int_array(meta, "tokenizer.ggml.token_type", -(1 << 31), (1 << 32) - 1, None)
        scores = meta_float_array(meta, "tokenizer.ggml.scores", None)
        return cls(model, tokens,
                   None if types is None else types.tolist(),
                   None if scores is None else scores.tolist(),
                   meta_str_array(meta, "tokenizer.ggml.merges", None),
                   meta_str(meta, "tokenizer.ggml.pre", None) or "",
                   meta)

    def _init_special_ids(self, defaults: dict[str, int], meta: Mapping[str, Any]) -> None:
        n = self.vocab_size
        for name, keys in _SPECIAL_KEYS.items():
            tid = defaults.get(name)
            if tid is not None and tid >= n:
                tid = None
            for key in keys:
                value = meta_int(meta, f"tokenizer.ggml.{key}", -(1 << 63), 1 << 64, None)
                if value is not None and 0 <= value < n:  # out-of-range ids are ignored, as llama.cpp does
                    tid = value
            setattr(self, name, tid)
        # llama.cpp walks a hash map here, so with 2+ matches its pick is arbitrary; we take
        # the first text in its list (<|eot_id|> before <|end_of_text|>, <|im_end|> first)
        for name, candidates in _AUTO_DETECT.items():
            if getattr(self, name) is not None:
                continue
            for cand in candidates:
                tid = self._id_of.get(cand.encode())
                if tid is not None:
                    setattr(self, name, tid)
                    self._attrs[tid] |= TokenAttr.CONTROL
                    break
        attrs = np.array(self._attrs, dtype=np.int64)
        for tid in np.flatnonzero(attrs & TokenAttr.CONTROL).tolist():  # control tokens named "unused..."
            if b"unused" in self._texts[tid]:
                self._attrs[tid] |= TokenAttr.UNUSED

    def _init_eog(self) -> None:
        eog = {t for t in (self.fim_pad_id, self.fim_rep_id, self.fim_sep_id) if t is not None}
        # the token each of these texts maps to (the last of duplicates, as token_to_id)
        for s in _EOG_TEXTS:
            tid = self._id_of.get(s.encode())
            if tid is not None:
                eog.add(tid)
                self._attrs[tid] |= TokenAttr.CONTROL
        for s in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss
            tid = self._id_of.get(s.encode())
            if tid is not None:
                self._attrs[tid] = TokenAttr.USER_DEFINED
        eog |= {t for t in (self.eos_id, self.eot_id, self.eom_id) if t is not None}
        # llama.cpp walks its std::set: of two EOG ids with one text, the higher one counts
        texts = {self._texts[t]: t for t in sorted(eog)}
        # o200k_harmony (gpt-oss) ends a message with <|end|> but a turn with <|return|> or
        # <|call|>, solar-open with <|calls|>/<|flush|>: then <|end|> is not EOG. llama.cpp
        # counts <|calls|> as <|call|> in both checks
        has_call = b"<|call|>" in texts or b"<|calls|>" in texts
        if b"<|end|>" in texts and has_call and (b"<|return|>" in texts or b"<|flush|>" in texts):
            eog.discard(texts[b"<|end|>"])
            self._attrs[texts[b"<|end|>"]] = TokenAttr.USER_DEFINED
        if b"</s>" in texts and (b"<|tool_response>" in texts or b"<|plamo:eos|>" in texts):
            eog.discard(texts[b"</s>"])
            self._attrs[texts[b"</s>"]] = TokenAttr.NORMAL
        self.eog_ids: frozenset[int] = frozenset(eog)

    # -- queries --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    def token_text(self, token_id: int) -> str:
        """The token as stored in the vocabulary (byte-level / U+2581 form)."""
        return self._texts[self._check(token_id)].decode("utf-8", "surrogateescape")

    def token_attr(self, token_id: int) -> int:
        return self._attrs[self._check(token_id)]

    def is_control(self, token_id: int) -> bool:
        return bool(self.token_attr(token_id) & (TokenAttr.CONTROL | TokenAttr.UNKNOWN))

    def is_eog(self, token_id: int) -> bool:
        """End of generation: EOS, EOT, EOM and the turn-end tokens llama.cpp knows."""
        return token_id in self.eog_ids

    def token_id(self, text: str) -> int | None:
        """Id of the token whose vocabulary text is exactly `text`, or None."""
        return self._id_of.get(text.encode("utf-8", "surrogateescape"))

    def _check(self, token_id: int) -> int:
        if not isinstance(token_id, int) or not 0 <= token_id < len(self._texts):
            raise TokenizerError(f"token id {token_id!r} is out of range 0..{len(self._texts) - 1}")
        return token_id

    # -- text -> ids ----------------------------------------------------------------------

    def tokenize(self, text: str | bytes, add_special: bool = True,
                 parse_special: bool = False, cancel: threading.Event | None = None) -> list[int]:
        """llama_tokenize(text, add_special, parse_special).

        With `cancel`, a set Event stops the work (checked every few thousand bytes) with a
        TokenizerError: a long prompt of a cancelled request does not hold the worker."""
        return self.tokenize_parts([(text, parse_special)], add_special, cancel)

    def tokenize_parts(self, parts: list[tuple[str | bytes, bool]], add_special: bool = True,
                       cancel: threading.Event | None = None) -> list[int]:
        """`tokenize` of the parts' concatenation, special tokens parsed only in the parts
        whose flag is True (a chat prompt: the template's markup, not the messages' text).
        Text on both sides of a part boundary is tokenized as one piece."""
        if cancel is not None and cancel.is_set():
            raise TokenizerError("tokenizing stopped: the request was cancelled")
        fragments: list[bytes | int] = []
        for text, parse_special in parts:
            data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
            for frag in self._partition(data, parse_special) if data else []:
                if isinstance(frag, bytes) and fragments and isinstance(fragments[-1], bytes):
                    fragments[-1] += frag
                else:
                    fragments.append(frag)
        if cancel is not None:
            fragments = _watching(fragments, cancel)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self._need(self.bos_id, "BOS"))

        if self._ugm is not None:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    continue
                ids = self._fragments.get(frag)
                if ids is None:
                    start = len(out)
                    self._ugm.encode(frag, out)
                    self._fragments.put(frag, out[start:])
                else:
                    out += ids
        elif self._wpm is not None:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    self._wpm.encode(frag, out)
            if add_special and self.add_sep:
                out.append(self._need(self.sep_id, "SEP"))
        elif self._spm is not None:
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = _SPACE + frag
                frag = frag.replace(_SPACE, _ESCAPED_SPACE)
                ids = self._fragments.get(frag)
                if ids is None:
                    start = len(out)
                    self._spm.encode(frag, out)
                    self._fragments.put(frag, out[start:])
                else:
                    out += ids
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    continue
                ids = self._fragments.get(frag) if self._bpe_fast is not None else None
                if ids is None:
                    ids = self._bpe(frag)
                    if self._bpe_fast is not None:  # the reference path is for checking: never cached
                        self._fragments.put(frag, ids)
                out += ids
        if add_special and self.add_eos:
            out.append(self._need(self.eos_id, "EOS"))
        return out

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenize(text, add_special, parse_special)

    def _need(self, tid: int | None, what: str) -> int:
        if tid is None:
            raise TokenizerError(f"the vocabulary asks for a {what} token but has none")
        return tid

    def _bpe(self, data: bytes, reference: bool = False) -> list[int]:
        if self._bpe_fast is not None and not reference:
            try:
                text: str | None = data.decode("utf-8")
            except UnicodeDecodeError:
                # llama.cpp splits and merges the lenient decoding (bad byte -> U+FFFD), so
                # the fast path can too; surrogates (no UTF-8 in Python) take the reference
                text = lenient_text(data)
            if text is not None:
                return self._bpe_fast.encode(text)
        return self._bpe_ref.encode(data)

    def tokenize_reference(self, text: str | bytes, add_special: bool = True,
                           parse_special: bool = False) -> list[int]:
        """`tokenize` through the plain-Python BPE path only (to check the fast path)."""
        fast, self._bpe_fast = self._bpe_fast, None
        try:
            return self.tokenize(text, add_special, parse_special)
        finally:
            self._bpe_fast = fast

    def control_text_spans(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character spans of `text` that tokenize as control tokens only when
        special tokens are parsed (`<end_of_turn>`, `<|im_start|>`, ...): what a message must
        not smuggle into a chat prompt."""
        data = text.encode("utf-8", "surrogatepass")
        spans, pos = [], 0  # pos: in characters
        skip = TokenAttr.CONTROL | TokenAttr.UNKNOWN
        for frag in self._partition(data, True) if data else []:
            piece = frag if isinstance(frag, bytes) else self._texts[frag]
            size = len(piece.decode("utf-8", "surrogatepass"))
            if isinstance(frag, int) and self._attrs[frag] & skip:
                spans.append((pos, pos + size))
            pos += size
        return spans

    def _partition(self, data: bytes, parse_special: bool) -> list[bytes | int]:
        """llama.cpp's tokenizer_st_partition: cut special tokens out, longest first."""
        fragments: list[bytes | int] = [data]
        skip = TokenAttr.CONTROL | TokenAttr.UNKNOWN
        present = self._special_prefixes_in(data)
        for tid in self._special_order:
            if not parse_special and self._attrs[tid] & skip:
                continue
            rank = self._special_prefix_rank.get(tid)
            if rank is not None and not present[rank]:
                continue
            special = self._texts[tid]
            if special not in data:  # fragments are substrings of data
                continue
            new: list[bytes | int] = []
            for frag in fragments:
                if isinstance(frag, int) or special not in frag:
                    new.append(frag)
                    continue
                for k, part in enumerate(frag.split(special)):
                    if k:
                        new.append(tid)
                    if part:
                        new.append(part)
            fragments = new
        return fragments

    def _special_prefixes_in(self, data: bytes) -> np.ndarray:
        """For each special token of 4+ bytes: may it occur in data (its first 4 bytes do)?

        One vectorized pass over data's 4-byte windows, instead of one substring search
        per special token (Gemma has 6414: 30 ms for a 12 KB conversation)."""
        if len(data) < 4:
            return np.zeros(len(self._special_prefix), bool)
        a = np.frombuffer(data, np.uint8).astype(np.uint32)
        windows = a[:-3] | (a[1:-2] << 8) | (a[2:-1] << 16) | (a[3:] << 24)
        return np.isin(self._special_prefix, windows)

    # -- ids -> text ----------------------------------------------------------------------

    def _piece(self, tid: int) -> bytes:
        """llama.cpp's token_to_piece(special=True), cached for every token."""
        attr, text = self._attrs[tid], self._texts[tid]
        if attr & (TokenAttr.UNKNOWN | TokenAttr.CONTROL | TokenAttr.USER_DEFINED):
            return text
        if attr & TokenAttr.NORMAL:
            if self._escaped_spaces:
                return text.replace(_ESCAPED_SPACE, _SPACE)
            return _decode_byte_level(text)
        if attr & TokenAttr.BYTE:
            return bytes((int(text[3:5], 16),))
        return b""

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes one token stands for; control tokens give b"" unless `special`."""
        self._check(token_id)
        if not special and self._attrs[token_id] & (TokenAttr.UNKNOWN | TokenAttr.CONTROL):
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id)
        return piece

    def detokenize_bytes(self, ids: list[int], skip_special: bool = False,
                         remove_special: bool = False, as_pieces: bool = False) -> bytes:
        """llama_detokenize(ids, remove_special, unparse_special=not skip_special) as bytes.

        `as_pieces`: just the token pieces joined (what llama-server / llama-cli stream):
        no leading-space strip, no clean_up_tokenization_spaces.
        """
        ids = [self._check(i) for i in ids]
        if as_pieces:
            return b"".join(self.token_to_piece(i, not skip_special) for i in ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        special = not skip_special
        parts = [self.token_to_piece(i, special) for i in ids]
        if remove_space and parts and parts[0][:1] == _SPACE:
            parts[0] = parts[0][1:]
        out = b"".join(parts)
        return clean_spaces(out) if self.clean_spaces else out

    def detokenize(self, ids: list[int], skip_special: bool = False,
                   remove_special: bool = False, as_pieces: bool = False) -> str:
        """Token ids to text (invalid UTF-8 becomes U+FFFD); see `detokenize_bytes`."""
        return self.detokenize_bytes(ids, skip_special, remove_special, as_pieces).decode(
            "utf-8", "replace")

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.detokenize(ids, skip_special)

    def stream(self, skip_special: bool = False, as_pieces: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special, as_pieces)


def _decode_byte_level(text: bytes) -> bytes:
    """llama_decode_text: GPT-2 byte-level characters back to bytes."""
    out = bytearray()
    for ch in text.decode("utf-8", "surrogateescape"):
        b = CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:  # llama.cpp writes the unknown character and the whole token text
            utf8 = ch.encode("utf-8", "surrogateescape")
            out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text + b"]"
    return bytes(out)


def load_tokenizer(gguf_file: Any) -> Tokenizer:
    """The tokenizer of an open `GGUFFile` (or anything with a `.metadata` mapping)."""
    return Tokenizer.from_metadata(gguf_file.metadata)
