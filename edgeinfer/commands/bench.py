"""`edgeinfer bench NAME -p 512 -n 128 -r 3 [-d DEPTH] [-t N] [-ngl N] [--json]`: llama-bench's pp/tg table."""

from __future__ import annotations

import json

from edgeinfer.commands.arg_types import positive_int
from edgeinfer.commands.model_flags import add_cache_type_options, cache_type_kwargs


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure prompt processing (pp) and generation (tg) tokens/s")
    p.add_argument("name", help="model alias, hf.co/owner/repo[:quant] or path to a .gguf file")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (0 = skip pp)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (0 = skip tg)")
    p.add_argument("-d", "--n-depth", type=int, default=0,
                   help="tokens already in the context before each test (llama-bench's -d)")
    p.add_argument("-r", "--repetitions", type=positive_int, default=3, help="timed runs per test")
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="CPU threads")
    p.add_argument("--backend", choices=("cpu", "reference"), default="cpu")
    p.add_argument("-ngl", "--gpu-layers", default="auto", metavar="N|auto",
                   help="layers on a CUDA GPU, as llama-bench's -ngl (default auto: as many as fit; 0 = CPU only)")
    p.add_argument("--prefill-chunk", type=positive_int, default=512, help="prefill chunk size")
    add_cache_type_options(p)
    p.add_argument("--json", action="store_true", help="print a JSON list like llama-bench -o json")
    p.set_defaults(func=run)


def run(args) -> int:
    from edgeinfer import kernels_cpu
    from edgeinfer.bench import run_bench
    from edgeinfer.engine import Engine, EngineOptions
    from edgeinfer.errors import EdgeInferError
    from edgeinfer.loader import open_model
    from edgeinfer.model_info import describe, human_bytes, human_count
    from edgeinfer.store.registry import resolve

    if args.n_prompt < 0 or args.n_gen < 0 or args.n_depth < 0:
        raise EdgeInferError("-p, -n and -d must be >= 0")
    cache_type_kwargs(args)   # a bad type: one line before the model loads
    mf = open_model(resolve(args.name, download=False))
    n_ctx = args.n_depth + max(args.n_prompt, args.n_gen) + 1
    engine = Engine(mf, EngineOptions(n_ctx=n_ctx, threads=args.threads, backend=args.backend,
                                      prefill_chunk=args.prefill_chunk, gpu_layers=args.gpu_layers,
                                      **cache_type_kwargs(args)))
    threads = args.threads or kernels_cpu.get_threads()
    info = describe(mf)
    model_type = f"{info.architecture} {human_count(info.parameters)} {info.quantization}"
    rows = run_bench(engine, n_prompt=args.n_prompt, n_gen=args.n_gen,
                     repetitions=args.repetitions, n_threads=threads, model_type=model_type,
                     n_depth=args.n_depth)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return 0
    header = ("model", "size", "params", "backend", "threads", "test", "t/s")
    table = [(r.model_type, human_bytes(r.model_size), human_count(r.model_n_params), r.backend,
              str(r.n_threads), r.test, f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}") for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(line(header))
    print("| " + " | ".join("-" * w for w in widths) + " |")
    for row in table:
        print(line(row))
    return 0
