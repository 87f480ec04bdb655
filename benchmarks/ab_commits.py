"""A/B two versions of edgeinfer in two live processes, alternating round by round.

    python benchmarks/ab_commits.py MODEL --a rev:18a5a00 --b here [-t pp16,tg32] [-r 8]
    python benchmarks/ab_commits.py MODEL --a here --b "env:EDGEINFER_NO_PAIRS=1"
    python benchmarks/ab_commits.py MODEL --a rev:HEAD --b here -t vf4 -r 8

On a shared machine whose speed drifts by tens of percent from hour to hour, two runs of
a benchmark at different times do not compare; two processes that take turns, each
holding its model loaded and its kernels compiled, do. A side is `here` (this checkout),
`rev:REV` (that commit's tree, unpacked to a temporary directory and imported from there
with its own Numba cache: Numba keys its cache by source file, not by commit) or
`env:K=V,K=V` (this checkout with those environment variables; a variable that a compiled
kernel reads as a global needs its own NUMBA_CACHE_DIR in the same spec, for Numba's
cache does not see globals change). A test is ppN (a prompt of N tokens), tgN (N decoded
tokens) or vfN (a speculative verification of N rows: decode's bits, every row's logits,
rows/s over 8 of them after a 32-token prompt). Each round runs every
test on both sides, the order flipping each round; the report gives each side's median
and spread and the median and range of the per-round ratios B/A.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _package_tree(rev: str, into: Path) -> Path:
    """The importable `edgeinfer` package of commit `rev`, laid out as pyproject's
    package-dir maps it, under into/pkg."""
    src = into / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    dirs = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    pkg = into / "pkg"
    for name, path in sorted(dirs.items()):   # "edgeinfer" first, then its mapped subpackages
        shutil.copytree(src / path, pkg / Path(*name.split(".")), dirs_exist_ok=True)
    return pkg


def _side_env(spec: str, tmp: Path) -> dict:
    env = dict(os.environ)
    if spec == "here":
        return env
    if spec.startswith("env:"):
        for kv in filter(None, spec[4:].split(",")):
            key, _, value = kv.partition("=")
            env[key] = value
        return env
    if spec.startswith("rev:"):
        where = Path(tempfile.mkdtemp(prefix="ab_", dir=tmp))
        env["PYTHONPATH"] = str(_package_tree(spec[4:], where))
        env["NUMBA_CACHE_DIR"] = str(where / "numba")
        return env
    raise SystemExit(f"a side is here, rev:REV or env:K=V,...; got {spec!r}")


def _start(model: str, env: dict, n_ctx: int, threads: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", model, str(n_ctx), str(threads)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd=tempfile.gettempdir())
    line = p.stdout.readline().strip()
    if line != "ready":
        raise SystemExit(f"a worker did not start (got {line!r})")
    return p


def _verify_runner(model: str, n_ctx: int, threads: int):
    """vf(n, seed): rows/s of speculative verifications of n rows (decode_bits, every row's
    logits), each rolled back, after a 32-token prompt: the step bench_speculative's drafts pay."""
    import time

    import numpy as np

    from edgeinfer.engine import Engine, EngineOptions
    from edgeinfer.loader import open_model

    engine = Engine(open_model(model), EngineOptions(n_ctx=n_ctx + 32, threads=threads, gpu_layers=0))
    kv = engine.new_cache()
    engine.prefill(np.random.default_rng(0).integers(0, engine.config.n_vocab, 32), kv)
    depth = kv.n_used

    def vf(n: int, seed: int) -> float:
        rng = np.random.default_rng(seed)
        t0 = time.perf_counter()
        for _ in range(8):
            engine.forward(rng.integers(0, engine.config.n_vocab, n), np.arange(depth, depth + n), kv,
                           logits_for=np.arange(n), decode_bits=True)
            kv.truncate(depth)
        return 8 * n / (time.perf_counter() - t0)
    return vf


def _worker(model: str, n_ctx: int, threads: int) -> None:
    """Load the model with whatever edgeinfer this process imports; answer `pp N seed`,
    `tg N seed` and `vf N seed` lines with tokens (rows) a second."""
    sys.path.insert(0, str(HERE))
    from compare_llamacpp import edgeinfer_runner

    pp, tg = edgeinfer_runner(model, n_ctx, threads, 0)
    vf = _verify_runner(model, n_ctx, threads)
    pp(16, 0)   # warm: compile or load the kernels, page the weights in
    tg(4, 0)
    vf(2, 0)
    print("ready", flush=True)
    runners = {"pp": pp, "tg": tg, "vf": vf}
    for line in sys.stdin:
        kind, n, seed = line.split()
        print(runners[kind](int(n), int(seed)), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="model alias or .gguf path")
    ap.add_argument("--a", default="here", help="side A: here, rev:REV or env:K=V,...")
    ap.add_argument("--b", required=True, help="side B: here, rev:REV or env:K=V,...")
    ap.add_argument("-t", "--tests", default="pp16,tg32", help="comma-separated ppN / tgN / vfN")
    ap.add_argument("-r", "--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    tests = [(t[:2], int(t[2:])) for t in args.tests.split(",")]
    if any(kind not in ("pp", "tg", "vf") or n <= 0 for kind, n in tests):
        raise SystemExit(f"tests are ppN, tgN or vfN with N > 0, got {args.tests!r}")
    n_ctx = max(n for _, n in tests) + 64
    sys.path.insert(0, str(ROOT))
    from edgeinfer.store.registry import resolve

    model = str(resolve(args.model, download=False))
    with tempfile.TemporaryDirectory(prefix="ab_commits_") as tmp:
        procs = [_start(model, _side_env(s, Path(tmp)), n_ctx, args.threads) for s in (args.a, args.b)]
        got = {t: ([], []) for t in tests}
        try:
            for r in range(args.rounds):
                for t in tests:
                    for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                        procs[i].stdin.write(f"{t[0]} {t[1]} {r + 1}\n")
                        procs[i].stdin.flush()
                        got[t][i].append(float(procs[i].stdout.readline()))
        finally:
            for p in procs:
                p.stdin.close()
                p.wait()
    print(f"A = {args.a}, B = {args.b}; {args.rounds} rounds, {args.threads} threads, tokens/s")
    for (kind, n), (a, b) in got.items():
        ratios = [y / x for x, y in zip(a, b)]
        print(f"{kind}{n}: A {statistics.median(a):.1f} ({min(a):.1f}-{max(a):.1f})  "
              f"B {statistics.median(b):.1f} ({min(b):.1f}-{max(b):.1f})  "
              f"B/A {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
