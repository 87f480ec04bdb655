"""Write a Gemma-4-26B-A4B-shaped GGUF (its first layers) from random blocks, for decode speed comparisons.

    python benchmarks/make_gemma4_26b_shaped.py OUT.gguf [--layers 8]

Shape (google/gemma-4-26B-A4B's text config as llama.cpp's converter writes it, from memory
of the published config.json: check it before quoting numbers): hidden 2816; 16 attention
heads; sliding layers with 8 K/V heads of 256, every 6th layer global with 2 K/V heads of
512 and no V projection (V = K); a dense MLP of 2112 beside 128 experts of 704, 8 chosen a
token; soft-capped logits; a 262144-token vocabulary, tied embeddings. Types as llama.cpp's
Q4_K_M gives them: Q4_K, with Q6_K for attn_v and the embedding, and Q5_0 for the matrices
whose rows (704, 2112 values) are no multiple of 256, llama.cpp's fallback for Q4_K.
Random valid blocks (tests/gguf_factory.py), so no F16 file and no quantizer run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_model import padded_vocab  # noqa: E402  (puts tests/ on sys.path)

from gguf_factory import TinyShape, write_tiny_model  # noqa: E402

VOCAB = 262144
MIX = {"attn_v.weight": "Q6_K", "token_embd.weight": "Q6_K", "ffn_down_exps.weight": "Q5_0",
       "ffn_down.weight": "Q5_0"}


def shape(n_layer: int) -> TinyShape:
    swa = tuple((i + 1) % 6 != 0 for i in range(n_layer))
    return TinyShape(n_embd=2816, n_layer=n_layer, n_head=16, n_head_kv=8, head_dim=512, head_dim_swa=256,
                     n_ff=2112, n_ctx=262144, n_expert=128, n_expert_used=8, n_ff_exp=704, gemma4_moe=True,
                     swa_pattern=swa, shared_kv_layers=0, n_embd_per_layer=0, softcap=30.0, global_v_is_k=True,
                     n_head_kv_layers=tuple(8 if s else 2 for s in swa), extra={"sliding_window": 1024})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=8, help="of the 30: 8 keep its sliding/global mix")
    a = ap.parse_args()
    print(write_tiny_model(a.out, "gemma4", "Q4_K", shape=shape(a.layers), vocab=padded_vocab(VOCAB), seed=1,
                           tie_embeddings=True, tensor_qtypes=MIX))


if __name__ == "__main__":
    main()
