"""Write a Gemma-4-E4B-shaped Q4_K_M GGUF with random weights, for speed comparisons.

    python benchmarks/make_gemma4_shaped.py OUT.gguf [--tmp-dir DIR]

Shape (the text model of google/gemma-4-E4B's published config.json, as llama.cpp's
convert_hf_to_gguf.py writes it into `gemma4.*` keys; written from memory of that config,
not read from the file here: check it against config.json before quoting numbers): 42
layers, hidden_size 2560, intermediate_size 10240, 8 attention heads and 2 KV heads;
sliding layers of head_dim 256 (window 512, rope_theta 10k), every 6th layer global with
global_head_dim 512 (rope_theta 1e6, proportional RoPE); the last 18 layers reuse the K/V of
layers 22 (sliding) and 23 (global); per-layer embeddings of 256 a layer; final logit
soft-capping 30; a 262144-token vocabulary, tied embeddings. Random F16 weights quantized to
Q4_K_M by llama.cpp itself (shaped_model.py). `--layers N` is not offered: the shared K/V
layers need the whole stack.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_model import ROOT, write_shaped_q4_k_m  # noqa: E402,F401  (ROOT: tests/ on sys.path)

from gguf_factory import TinyShape  # noqa: E402

VOCAB = 262144
E4B = TinyShape(n_embd=2560, n_layer=42, n_head=8, n_head_kv=2, head_dim=512, n_ff=10240, n_ctx=131072,
                head_dim_swa=256, shared_kv_layers=18, n_embd_per_layer=256, softcap=30.0, global_v_is_k=False,
                extra={"sliding_window": 512, "swa_period": 6})

if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="gemma4-e4b-q4_k_m.gguf", help="where to write the Q4_K_M file")
    ap.add_argument("--tmp-dir", default=None, help="where the temporary F16 file goes (default: the system's)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp quantizer threads")
    args = ap.parse_args()
    print(write_shaped_q4_k_m(args.out, E4B, tie_embeddings=True, tmp_dir=args.tmp_dir, threads=args.threads,
                              arch="gemma4", n_vocab=VOCAB))
