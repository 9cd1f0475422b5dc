"""Prometheus metrics for /metrics (prometheus-client, its own registry per app so several apps can coexist).

Two kinds: what the engine holds right now (running and waiting sequences, KV-cache usage, preemptions, prefix-cache
hits) is read from the engine at scrape time by a collector, so it can never drift from the engine's own state;
what happens per request (TTFT, inter-token latency, end-to-end latency, prompt and generated tokens, finish
reasons) is observed once, when the request finishes, from its `RequestMetrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inference.engine.client import EngineClient
from inference.engine.outputs import RequestOutput

PREFIX = "pagejax_"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


def replicas(engine: EngineClient) -> list:
    """The `Engine`s behind a client: itself, or a DataParallelEngine's replicas."""
    return list(getattr(engine, "engines", [engine]))


def kv_cache_usage(engine: EngineClient) -> float:
    """Fraction of KV pages held by sequences (evictable prefix-cache pages count as free), over all replicas."""
    total = used = 0
    for e in replicas(engine):
        total += e.block_manager.num_pages
        used += e.block_manager.num_pages - e.block_manager.num_free_pages
    return used / total if total else 0.0


class _EngineCollector:
    """Gauges and counters read from the engine on every scrape."""

    def __init__(self, engine: EngineClient, model_name: str):
        self.engine, self.labels = engine, {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(PREFIX + name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self):
        engines = replicas(self.engine)
        running = sum(len(e.scheduler.running) for e in engines)
        waiting = sum(len(e.scheduler.waiting) + len(e.scheduler.awaiting_fork) for e in engines)
        yield self._gauge("num_requests_running", "Sequences in the engine's running batch.", running)
        yield self._gauge("num_requests_waiting", "Sequences waiting for a slot or their pages.", waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV-cache pages held by sequences (0 to 1).",
                          kv_cache_usage(self.engine))
        yield self._counter("num_preemptions", "Sequences preempted (pages released, recomputed later).",
                            sum(e.scheduler.num_preemptions for e in engines))
        groups = [e.block_manager.groups[0] for e in engines]
        yield self._counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                            sum(g.prefix_hits_tokens for g in groups))
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            sum(g.prefix_queries_tokens for g in groups))


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        label = ["model_name"]
        self._labels = {"model_name": model_name}
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              label, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between successive tokens of a request.",
                             label, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                             label, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", label,
                                     registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens of finished requests.",
                                         label, registry=self.registry)
        self.finished = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                label + ["finished_reason"], registry=self.registry)

    def observe(self, out: RequestOutput) -> None:
        """Record a finished request (called once per request, from its pump thread)."""
        m, labels = out.metrics, self._labels
        self.prompt_tokens.labels(**labels).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(**labels).inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            self.finished.labels(**labels, finished_reason=c.finish_reason or "unknown").inc()
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.labels(**labels).observe(m.ttft)
        for gap in m.inter_token_latencies:
            self.itl.labels(**labels).observe(gap)
        if m.finished_time is not None:
            self.e2e.labels(**labels).observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
