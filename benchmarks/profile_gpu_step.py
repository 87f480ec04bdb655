"""Where one decoded token's GPU time goes: each kernel of the step timed with CUDA events.

    python benchmarks/profile_gpu_step.py MODEL.gguf [-ngl 99] [-n 16] [--prompt 32]

Loads the model with `-ngl` layers in VRAM, prefills `--prompt` random tokens, then decodes
`-n` tokens eagerly (EDGEINFER_CUDA_GRAPHS=0: a graph's kernels cannot be timed one by one)
with a CUDA event pair around every launch. Prints, per kernel, microseconds a token (the
median over the tokens), its share, and launches a token; then the whole step's wall time
eagerly and with the step as one CUDA graph, which is what the launch overhead costs.
Needs a GPU: the emulator has no events (and its times would say nothing).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-ngl", "--gpu-layers", default="99")
    ap.add_argument("-n", type=int, default=16, help="decoded tokens profiled")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens before them")
    args = ap.parse_args()

    import numpy as np

    from edgeinfer.engine import Engine, EngineOptions
    from edgeinfer.kernels_cuda import launch, runtime
    from edgeinfer.loader import open_model

    ok, why = runtime.cuda_available()
    if not ok or runtime.emulating():
        print(f"profile_gpu_step needs a GPU: {why if not ok else 'the emulator has no CUDA events'}")
        return 1
    import pycuda.driver as drv

    mf = open_model(args.model)
    engine = Engine(mf, EngineOptions(n_ctx=args.prompt + 2 * args.n + 8, gpu_layers=args.gpu_layers))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, mf.config.n_vocab, args.prompt + 2 * args.n + 2)

    def decode_all(kv, start: int) -> float:
        t0 = time.perf_counter()
        for i in range(args.n):
            engine.decode(int(tokens[start + i]), kv)
        return (time.perf_counter() - t0) / args.n

    per_token: list[dict[str, float]] = []
    counts: list[dict[str, int]] = []
    real_run = launch._run

    def timed(source, name, grid, block, *a):
        start, end = drv.Event(), drv.Event()
        start.record()
        real_run(source, name, grid, block, *a)
        end.record()
        pending.append((name, start, end))

    os.environ["EDGEINFER_CUDA_GRAPHS"] = "0"
    kv = engine.new_cache()
    engine.prefill(tokens[:args.prompt], kv)
    eager_s = decode_all(kv, args.prompt)  # warm, untimed per kernel
    launch._run = timed
    try:
        for i in range(args.n):
            pending: list = []
            engine.decode(int(tokens[args.prompt + args.n + i]), kv)
            drv.Context.synchronize()
            step: dict[str, float] = defaultdict(float)
            n_of: dict[str, int] = defaultdict(int)
            for name, start, end in pending:
                step[name] += end.time_since(start) * 1000.0  # us
                n_of[name] += 1
            per_token.append(step)
            counts.append(n_of)
    finally:
        launch._run = real_run

    os.environ["EDGEINFER_CUDA_GRAPHS"] = "1"
    kv = engine.new_cache()
    engine.prefill(tokens[:args.prompt], kv)
    graph_s = decode_all(kv, args.prompt)

    names = sorted({k for step in per_token for k in step}, key=lambda k: -statistics.median(s.get(k, 0.0) for s in per_token))
    total = statistics.median(sum(s.values()) for s in per_token)
    print(f"{mf.gguf.path.name}: -ngl {args.gpu_layers}, {runtime.cuda_available()[1]}")
    print(f"{'kernel':36} {'us/token':>9} {'share':>6} {'launches':>8}")
    for name in names:
        us = statistics.median(s.get(name, 0.0) for s in per_token)
        print(f"{name:36} {us:9.1f} {us / total:6.1%} {statistics.median(c.get(name, 0) for c in counts):8.0f}")
    print(f"{'kernels, sum':36} {total:9.1f}")
    print(f"step wall time: eager {eager_s * 1e3:.3f} ms, one CUDA graph {graph_s * 1e3:.3f} ms "
          f"({eager_s / graph_s:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
