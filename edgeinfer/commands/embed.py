"""`edgeinfer embed NAME TEXT...`: one JSON line of embedding per text (stdin lines without TEXT).

    edgeinfer embed nomic-embed-text.gguf "search_query: what is RoPE?"
    cat chunks.txt | edgeinfer embed all-minilm.gguf --dimensions 128
"""

from __future__ import annotations

import json
import sys

from edgeinfer.commands.arg_types import positive_int
from edgeinfer.errors import EdgeInferError


def register(sub) -> None:
    p = sub.add_parser("embed", help="print embedding vectors of texts, one JSON line each")
    p.add_argument("name", help="model alias, hf.co/owner/repo[:quant] or path to a .gguf file")
    p.add_argument("texts", nargs="*", help="texts to embed (default: one per line of stdin)")
    p.add_argument("-c", "--ctx-size", type=positive_int, default=2048, metavar="N",
                   help="longest input in tokens (default 2048)")
    p.add_argument("-t", "--threads", type=positive_int, default=None, metavar="N", help="CPU threads")
    p.add_argument("--backend", choices=("cpu", "reference"), default="cpu", help="compute backend")
    p.add_argument("--truncate", action="store_true", help="cut inputs longer than the context")
    p.add_argument("--dimensions", type=positive_int, default=None, metavar="N",
                   help="keep the first N values (Matryoshka models), normalised after the cut")
    p.add_argument("--no-normalize", action="store_true", help="print the pooled vector as it is")
    p.set_defaults(func=run_embed)


def run_embed(args) -> int:
    import edgeinfer

    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise EdgeInferError("nothing to embed: give TEXT arguments or lines on stdin")
    model = edgeinfer.load(args.name, n_ctx=args.ctx_size, threads=args.threads, backend=args.backend,
                           download=False)
    vectors = model.embed(texts, truncate=args.truncate, dimensions=args.dimensions,
                          normalize=not args.no_normalize)
    for text, vector in zip(texts, vectors):
        sys.stdout.write(json.dumps({"text": text, "embedding": vector}) + "\n")
    return 0
