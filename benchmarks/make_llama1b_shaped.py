"""Write a Llama-3.2-1B-shaped Q4_K_M GGUF with random weights, for speed comparisons.

    python benchmarks/make_llama1b_shaped.py /tmp/llama1b-q4_k_m.gguf [--tmp-dir DIR]

Shape of Llama 3.2 1B: 16 layers, n_embd 2048, 32 heads (8 KV heads, head size 64),
n_ff 8192, a 128256-token vocabulary, tied embeddings. Random F16 weights quantized to
Q4_K_M by llama.cpp itself (shaped_model.py). Needs llama-cpp-python; about 2.5 GB of
temporary disk.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_model import ROOT, main  # noqa: E402,F401  (ROOT: tests/ on sys.path)

from gguf_factory import TinyShape  # noqa: E402

SHAPE = TinyShape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, head_dim=64, n_ff=8192, n_ctx=4096)

if __name__ == "__main__":
    main(__doc__.split("\n\n")[0], "llama1b-q4_k_m.gguf", SHAPE, tie_embeddings=True)
