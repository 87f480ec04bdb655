"""Tokenizer throughput: 1 MB of mixed English/code text with the Llama 3 vocabulary.

    python benchmarks/bench_tokenizer.py [--mb 1] [--vocab llama3|qwen25|gemma3]

The text is Python standard-library source (code, comments and English docstrings),
concatenated to the asked size. Target (issue 4): under 1 s per MB on one core for Llama 3.
Prints MB/s and tokens/s for the fast path; --reference also times the plain-Python path.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def mixed_text(n_bytes: int) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for name in ("argparse.py", "inspect.py", "typing.py", "dataclasses.py", "pathlib.py",
                 "subprocess.py", "textwrap.py", "json/decoder.py", "http/client.py",
                 "email/message.py", "logging/__init__.py", "unittest/case.py"):
        text = (stdlib / name).read_text(encoding="utf-8")
        parts.append(text)
        size += len(text.encode())
        if size >= n_bytes:
            break
    text = "".join(parts)
    while len(text.encode()) < n_bytes:
        text += text
    return text.encode()[:n_bytes].decode("utf-8", "ignore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=1.0)
    ap.add_argument("--vocab", default="llama3", choices=["llama3", "qwen25", "gemma3"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reference", action="store_true", help="also time the plain-Python BPE")
    args = ap.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one core: HF tokenizers must not fan out
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import vocab_models

    t0 = time.perf_counter()
    tok = vocab_models.tokenizer(args.vocab)
    print(f"load {args.vocab} tokenizer: {time.perf_counter() - t0:.2f} s")
    text = mixed_text(int(args.mb * 1_000_000))
    n_bytes = len(text.encode())
    times, ids = [], []
    for _ in range(args.repeat):
        if tok._bpe_fast is not None:
            tok._bpe_fast._cache.clear()  # cold: every distinct word merged again
        t = time.perf_counter()
        ids = tok.tokenize(text, add_special=False)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    tok.tokenize(text, add_special=False)
    warm = time.perf_counter() - t
    cold = min(times)
    print(f"{n_bytes / 1e6:.2f} MB -> {len(ids)} tokens: cold {cold:.3f} s "
          f"({n_bytes / 1e6 / cold:.2f} MB/s, {len(ids) / cold / 1e3:.0f} k tokens/s), "
          f"warm word cache {warm:.3f} s")
    if args.reference:
        t = time.perf_counter()
        ref = tok.tokenize_reference(text, add_special=False)
        dt = time.perf_counter() - t
        print(f"reference: {dt:.3f} s, identical ids: {ref == ids}")


if __name__ == "__main__":
    main()
