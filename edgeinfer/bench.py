"""Prompt-processing and generation throughput, measured the way `llama-bench` does.

pp<N>: evaluate N prompt tokens into an empty cache (prefill, in chunks);
tg<N>: generate N tokens one at a time into an empty cache (decode).
With a depth D (llama-bench's -d), the cache first holds D tokens, untimed: "@ dD".
Each test runs once untimed (JIT and page-cache warm-up), then `repetitions` times.
"""

from __future__ import annotations

import statistics
import time
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
    samples_ts: list[float] = field(default_factory=list)

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


def time_generation(engine: Engine, n_gen: int, seed: int = 0, depth: int = 0) -> float:
    tokens = _random_tokens(engine, n_gen, seed)
    kv = _cache_at_depth(engine, depth, seed)
    t0 = time.perf_counter()
    for tok in tokens:
        engine.decode(int(tok), kv)
    return n_gen / (time.perf_counter() - t0)


def run_bench(engine: Engine, *, n_prompt: int, n_gen: int, repetitions: int, n_threads: int,
              model_type: str, n_depth: int = 0) -> list[BenchResult]:
    gf = engine.model_file.gguf
    base = dict(model_filename=str(gf.path), model_type=model_type, model_size=gf.file_size,
                model_n_params=gf.parameter_count(), backend=engine.backend.name.upper(),
                n_threads=n_threads)
    results = []
    for kind, n in (("pp", n_prompt), ("tg", n_gen)):
        if n <= 0:
            continue
        measure = time_prompt if kind == "pp" else time_generation
        measure(engine, n, seed=99, depth=n_depth)  # warm-up
        row = BenchResult(**base, n_prompt=n if kind == "pp" else 0, n_gen=n if kind == "tg" else 0,
                          n_depth=n_depth)
        row.samples_ts = [measure(engine, n, seed=r, depth=n_depth) for r in range(repetitions)]
        results.append(row)
    return results
