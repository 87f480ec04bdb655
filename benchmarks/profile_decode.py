"""Where one decoded token's time goes on the CPU backend: a per-op profile.

    python benchmarks/profile_decode.py MODEL.gguf [-n 24] [-t 2] [--depth 0] [--prompt 32] [-ctk q8_0 -ctv q8_0]

Wraps the CpuBackend's methods with wall-clock timers, decodes `-n` tokens (after a
warm-up token), and prints, for each op kind, milliseconds a token, its share, and for
the matrix ops the weight bytes they read a token and the GB/s that makes. "python" is
the rest of the step: the forward pass's own numpy and interpreter time. Each matvec is
also attributed to its tensor kind (attn_qkv, attn_output, ffn, output) so a slow matrix
shape shows. Times are medians over the tokens. --prompt N profiles a prefill of N
tokens instead (each of the -n repetitions a fresh one, times per prefill).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _kind(names) -> str:
    name = names[0]
    for key in ("attn_q", "attn_k", "attn_v"):
        if key + "." in name:
            return "attn_qkv"
    for key in ("attn_output", "ffn_gate_inp", "ffn_gate", "ffn_up", "ffn_down", "output.weight", "token_embd"):
        if key in name:
            return "ffn" if key in ("ffn_gate", "ffn_up", "ffn_down") else key.replace(".weight", "")
    return name


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="model alias or .gguf path")
    ap.add_argument("-n", type=int, default=24, help="tokens to decode (timed)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=0, help="tokens in the cache before")
    ap.add_argument("--prompt", type=int, default=0, help="profile prefills of this many tokens instead")
    ap.add_argument("--verify", type=int, default=0,
                    help="profile speculative verifications of this many rows instead (decode's bits, "
                         "logits of every row)")
    ap.add_argument("-ctk", "--cache-type-k", default="f16", help="K cache type (as run's)")
    ap.add_argument("-ctv", "--cache-type-v", default="f16", help="V cache type (as run's)")
    ap.add_argument("--matrices", action="store_true",
                    help="also time each matrix kind alone (per type), cycling through the layers")
    args = ap.parse_args(argv)

    import numpy as np

    from edgeinfer.backends.cpu import CpuBackend
    from edgeinfer.engine import Engine, EngineOptions
    from edgeinfer.loader import open_model

    from edgeinfer.store.registry import resolve

    mf = open_model(str(resolve(args.model, download=False)))
    engine = Engine(mf, EngineOptions(n_ctx=args.depth + max(args.n, args.prompt, args.verify) + 16, threads=args.threads,
                                      gpu_layers=0, prefill_chunk=max(512, args.prompt),
                                      cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v))
    be = engine.backend
    assert isinstance(be, CpuBackend), type(be)
    gf = mf.gguf
    step: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)

    def timed(method, label_of, bytes_of=None):
        orig = getattr(be, method)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                label = label_of(*a)
                step[label] += time.perf_counter() - t0
                if bytes_of is not None:
                    nbytes[label] += bytes_of(*a)
        setattr(be, method, wrapper)

    size = lambda names: sum(gf.tensors[n].n_bytes for n in names)  # noqa: E731
    timed("linear", lambda name, x: _kind([name]), lambda name, x: size([name]))
    timed("linear_many", lambda names, x: _kind(names), lambda names, x: size(names))
    timed("norm_swiglu_residual", lambda *a: "ffn",
          lambda x, norm, eps, gate, up, down: size([gate, up, down]))
    timed("attention", lambda *a: "attention")
    timed("rope", lambda *a: "rope")
    timed("rms_norm", lambda *a: "rms_norm")
    timed("get_rows", lambda *a: "get_rows")
    # mixtures of experts: the chosen experts' rows (one call a layer for gate+up, one for down)
    # and their activation; the router's matvec counts as "ffn_gate_inp"
    expert_bytes = lambda names, active: sum(gf.tensors[n].n_bytes // gf.tensors[n].shape[2] * len(active)  # noqa: E731
                                             for n in names)
    timed("expert_batch", lambda *a: "experts", lambda names, active, *rest: expert_bytes(names, active))
    timed("silu_mul", lambda *a: "activation")
    timed("swiglu_oai", lambda *a: "activation")

    kv = engine.new_cache()
    if args.depth:
        engine.prefill(np.random.default_rng(1).integers(0, engine.config.n_vocab, args.depth), kv)
    tokens = np.random.default_rng(0).integers(0, engine.config.n_vocab, args.n + 2)
    depth = kv.n_used

    def step_once(tok) -> None:
        if args.verify:   # rows of decode's bits and every row's logits, then rolled back
            rows = np.random.default_rng(int(tok)).integers(0, engine.config.n_vocab, args.verify)
            engine.forward(rows, np.arange(depth, depth + args.verify), kv,
                           logits_for=np.arange(args.verify), decode_bits=True)
            kv.truncate(depth)
        elif args.prompt:   # a fresh prefill of --prompt tokens after the depth
            kv.truncate(depth)
            engine.prefill(np.random.default_rng(int(tok)).integers(0, engine.config.n_vocab, args.prompt), kv)
        else:
            engine.decode(int(tok), kv)
    step_once(tokens[0])   # warm-up: compile, page in
    step_once(tokens[1])
    per_token: dict[str, list[float]] = defaultdict(list)
    totals = []
    for tok in tokens[2:]:
        step.clear()
        nbytes.clear()
        t0 = time.perf_counter()
        step_once(tok)
        total = time.perf_counter() - t0
        totals.append(total)
        for k, v in step.items():
            per_token[k].append(v)
        per_token["python"].append(total - sum(step.values()))
    total = statistics.median(totals)
    what = (f"verifications of {args.verify} rows" if args.verify
            else f"prefills of {args.prompt} tokens" if args.prompt else "tokens")
    print(f"{args.model}: {args.threads} threads, median of {args.n} {what}: {total * 1e3:.1f} ms a step "
          f"({(args.prompt or args.verify or 1) / total:.2f} tok/s; spread {min(totals) * 1e3:.1f}-{max(totals) * 1e3:.1f} ms)")
    print(f"{'op':<14}{'ms/step':>10}{'share':>8}{'MiB/token':>11}{'GB/s':>8}")
    rows = sorted(per_token.items(), key=lambda kv: -statistics.median(kv[1]))
    for k, samples in rows:
        ms = statistics.median(samples)
        mib = nbytes.get(k, 0)
        gbs = f"{mib / ms / 1e9:8.1f}" if mib else ""
        print(f"{k:<14}{ms * 1e3:10.2f}{ms / total:8.1%}{(f'{mib / 2**20:11.1f}' if mib else ''):>11}{gbs}")
    weight_bytes = sum(nbytes.values())
    print(f"all matrices: {weight_bytes / 2**20:.1f} MiB a token, {weight_bytes / total / 1e9:.1f} GB/s over the whole step")
    if args.matrices:
        matrices_alone(be, gf, engine.config.n_layer)


def matrices_alone(be, gf, n_layer: int, rounds: int = 5) -> None:
    """Each layer matrix kind and type alone: one matvec per layer, layer after layer (so
    each comes from memory, as in decode), `rounds` times; median GB/s of the rounds."""
    import numpy as np

    from edgeinfer.kernels_cpu.matvec import matvec_prepared, prepare_group

    groups: dict = defaultdict(list)
    for name, info in gf.tensors.items():
        if name.startswith("blk.") and len(info.shape) == 2:
            groups[(name.split(".")[2], info.qtype.name, info.n_rows, info.n_cols)].append(name)
    for name in ("output.weight",):
        if name in gf.tensors:
            info = gf.tensors[name]
            groups[("output", info.qtype.name, info.n_rows, info.n_cols)].append(name)
    print(f"{'matrix alone':<34}{'count':>6}{'GB/s':>8}{'range':>14}")
    for (kind, qt, rows, cols), names in sorted(groups.items()):
        prepared = [prepare_group(*be._weights_of([n])) for n in names]
        x = np.random.default_rng(0).standard_normal(cols).astype(np.float32)
        n_bytes = sum(gf.tensors[n].n_bytes for n in names)
        for p in prepared:   # warm-up: compile, page in
            matvec_prepared(p, x)
        rates = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for p in prepared:
                matvec_prepared(p, x)
            rates.append(n_bytes / (time.perf_counter() - t0) / 1e9)
        rates.sort()
        print(f"{f'{kind} {qt} {rows}x{cols}':<34}{len(names):>6}{statistics.median(rates):8.1f}"
              f"{f'{rates[0]:.1f}-{rates[-1]:.1f}':>14}")


if __name__ == "__main__":
    main()
