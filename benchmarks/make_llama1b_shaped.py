"""Write a Llama-3.2-1B-shaped Q4_K_M GGUF with random weights, for speed comparisons.

    python benchmarks/make_llama1b_shaped.py /tmp/llama1b-q4_k_m.gguf

Shape of Llama 3.2 1B: 16 layers, n_embd 2048, 32 heads (8 KV heads, head size 64),
n_ff 8192, a 128256-token vocabulary, tied embeddings. The weights are random (written
as F16 by tests/gguf_factory.py), then quantized to Q4_K_M by llama.cpp itself
(llama-cpp-python's llama_model_quantize), so the type mix is what users download.
Needs llama-cpp-python; about 2.5 GB of temporary disk.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

N_VOCAB = 128256


def main(out: str) -> None:
    import llama_cpp
    from gguf_factory import TinyShape, spm_vocab, write_tiny_model

    vocab = spm_vocab()
    extra = N_VOCAB - len(vocab["tokens"])
    vocab["tokens"] = vocab["tokens"] + [f"<unused_{i}>" for i in range(extra)]
    vocab["types"] = vocab["types"] + [1] * extra
    if "scores" in vocab:
        vocab["scores"] = list(vocab["scores"]) + [-1e4] * extra
    shape = TinyShape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, head_dim=64, n_ff=8192, n_ctx=4096)
    with tempfile.TemporaryDirectory() as tmp:
        f16 = Path(tmp) / "llama1b-f16.gguf"
        write_tiny_model(f16, "llama", "F16", shape=shape, vocab=vocab, seed=1, tie_embeddings=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params)
        if rc != 0:
            raise SystemExit(f"llama_model_quantize failed with {rc}")
    print(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llama1b-q4_k_m.gguf")
