"""Prompt-processing and generation throughput, measured the way `llama-bench` does.

pp<N>: evaluate N prompt tokens into an empty cache (prefill, in chunks);
tg<N>: generate N tokens one at a time into an empty cache (decode).
With a depth D (llama-bench's -d), the cache first holds D tokens, untimed: "@ dD".

Nothing is timed while kernels still compile: a cold start hands about half of its kernels
to a second process (kernels_cpu/compile_progress.py), which may still be compiling after
the model has loaded, taking a core from the timed runs (a cold-cache tg once measured
0.59x llama.cpp that way, 1.02-1.09x warm). So `run_bench` first waits for every pending
compile job (saying so on stderr), then runs every test once untimed (each prompt size and
the decode: JIT, page cache), waits again, and only then times `repetitions` runs of each.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from edgeinfer.engine import Engine


@dataclass
class BenchResult:
    """One row; field names are llama-bench's JSON names."""

    model_filename: str
    model_type: str
    model_size: int
    model_n_params: int
    backend: str
    n_threads: int
    n_prompt: int
    n_gen: int
    n_depth: int = 0
    type_k: str = "f16"   # the K/V cache types (-ctk / -ctv)
    type_v: str = "f16"
    samples_ts: list[float] = field(default_factory=list)
    # what the runtime issued to the GPU driver per decoded token (tg rows; 0 on the CPU):
    # kernel launches from Python, and CUDA graph launches (edgeinfer.backends.cuda_graph)
    kernel_launches_per_token: float = 0.0
    graph_launches_per_token: float = 0.0

    @property
    def test(self) -> str:
        name = f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"
        return f"{name} @ d{self.n_depth}" if self.n_depth else name

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(avg_ts=self.avg_ts, stddev_ts=self.stddev_ts, test=self.test)
        return d


def _random_tokens(engine: Engine, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, engine.config.n_vocab, n)


def _cache_at_depth(engine: Engine, depth: int, seed: int):
    """A cache already holding `depth` random tokens (untimed)."""
    kv = engine.new_cache()
    if depth:
        engine.prefill(_random_tokens(engine, depth, seed + 1000), kv)
    return kv


def time_prompt(engine: Engine, n_prompt: int, seed: int = 0, depth: int = 0) -> float:
    tokens = _random_tokens(engine, n_prompt, seed)
    kv = _cache_at_depth(engine, depth, seed)
    t0 = time.perf_counter()
    engine.prefill(tokens, kv)
    return n_prompt / (time.perf_counter() - t0)


def time_generation(engine: Engine, n_gen: int, seed: int = 0, depth: int = 0, launches: Counter | None = None
                    ) -> float:
    """tg tokens/s; `launches` gains the GPU driver calls of the decoded tokens (not the depth's)."""
    tokens = _random_tokens(engine, n_gen, seed)
    kv = _cache_at_depth(engine, depth, seed)
    before = Counter(launch_counts())
    t0 = time.perf_counter()
    for tok in tokens:
        engine.decode(int(tok), kv)
    rate = n_gen / (time.perf_counter() - t0)
    if launches is not None:
        launches.update(Counter(launch_counts()) - before)
    return rate


def launch_counts():
    """The GPU driver calls this process issued for forward steps (kernels_cuda.graph.COUNTS)."""
    from edgeinfer.kernels_cuda.graph import COUNTS

    return COUNTS


def pending_compiles() -> list:
    """(helper, job) pairs of the background compile process(es) still owed to this process
    (kernels_cpu.compile_progress); [] on a warm cache."""
    from edgeinfer.kernels_cpu import compile_progress

    return [(helper, job) for helper, job in compile_progress.pending_jobs() if not _finished(helper, job)]


def _finished(helper, job: int) -> bool:
    if job in getattr(helper, "done", ()):
        return True
    proc = getattr(helper, "proc", None)
    return proc is not None and proc.poll() is not None  # exited: whatever it compiled is on disk


def wait_for_compiles(stream=None) -> int:
    """Block until every background kernel compile job has finished (and its process has
    exited), saying on `stream` (stderr) that bench is waiting; returns how many jobs were
    pending."""
    jobs = pending_compiles()
    if not jobs:
        return 0
    out = stream if stream is not None else sys.stderr
    t0 = time.perf_counter()
    print(f"bench: waiting for {len(jobs)} kernel compile job(s) still running in the background "
          f"before timing anything", file=out, flush=True)
    helpers: dict[int, tuple[object, int]] = {}
    for helper, job in jobs:
        last = max(job, getattr(helper, "n_jobs", job + 1) - 1)
        helpers[id(helper)] = (helper, max(last, helpers.get(id(helper), (helper, -1))[1]))
    for helper, last in helpers.values():
        helper.wait(last)  # jobs run in order: the last one done = all done
        proc = getattr(helper, "proc", None)
        if proc is not None:
            proc.wait()
    print(f"bench: kernels compiled ({time.perf_counter() - t0:.1f} s)", file=out, flush=True)
    return len(jobs)


def run_bench(engine: Engine, *, n_prompt: int, n_gen: int, repetitions: int, n_threads: int,
              model_type: str, n_depth: int = 0, stream=None) -> list[BenchResult]:
    gf = engine.model_file.gguf
    base = dict(model_filename=str(gf.path), model_type=model_type, model_size=gf.file_size,
                model_n_params=gf.parameter_count(), backend=engine.backend.name.upper(),
                n_threads=n_threads, type_k=engine.cache_types.k, type_v=engine.cache_types.v)
    tests = [(kind, n, time_prompt if kind == "pp" else time_generation)
             for kind, n in (("pp", n_prompt), ("tg", n_gen)) if n > 0]
    wait_for_compiles(stream)
    for _, n, measure in tests:  # warm-up: every path timed below, before any timing
        measure(engine, n, seed=99, depth=n_depth)
    wait_for_compiles(stream)  # (a warm-up that started a compile elsewhere)
    results = []
    for kind, n, measure in tests:
        row = BenchResult(**base, n_prompt=n if kind == "pp" else 0, n_gen=n if kind == "tg" else 0,
                          n_depth=n_depth)
        if kind == "tg":
            launches: Counter = Counter()
            row.samples_ts = [measure(engine, n, seed=r, depth=n_depth, launches=launches) for r in range(repetitions)]
            row.kernel_launches_per_token = launches["kernels"] / (n * repetitions)
            row.graph_launches_per_token = launches["graphs"] / (n * repetitions)
        else:
            row.samples_ts = [measure(engine, n, seed=r, depth=n_depth) for r in range(repetitions)]
        results.append(row)
    return results
