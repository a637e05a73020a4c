"""Prometheus metrics of one server, in their own ``CollectorRegistry``.

Latency histograms are observed on the engine thread when a request finishes; gauges and
counters are read at scrape time from the engine's latest ``EngineSnapshot``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from llmserve.engine.async_engine import AsyncLLMEngine
from llmserve.outputs import RequestOutput

PREFIX = "llmserve:"
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _EngineCollector(Collector):
    """Gauges and counters mirrored from ``AsyncLLMEngine.snapshot``."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot
        gauges = {
            "num_requests_running": ("Requests in the running batch", s.num_requests_running),
            "num_requests_waiting": ("Requests waiting to be scheduled", self.engine.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV cache blocks in use (0-1)", s.kv_cache_usage),
            "max_batch_size": ("Most sequences seen in one engine step", s.max_batched_seqs),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = {
            "num_preemptions": ("Sequences preempted for lack of KV blocks", s.num_preemptions),
            "prompt_tokens": ("Prompt tokens admitted", s.num_prompt_tokens),
            "generation_tokens": ("Tokens generated", s.num_generation_tokens),
            "prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache",
                s.num_prefix_queries,
            ),
            "prefix_cache_hits": ("Prompt tokens served by the prefix cache", s.num_prefix_hits),
            "num_steps": ("Engine steps (forward passes)", s.num_steps),
        }
        spec = s.spec_decode
        counters |= {
            "spec_decode_num_drafts": (
                "Speculative steps: sequences verifying drafts",
                spec.num_drafts,
            ),
            "spec_decode_num_draft_tokens": ("Draft tokens proposed", spec.num_draft_tokens),
            "spec_decode_num_accepted_tokens": ("Draft tokens accepted", spec.num_accepted_tokens),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first)",
            labels=["position"],
        )
        for position, value in enumerate(spec.accepted_per_position):
            per_position.add_metric([str(position)], value)
        yield per_position
        replica_metrics = getattr(self.engine, "replica_metrics", None)  # data parallel
        if replica_metrics is not None:
            yield from _replica_families(replica_metrics())


def _replica_families(rows: list[tuple[str, str, str, dict[str, str], float]]) -> Iterator[Metric]:
    """One labelled family per name from (kind, name, help, labels, value) rows."""
    families: dict[str, Metric] = {}
    for kind, name, doc, labels, value in rows:
        if name not in families:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            families[name] = family(PREFIX + name, doc, labels=list(labels))
        families[name].add_metric(list(labels.values()), value)
    yield from families.values()


class ServerMetrics:
    """Every metric of a server; call ``render()`` for the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token")
        self.tpot = self._histogram("time_per_output_token_seconds", "Mean time per output token")
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = self._histogram("request_queue_time_seconds", "Arrival to first step")
        self.batch_size = Histogram(
            PREFIX + "batch_size",
            "Sequences per engine step",
            buckets=_BATCH_BUCKETS,
            registry=self.registry,
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished sequences, by finish reason",
            ["finished_reason"],
            registry=self.registry,
        )
        engine.listeners.on_step.append(self.batch_size.observe)
        engine.listeners.on_finish.append(self.observe_finished)

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(PREFIX + name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def observe_finished(self, output: RequestOutput) -> None:
        """Record a finished (or aborted) request's latencies and finish reasons."""
        m = output.metrics
        arrival, first_token = m.get("arrival_time"), m.get("first_token_time")
        finished = m.get("finished_time") or time.monotonic()
        self.e2e.observe(finished - arrival)
        if m.get("first_scheduled_time") is not None:
            self.queue_time.observe(m["first_scheduled_time"] - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            num_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
            if num_tokens > 1 and m.get("last_token_time") is not None:
                self.tpot.observe((m["last_token_time"] - first_token) / (num_tokens - 1))
        for c in output.outputs:
            self.request_success.labels(finished_reason=c.finish_reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
