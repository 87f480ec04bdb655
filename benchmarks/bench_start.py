"""Start time of a one-shot answer: `edgeinfer run MODEL --raw --temp 0 -n 4 PROMPT`, whole command.

    python benchmarks/bench_start.py [--runs 7] [--model gemma3-270m] [--cold] [--prompt Hello]

Warm (the default): one untimed run first fills the Numba kernel cache, then each timed
run starts a fresh process, as a user does. --cold: every timed run gets an empty
NUMBA_CACHE_DIR, so it compiles the kernels. Prints each run, the median, min, max and
spread (max - min) of wall and CPU time, and the load average (a busy machine skews it).
Target: a warm start at or under 1.5 s wall (llama.cpp and Ollama start in about a second).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def one_run(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) for one run of `cmd`; a failed run stops the bench."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"bench_start: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def summary(name: str, values: list[float]) -> str:
    return (f"{name}: median {statistics.median(values):.2f} s, min {min(values):.2f}, "
            f"max {max(values):.2f}, spread {max(values) - min(values):.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="timed runs (default 7)")
    ap.add_argument("--model", default="gemma3-270m", help="model name or .gguf path")
    ap.add_argument("--prompt", default="Hello")
    ap.add_argument("--cold", action="store_true", help="an empty NUMBA_CACHE_DIR for every run")
    args = ap.parse_args()

    cmd = [sys.executable, "-m", "edgeinfer.cli", "run", args.model, "--raw", "--temp", "0",
           "-n", "4", args.prompt]
    env = dict(os.environ)
    # a user's Python writes .pyc files on the first run and reads them after; a shell that
    # turns that off would time Python compiling every edgeinfer module on each start
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    walls: list[float] = []
    cpus: list[float] = []
    if not args.cold:
        one_run(cmd, env)  # fills the kernel cache (and the OS page cache) if they are empty
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="edgeinfer-bench-numba-") as cache:
            run_env = {**env, "NUMBA_CACHE_DIR": cache} if args.cold else env
            wall, cpu = one_run(cmd, run_env)
        walls.append(wall)
        cpus.append(cpu)
        print(f"run {i + 1}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
    kind = "cold (empty kernel cache)" if args.cold else "warm"
    print(f"{kind} start, {args.runs} runs of: edgeinfer {' '.join(cmd[3:])}")
    print(summary("wall", walls))
    print(summary("CPU ", cpus))
    print("load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
