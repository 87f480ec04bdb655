"""Decode at depth with each K/V cache type, edgeinfer and llama.cpp alternating, in one run.

    python benchmarks/kv_decode_depth.py /tmp/l1b.gguf -d 4096 -n 32 -r 3 -t 2 --types f16 q8_0 q4_0

Issue #40's target: `bench -d 4096 -n 32` with q8_0 K/V at least edgeinfer's own f16 rate and
1.1x llama.cpp's with the same types. `edgeinfer bench -d` refills the context before every
repetition (as llama-bench does); at 4096 tokens that refill costs far more than the timed
32 tokens, so this script fills each engine's context once per cache type (all of them kept
open) and truncates back to the depth before each repetition (the same 32 tokens decoded
after the same 4096); each repetition runs every (type, engine) in turn, so a noisy machine's
drift hits all of them alike.

llama.cpp is llama-cpp-python (llama_cpp.Llama, n_threads as -t, flash_attn=True, type_k /
type_v as -ctk / -ctv); edgeinfer is Engine with the CPU backend, gpu_layers=0. Reported per
type and engine: the median tokens/s over the repetitions and their min..max. A type written
`f16+fa` is an f16 cache with edgeinfer's `--flash-attn on` (llama.cpp's flash order, as its
side always runs): set beside q8_0, it separates the cost of that order from the blocks'.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

COOL_DOWN_S = 1.0


def edgeinfer_side(path: str, n_ctx: int, threads: int, tk: str, tv: str, context: list[int], flash: str = "auto"):
    from edgeinfer.engine import Engine, EngineOptions
    from edgeinfer.loader import open_model

    engine = Engine(open_model(path), EngineOptions(n_ctx=n_ctx, threads=threads, gpu_layers=0, prefill_chunk=512,
                                                     cache_type_k=tk, cache_type_v=tv, flash_attn=flash))
    kv = engine.new_cache()
    engine.prefill(np.array(context), kv)

    def tg(tokens: list[int]) -> float:
        kv.truncate(len(context))
        t0 = time.perf_counter()
        for tok in tokens:
            engine.decode(int(tok), kv)
        return len(tokens) / (time.perf_counter() - t0)
    return tg


def llama_cpp_side(path: str, n_ctx: int, threads: int, tk: str, tv: str, context: list[int]):
    import llama_cpp

    from edgeinfer.kv.cache_types import GGML_TYPE_ID

    model = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                            n_threads_batch=threads, flash_attn=True, type_k=GGML_TYPE_ID[tk],
                            type_v=GGML_TYPE_ID[tv], verbose=False)
    model.eval(context)

    def tg(tokens: list[int]) -> float:
        model.n_tokens = len(context)   # eval drops the cache from here on
        t0 = time.perf_counter()
        for tok in tokens:
            model.eval([tok])
        return len(tokens) / (time.perf_counter() - t0)
    return tg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help=".gguf path")
    ap.add_argument("-d", "--n-depth", type=int, default=4096)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--types", nargs="+", default=["f16", "q8_0", "q4_0"], help="K/V types (K = V)")
    args = ap.parse_args()

    from edgeinfer.gguf_file import GGUFFile

    n_vocab = len(GGUFFile.open(args.model).metadata["tokenizer.ggml.tokens"])
    context = np.random.default_rng(1000).integers(0, n_vocab, args.n_depth).tolist()
    gen = np.random.default_rng(7).integers(0, n_vocab, args.n_gen).tolist()
    n_ctx = args.n_depth + args.n_gen + 8
    sides = {}
    for t in args.types:   # every context filled once, untimed
        t0 = time.perf_counter()
        base, fa = t.split("+")[0], "on" if t.endswith("+fa") else "auto"
        sides[(t, "edgeinfer")] = edgeinfer_side(args.model, n_ctx, args.threads, base, base, context, fa)
        sides[(t, "llama.cpp")] = llama_cpp_side(args.model, n_ctx, args.threads, base, base, context)
        print(f"# {t}: both contexts filled ({time.perf_counter() - t0:.0f} s)", flush=True)
    for tg in sides.values():
        tg(gen)   # warm-up (JIT, caches)
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in sides}
    for _ in range(args.repetitions):   # each repetition runs every (type, engine) in turn
        for key, tg in sides.items():
            time.sleep(COOL_DOWN_S)
            samples[key].append(tg(gen))
    rows = []
    for (t, name), ts in samples.items():
        rows.append((t, name, statistics.median(ts), min(ts), max(ts)))
        print(f"{t:5} {name:10} tg{args.n_gen} @ d{args.n_depth}: {statistics.median(ts):6.2f} t/s "
              f"(min {min(ts):.2f}, max {max(ts):.2f}; {', '.join(f'{x:.2f}' for x in ts)})", flush=True)
    med = {(t, name): m for t, name, m, _, _ in rows}
    print("\n| K/V | edgeinfer t/s (min..max) | llama.cpp t/s (min..max) | edgeinfer / llama.cpp | "
          "edgeinfer / own f16 |")
    print("|---|---|---|---|---|")
    for t in args.types:
        e = [r for r in rows if r[0] == t and r[1] == "edgeinfer"][0]
        ll = [r for r in rows if r[0] == t and r[1] == "llama.cpp"][0]
        own = f"{e[2] / med[('f16', 'edgeinfer')]:.2f}x" if ("f16", "edgeinfer") in med else "-"
        print(f"| {t} | {e[2]:.2f} ({e[3]:.2f}..{e[4]:.2f}) | {ll[2]:.2f} ({ll[3]:.2f}..{ll[4]:.2f}) | "
              f"{e[2] / ll[2]:.2f}x | {own} |")


if __name__ == "__main__":
    main()
