"""Random-weight GGUFs shaped like real checkpoints, quantized by llama.cpp itself.

Shared by the make_*_shaped.py scripts (Llama 1B / 8B, Qwen3-30B-A3B, gpt-oss-20b): the weights are random,
written as F16 by tests/gguf_factory.py (one tensor in memory at a time), then quantized
by llama-cpp-python's llama_model_quantize, so the type mix is the one users download
(Q4_K_M: Q4_K, with Q6_K for attn_v, half of ffn_down and the output matrix). Needs
llama-cpp-python, and temporary disk for the F16 file (2 bytes a weight).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

LLAMA3_VOCAB = 128256


def padded_vocab(n_vocab: int) -> dict:
    """gguf_factory's small SentencePiece vocabulary, padded with unused tokens to n_vocab."""
    from gguf_factory import spm_vocab

    vocab = spm_vocab()
    extra = n_vocab - len(vocab["tokens"])
    vocab["tokens"] = vocab["tokens"] + [f"<unused_{i}>" for i in range(extra)]
    vocab["types"] = vocab["types"] + [1] * extra
    if "scores" in vocab:
        vocab["scores"] = list(vocab["scores"]) + [-1e4] * extra
    return vocab


def write_shaped_q4_k_m(out: str | Path, shape, *, tie_embeddings: bool, n_vocab: int = LLAMA3_VOCAB,
                        tmp_dir: str | Path | None = None, threads: int = 2, arch: str = "llama",
                        ftype: str = "Q4_K_M") -> Path:
    """Write a GGUF of `arch` and `shape` (a gguf_factory.TinyShape) to `out`, quantized by
    llama.cpp to `ftype` (Q4_K_M, or MXFP4_MOE: experts MXFP4, the other matrices Q8_0)."""
    import llama_cpp
    from gguf_factory import _layer_tensors, write_tiny_model

    out = Path(out)
    per_layer = sum(int(np.prod(dims)) for dims in _layer_tensors(arch, shape, 0).values())
    n_weights = shape.n_layer * per_layer + (1 if tie_embeddings else 2) * n_vocab * shape.n_embd
    if tmp_dir is not None:
        Path(tmp_dir).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(tmp_dir or tempfile.gettempdir()).free
    if free < 2.1 * n_weights:
        raise SystemExit(f"the F16 file needs {2 * n_weights / 1e9:.1f} GB of temporary disk, "
                         f"{tmp_dir or tempfile.gettempdir()} has {free / 1e9:.1f} GB free (--tmp-dir)")
    with tempfile.TemporaryDirectory(dir=tmp_dir) as tmp:
        f16 = Path(tmp) / "shaped-f16.gguf"
        write_tiny_model(f16, arch, "F16", shape=shape, vocab=padded_vocab(n_vocab), seed=1,
                         tie_embeddings=tie_embeddings)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.nthread = threads
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params)
        if rc != 0:
            raise SystemExit(f"llama_model_quantize failed with {rc}")
    return out


def main(description: str, default_out: str, shape, *, tie_embeddings: bool, arch: str = "llama",
         n_vocab: int = LLAMA3_VOCAB, ftype: str = "Q4_K_M") -> None:
    """The command line the make_*_shaped scripts share: an output path, --tmp-dir, --layers."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out", nargs="?", default=default_out, help=f"where to write the {ftype} file")
    ap.add_argument("--tmp-dir", default=None, help="where the temporary F16 file goes (default: the system's)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp quantizer threads")
    ap.add_argument("--layers", type=int, default=None,
                    help=f"keep only the first N of the {shape.n_layer} layers (each keeps the real shape)")
    args = ap.parse_args()
    if args.layers is not None:
        if not 1 <= args.layers <= shape.n_layer:
            raise SystemExit(f"--layers must be from 1 to {shape.n_layer}, got {args.layers}")
        shape = dataclasses.replace(shape, n_layer=args.layers)
    print(write_shaped_q4_k_m(args.out, shape, tie_embeddings=tie_embeddings, tmp_dir=args.tmp_dir,
                              threads=args.threads, arch=arch, n_vocab=n_vocab, ftype=ftype))
