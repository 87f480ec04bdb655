"""Prometheus metrics for `/metrics`, in a registry of the app's own (tests run several apps)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from edgeinfer.results import GenerationChunk

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("edgeinfer_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("edgeinfer_requests_rejected", "Requests refused because the queue was full",
                                registry=r)
        self.cancelled = Counter("edgeinfer_generations_cancelled",
                                 "Generations stopped early (client gone or timeout)", registry=r)
        self.prompt_tokens = Counter("edgeinfer_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter("edgeinfer_prompt_tokens_cached",
                                     "Prompt tokens reused from the prefix cache", registry=r)
        self.generated_tokens = Counter("edgeinfer_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("edgeinfer_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("edgeinfer_tpot_seconds", "Mean time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.queue_depth = Gauge("edgeinfer_queue_depth", "Requests waiting for the worker", registry=r)
        self.running = Gauge("edgeinfer_requests_running", "Generations running now (0 or 1)", registry=r)
        self.kv_used = Gauge("edgeinfer_kv_used_tokens", "Token positions held in the KV cache", registry=r)
        self.kv_capacity = Gauge("edgeinfer_kv_capacity_tokens", "Token positions the KV cache holds",
                                 registry=r)
        self.hit_ratio = Gauge("edgeinfer_prefix_cache_hit_ratio",
                               "Share of prompt tokens served from the prefix cache", registry=r)
        self._totals = (0, 0)  # (prompt, cached) tokens, replaced as one tuple: no lock needed
        self.hit_ratio.set_function(self._hit_ratio)

    def _hit_ratio(self) -> float:
        prompt, cached = self._totals
        return cached / prompt if prompt else 0.0

    def bind(self, queue_depth: Callable[[], float], running: Callable[[], float],
             kv_used: Callable[[], float], kv_capacity: Callable[[], float]) -> None:
        """Gauges read live values when scraped."""
        self.queue_depth.set_function(queue_depth)
        self.running.set_function(running)
        self.kv_used.set_function(kv_used)
        self.kv_capacity.set_function(kv_capacity)

    def record_generation(self, last: GenerationChunk | None) -> None:
        if last is None or last.usage is None:
            return
        u, t = last.usage, last.timings
        self.prompt_tokens.inc(u.prompt_tokens)
        self.cached_tokens.inc(u.cached_tokens)
        self._totals = (self._totals[0] + u.prompt_tokens, self._totals[1] + u.cached_tokens)
        self.generated_tokens.inc(u.completion_tokens)
        if t is not None and u.completion_tokens > 0:
            self.ttft.observe(t.ttft_s)
            if u.completion_tokens > 1:
                self.tpot.observe(t.tpot_s)
        if last.finish_reason == "cancelled":
            self.cancelled.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
