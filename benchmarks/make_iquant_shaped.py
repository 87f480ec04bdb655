"""Write a Llama-3.2-1B-shaped GGUF whose matrices are one i-quant type, from random blocks.

    python benchmarks/make_iquant_shaped.py IQ2_XXS /tmp/llama1b-iq2_xxs.gguf

llama.cpp's quantizer wants an importance matrix for IQ2_XXS, IQ2_XS and IQ1_S, and takes
minutes for the others on 2 cores; a speed comparison needs neither: every matrix (the
tied embedding too) is written as random valid blocks with sane scales
(tests/gguf_factory.py's random_blocks), norms in F32. Shape: make_llama1b_shaped.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_model import LLAMA3_VOCAB, padded_vocab  # noqa: E402  (puts tests/ on sys.path)

from gguf_factory import write_tiny_model  # noqa: E402
from make_llama1b_shaped import SHAPE  # noqa: E402

IQ_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("qtype", choices=IQ_TYPES)
    ap.add_argument("out")
    a = ap.parse_args()
    write_tiny_model(a.out, "llama", a.qtype, shape=SHAPE, vocab=padded_vocab(LLAMA3_VOCAB), seed=1,
                     tie_embeddings=True)
    print(a.out)


if __name__ == "__main__":
    main()
