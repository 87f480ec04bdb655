"""Write a Qwen3.5-9B- or 2B-shaped Q4_K_M GGUF with random weights, for speed comparisons.

    python benchmarks/make_qwen35_shaped.py OUT.gguf [--size 9b|2b] [--layers N] [--tmp-dir DIR]

Shapes (the text model of each published config.json; Qwen/Qwen3.5-9B and Qwen/Qwen3.5-2B
on Hugging Face, as llama.cpp's convert_hf_to_gguf.py writes them into `qwen35.*` keys):
- 9B: 32 layers (every 4th full attention: full_attention_interval 4), hidden_size 4096,
  intermediate_size 12288, 16 attention heads and 4 KV heads of head_dim 256, a quarter of
  each head rotated (rope.dimension_count 64, mrope_section [11, 11, 10]), rope_theta 1e7;
  linear attention: 16 key heads and 32 value heads of 128 (ssm.group_count 16,
  ssm.time_step_rank 32, ssm.state_size 128, ssm.inner_size 4096), conv kernel 4; a
  248320-token vocabulary, untied embeddings.
- 2B: 24 layers, hidden_size 2048, intermediate_size 6144, 8 heads and 2 KV heads of 256,
  16 key and 16 value heads of 128 for linear attention, tied embeddings.
(These were read from third-party summaries of the configs, not the config files
themselves: check them against config.json before quoting numbers.) Random F16 weights
quantized to Q4_K_M by llama.cpp itself (shaped_model.py); the conv kernels stay F32 as
llama.cpp's quantizer keeps them. `--layers N` keeps the first N layers of the real shape
(use a multiple of 4 to keep the 3:1 mix).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_model import ROOT, main  # noqa: E402,F401  (ROOT: tests/ on sys.path)

from gguf_factory import TinyShape  # noqa: E402

VOCAB = 248320
SHAPES = {
    "9b": (TinyShape(n_embd=4096, n_layer=32, n_head=16, n_head_kv=4, head_dim=256, n_ff=12288, n_ctx=262144,
                     ssm_k_heads=16, ssm_v_heads=32, ssm_state=128, ssm_conv=4, full_attention_interval=4,
                     rope_dims=64, rope_sections=(11, 11, 10, 0)), False),
    "2b": (TinyShape(n_embd=2048, n_layer=24, n_head=8, n_head_kv=2, head_dim=256, n_ff=6144, n_ctx=262144,
                     ssm_k_heads=16, ssm_v_heads=16, ssm_state=128, ssm_conv=4, full_attention_interval=4,
                     rope_dims=64, rope_sections=(11, 11, 10, 0)), True),
}


def _size_from_argv() -> str:
    """--size 9b|2b, taken off sys.argv before shaped_model's own parser sees it."""
    size = "9b"
    if "--size" in sys.argv:
        i = sys.argv.index("--size")
        size = sys.argv[i + 1].lower() if i + 1 < len(sys.argv) else ""
        del sys.argv[i:i + 2]
    if size not in SHAPES:
        raise SystemExit(f"--size must be one of {', '.join(SHAPES)}")
    return size


if __name__ == "__main__":
    size = _size_from_argv()
    shape, tied = SHAPES[size]
    main(__doc__.split("\n\n")[0], f"qwen35-{size}-q4_k_m.gguf", shape, tie_embeddings=tied, arch="qwen35",
         n_vocab=VOCAB)
