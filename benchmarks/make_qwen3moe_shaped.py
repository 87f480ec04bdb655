"""Write a Qwen3-30B-A3B-shaped Q4_K_M GGUF with random weights, for speed comparisons.

    python benchmarks/make_qwen3moe_shaped.py /tmp/qwen3moe-q4_k_m.gguf [--layers N] [--tmp-dir DIR]

Shape from Qwen/Qwen3-30B-A3B's config.json: 48 layers, hidden_size 2048, 32 heads and 4 KV
heads of head_dim 128, 128 experts of moe_intermediate_size 768 with 8 used per token,
intermediate_size 6144, a 151936-token vocabulary, untied embeddings. Random F16 weights
quantized to Q4_K_M by llama.cpp itself (shaped_model.py). `--layers N` keeps the first N
layers, each of the real shape, so tokens/s ratios hold: the whole file needs ~35 GB of RAM
and twice that of temporary disk, 4 layers ~6 GB of disk and a 1.7 GB file.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_model import ROOT, main  # noqa: E402,F401  (ROOT: tests/ on sys.path)

from gguf_factory import TinyShape  # noqa: E402

SHAPE = TinyShape(n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128, n_ff=6144, n_ctx=40960,
                  n_expert=128, n_expert_used=8, n_ff_exp=768)

if __name__ == "__main__":
    main(__doc__.split("\n\n")[0], "qwen3moe-q4_k_m.gguf", SHAPE, tie_embeddings=False, arch="qwen3moe",
         n_vocab=151936)
