"""Write a Llama-3-8B-shaped Q4_K_M GGUF with random weights, for speed comparisons.

    python benchmarks/make_llama8b_shaped.py /work/models/llama8b-shaped-q4_k_m.gguf --tmp-dir /work/models-tmp

Shape of Llama 3 8B: 32 layers, n_embd 4096, 32 heads (8 KV heads, head size 128),
n_ff 14336, a 128256-token vocabulary, an untied output matrix (output.weight). Random
F16 weights quantized to Q4_K_M by llama.cpp itself (shaped_model.py): a 4.6 GiB file.
Needs llama-cpp-python and about 16 GB of temporary disk for the F16 file (written one
tensor at a time, so a few GB of RAM suffice); on 2 cores it takes several minutes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_model import ROOT, main  # noqa: E402,F401  (ROOT: tests/ on sys.path)

from gguf_factory import TinyShape  # noqa: E402

SHAPE = TinyShape(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, head_dim=128, n_ff=14336, n_ctx=8192)

if __name__ == "__main__":
    main(__doc__.split("\n\n")[0], "llama8b-q4_k_m.gguf", SHAPE, tie_embeddings=False)
