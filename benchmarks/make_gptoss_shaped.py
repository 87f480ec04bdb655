"""Write a gpt-oss-20b-shaped GGUF (MXFP4 experts) with random weights, for speed comparisons.

    python benchmarks/make_gptoss_shaped.py /tmp/gptoss-mxfp4.gguf [--layers N] [--tmp-dir DIR]

Shape from openai/gpt-oss-20b's config.json: 24 layers, hidden_size 2880, 64 heads and 8 KV
heads of head_dim 64, 32 local experts of intermediate_size 2880 with 4 used per token
(experts_per_token), a 201088-token vocabulary, untied embeddings, sliding_window 128 on
every other layer, rope_theta 150000 with YaRN (factor 32 over original_max_position_embeddings
4096, max_position_embeddings 131072). Random F16 weights quantized by llama.cpp itself as
MXFP4_MOE, the type mix of ggml-org's gpt-oss-20b GGUF: experts MXFP4, the other matrices
Q8_0. `--layers N` keeps the first N layers, each of the real shape, so tokens/s ratios hold:
the whole file is ~12 GB (~42 GB of temporary disk), 4 layers ~3 GB (~9 GB of disk).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_model import ROOT, main  # noqa: E402,F401  (ROOT: tests/ on sys.path)

from gguf_factory import TinyShape  # noqa: E402

SHAPE = TinyShape(n_embd=2880, n_layer=24, n_head=64, n_head_kv=8, head_dim=64, n_ff=2880, n_ctx=131072,
                  n_expert=32, n_expert_used=4, n_ff_exp=2880,
                  extra={"sliding_window": 128, "rope_factor": 32.0, "rope_ctx_orig": 4096})

if __name__ == "__main__":
    main(__doc__.split("\n\n")[0], "gptoss-mxfp4.gguf", SHAPE, tie_embeddings=False, arch="gpt-oss",
         n_vocab=201088, ftype="MXFP4_MOE")
