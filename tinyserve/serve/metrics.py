"""Prometheus metrics of one server (`GET /metrics`), in a registry of its own per app.

Counters and histograms are fed by the server as requests move; gauges (running, waiting, KV
usage) are read from the engine at scrape time. Names follow vLLM's (`vllm:` -> `tinyserve:`).
With speculative decoding on, `spec_decode_*` counters report drafts, drafted and accepted tokens
and the mean accepted length (tokens per verify row, the bonus token included), as vLLM's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from tinyserve.engine.llm_engine import LLMEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OUTCOMES = ("ok", "aborted", "timeout", "rejected", "error")
# vLLM's buckets (seconds)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
prometheus_client.disable_created_metrics()  # no `*_created` series (as vLLM)


class _SpecCollector:
    """Reads the engine's acceptance counters at scrape time (they only grow)."""

    COUNTERS = (
        ("num_drafts", "Verify rows that carried drafts."),
        ("num_draft_tokens", "Draft tokens proposed."),
        ("num_accepted_tokens", "Draft tokens accepted."),
    )

    def __init__(self, engine: LLMEngine, values: list[str]) -> None:
        self.stats, self.values = engine.spec.stats, values

    def collect(self):
        for name, doc in self.COUNTERS:
            c = CounterMetricFamily(f"tinyserve:spec_decode_{name}", doc, labels=["model_name"])
            c.add_metric(self.values, getattr(self.stats, name))
            yield c
        name = "tinyserve:spec_decode_mean_accepted_length"
        doc = "Tokens per verify row (accepted drafts + 1)."
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric(self.values, self.stats.mean_accepted_length)
        yield g


class _CheckpointCollector:
    """Hybrid models: the recurrent-state checkpoints behind their prefix hits, read from the
    state pool at scrape time (core/state_pool.py; the counters only grow)."""

    COUNTERS = (
        ("saves", "State checkpoints saved (block ends, branch points)."),
        ("hits", "Prefix hits resumed from a state checkpoint."),
        ("evictions", "State checkpoints evicted (LRU, or with their KV block)."),
        (
            "branch_saves",
            "State checkpoints saved at a branch point (where a clamped hit's recompute ended).",
        ),
        ("branch_hits", "Prefix hits resumed from a branch-point checkpoint."),
        (
            "borrows",
            "State checkpoints saved in an idle sequence slot (until an admission takes it).",
        ),
    )

    def __init__(self, state_pool, values: list[str]) -> None:
        self.pool, self.values = state_pool, values

    def collect(self):
        for name, doc in self.COUNTERS:
            c = CounterMetricFamily(
                f"tinyserve:prefix_cache_state_checkpoint_{name}", doc, labels=["model_name"]
            )
            c.add_metric(self.values, getattr(self.pool, f"num_checkpoint_{name}"))
            yield c
        g = GaugeMetricFamily(
            "tinyserve:prefix_cache_state_checkpoints_ready",
            "Checkpoint slots holding a ready state.",
            labels=["model_name"],
        )
        g.add_metric(self.values, len(self.pool.ready))  # (not the pending saves)
        yield g


@dataclass(slots=True)
class SeqTimes:
    """Timestamps of one engine request, for TTFT / inter-token / end-to-end latency."""

    arrival: float = field(default_factory=time.perf_counter)
    last_token: float | None = None


class ServerMetrics:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        labels, values = ["model_name"], [model_name]

        def counter(name: str, doc: str):  # one series, labelled with the model name
            return Counter(f"tinyserve:{name}", doc, labels, registry=reg).labels(*values)

        def gauge(name: str, doc: str, fn) -> None:
            Gauge(f"tinyserve:{name}", doc, labels, registry=reg).labels(*values).set_function(fn)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"tinyserve:{name}", doc, labels, buckets=buckets, registry=reg)

        doc = (
            "API requests by outcome: ok, aborted (client gone or shutdown), timeout, "
            "rejected (4xx), error (5xx)."
        )
        self._requests = Counter("tinyserve:requests", doc, [*labels, "outcome"], registry=reg)
        for outcome in OUTCOMES:  # export zeros so rate() works from the start
            self._requests.labels(model_name, outcome)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of started requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        # Queries and hits count prompt tokens, as vLLM's prefix_cache_{queries,hits}.
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the cache.")
        self._prefix_tokens = (0, 0)  # (queried, hit): the hit-rate gauge reads both at once
        # Gauges read the engine's state from the loop thread while the worker thread steps:
        # len() of a list / deque is atomic under the GIL, a scrape may be one step stale.
        sched, pool = engine.scheduler, engine.pool
        gauge("num_requests_running", "Sequences in the batch.", lambda: len(sched.running))
        gauge("num_requests_waiting", "Sequences not yet scheduled.", lambda: len(sched.waiting))
        gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", lambda: pool.usage)
        gauge("num_preemptions", "Preemptions so far (recompute).", lambda: sched.num_preemptions)
        if engine.config.speculative_method is not None:
            reg.register(_SpecCollector(engine, values))
        if getattr(sched, "state_pool", None) is not None:
            reg.register(_CheckpointCollector(sched.state_pool, values))
        gauge(  # vLLM's gauge: hits / queries, over prompt tokens
            "prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / prompt tokens looked up.",
            lambda: self._hit_rate(),
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        ).labels(*values)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between two outputs of a sequence.", ITL_BUCKETS
        ).labels(*values)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to last output.", E2E_BUCKETS
        ).labels(*values)
        self._model_name = model_name

    def count(self, outcome: str) -> None:
        self._requests.labels(self._model_name, outcome).inc()

    def on_output(self, times: SeqTimes, num_new_tokens: int) -> None:
        if num_new_tokens == 0:
            return
        now = time.perf_counter()
        if times.last_token is None:
            self.ttft.observe(now - times.arrival)
        else:
            self.itl.observe(now - times.last_token)
        times.last_token = now
        self.generation_tokens.inc(num_new_tokens)

    def on_finish(self, times: SeqTimes, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A finished engine request (one aborted before any output only counts in requests)."""
        if times.last_token is None:
            return
        self.e2e.observe(times.last_token - times.arrival)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prefix_queries.inc(num_prompt_tokens)
        self.prefix_hits.inc(num_cached_tokens)
        queried, hit = self._prefix_tokens
        self._prefix_tokens = (queried + num_prompt_tokens, hit + num_cached_tokens)

    def _hit_rate(self) -> float:
        queried, hit = self._prefix_tokens
        return hit / queried if queried else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
