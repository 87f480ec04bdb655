"""pp/tg tokens/s of edgeinfer and llama.cpp on the same file, same threads, in one run.

    python benchmarks/compare_llamacpp.py gemma3-270m -p 512 -n 128 -r 3 -t 2 [-d 1024]

llama.cpp is llama-cpp-python (==0.3.36, built with -DGGML_NATIVE=ON); it is a benchmark
dependency only. Both sides evaluate random token ids into an empty context, as
llama-bench does (with -d, a context already holding that many tokens, filled untimed),
run once untimed to warm up, and report the median of the repetitions.
The machine is noisy: the two engines alternate per repetition so drift hits both alike.

After a tg test it also prints each engine's effective decode bandwidth (the weight bytes a
decode step reads times tokens/s) against the machine's read bandwidth measured in the
same run: decode is memory-bound, so that share says how close either engine is to the
hardware, and how much room a ratio between the two has.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

COOL_DOWN_S = 1.0


def llama_cpp_runner(path: str, n_ctx: int, threads: int, depth: int, mmap: bool = True):
    import llama_cpp

    model = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                            n_threads_batch=threads, use_mmap=mmap, verbose=False)
    n_vocab = model.n_vocab()

    def at_depth(seed: int) -> None:
        model.reset()
        if depth:
            model.eval(np.random.default_rng(seed + 1000).integers(0, n_vocab, depth).tolist())

    def pp(n: int, seed: int) -> float:
        tokens = np.random.default_rng(seed).integers(0, n_vocab, n).tolist()
        at_depth(seed)
        t0 = time.perf_counter()
        model.eval(tokens)
        return n / (time.perf_counter() - t0)

    def tg(n: int, seed: int) -> float:
        tokens = np.random.default_rng(seed).integers(0, n_vocab, n).tolist()
        at_depth(seed)
        t0 = time.perf_counter()
        for tok in tokens:
            model.eval([tok])
        return n / (time.perf_counter() - t0)

    return pp, tg


def edgeinfer_runner(path: str, n_ctx: int, threads: int, depth: int):
    from edgeinfer.bench import time_generation, time_prompt
    from edgeinfer.engine import Engine, EngineOptions
    from edgeinfer.loader import open_model

    engine = Engine(open_model(path), EngineOptions(n_ctx=n_ctx, threads=threads, prefill_chunk=512,
                                                     gpu_layers=0))
    return ((lambda n, seed: time_prompt(engine, n, seed, depth)),
            (lambda n, seed: time_generation(engine, n, seed, depth)))


def decode_bytes_per_token(path: str) -> int:
    """Bytes of the tensors one decode step reads: all of them but the token embedding,
    which it reads one row of (unless the output matrix is tied to it), and of a mixture of
    experts' 3-D expert tensors only the share of the experts a token uses."""
    from edgeinfer.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    arch = gf.metadata.get("general.architecture")
    used = gf.metadata.get(f"{arch}.expert_used_count", 1)
    skip = {"token_embd.weight"} if "output.weight" in gf.tensors else set()
    return int(sum(info.n_bytes * (used / info.shape[2] if len(info.shape) == 3 else 1)
                   for name, info in gf.tensors.items() if name not in skip))


def print_bandwidth(path: str, tg: dict[str, float], threads: int) -> None:
    import edgeinfer.kernels_cpu as K
    from read_bandwidth import read_bandwidth

    per_token = decode_bytes_per_token(path)
    K.set_threads(threads)
    read = read_bandwidth()
    print(f"decode reads {per_token / 2**20:.1f} MiB a token; read bandwidth {read / 1e9:.1f} GB/s "
          f"(Numba prange sum, {threads} threads, this run)")
    for name, ts in tg.items():
        print(f"  {name}: {per_token * ts / 1e9:.1f} GB/s effective, {per_token * ts / read:.0%} of read")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="model alias or .gguf path")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-d", "--n-depth", type=int, default=0, help="tokens in the context before each test")
    ap.add_argument("--llama-no-mmap", action="store_true",
                    help="llama.cpp reads the weights into its own memory (llama-cli --no-mmap), as edgeinfer "
                         "copies them into huge pages; by default it maps the file")
    args = ap.parse_args()

    from edgeinfer.store.registry import resolve

    path = str(resolve(args.name, download=False))
    n_ctx = args.n_depth + max(args.n_prompt, args.n_gen) + 8
    runners = {"edgeinfer": edgeinfer_runner(path, n_ctx, args.threads, args.n_depth),
               "llama.cpp": llama_cpp_runner(path, n_ctx, args.threads, args.n_depth, not args.llama_no_mmap)}
    results: dict[tuple[str, str], list[float]] = {}
    for test, n, which in (("pp", args.n_prompt, 0), ("tg", args.n_gen, 1)):
        if n <= 0:
            continue
        for name, fns in runners.items():
            fns[which](n, 99)  # warm-up (JIT, page cache)
        for r in range(args.repetitions):
            for name, fns in runners.items():
                # both engines keep worker threads that spin for a while after a run; let
                # the other engine's go idle first, or they steal this one's cores
                time.sleep(COOL_DOWN_S)
                results.setdefault((name, test), []).append(fns[which](n, r))

    mapped = "llama.cpp with --no-mmap" if args.llama_no_mmap else "llama.cpp mapping the file"
    print(f"model {path}, threads {args.threads}, median of {args.repetitions}, {mapped}")
    print(f"| test | edgeinfer t/s | llama.cpp t/s | ratio |")
    print(f"| --- | --- | --- | --- |")
    for test, n in (("pp", args.n_prompt), ("tg", args.n_gen)):
        if n <= 0:
            continue
        ours = statistics.median(results[("edgeinfer", test)])
        theirs = statistics.median(results[("llama.cpp", test)])
        depth = f" @ d{args.n_depth}" if args.n_depth else ""
        print(f"| {test}{n}{depth} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x |")
    for (name, test), samples in results.items():  # the spread shows how noisy the machine was
        print(f"{name} {test}: " + " ".join(f"{v:.1f}" for v in samples))
    if args.n_gen > 0:
        print_bandwidth(path, {name: statistics.median(results[(name, "tg")]) for name in runners},
                        args.threads)


if __name__ == "__main__":
    main()
