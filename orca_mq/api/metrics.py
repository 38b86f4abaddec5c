"""Prometheus metrics of the API server, named as vLLM names them where the meaning is the same.

Request histograms and token counters come from the requests this process serves (HTTP);
the engine's gauges and histograms (running / waiting / swapped requests, KV usage, iteration
time, batch size, queue time, MLFQ queue lengths, swap bytes) from the scheduler's stats reply,
fetched when /metrics is scraped and translated by `EngineCollector`.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class Finished(Protocol):
    """What the metrics read of a finished generation (orca_mq.api.stream.Generation)."""

    finish_reason: str | None
    arrival: float
    prompt_tokens: int
    completion_tokens: int
    first_token: float | None   # time.monotonic() of the first token and of the last
    last_token: float | None


LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class ApiMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Any:
            return Histogram(name, doc, label, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (HTTP arrival -> first token).")
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Mean time per output token after the first, per request.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.gen_len = hist("vllm:request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", label,
                                     registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.", label,
                                         registry=self.registry).labels(model_name)
        self._success = Counter("vllm:request_success", "Requests that finished, by finish reason.",
                                [*label, "finished_reason"], registry=self.registry)
        self._outcomes = Counter("orca_mq:requests", "HTTP generation requests by outcome: stop | length | "
                                 "abort (client left) | invalid | overloaded | unavailable | internal_error.",
                                 [*label, "outcome"], registry=self.registry)
        self.model_name = model_name
        self.engine = EngineCollector(model_name)
        self.registry.register(self.engine)

    def outcome(self, outcome: str) -> None:
        self._outcomes.labels(self.model_name, outcome).inc()

    def finished(self, gen: Finished, now: float) -> None:
        assert gen.finish_reason is not None
        self.outcome(gen.finish_reason)
        self._success.labels(self.model_name, gen.finish_reason).inc()
        self.e2e.observe(now - gen.arrival)
        self.prompt_len.observe(gen.prompt_tokens)
        self.gen_len.observe(gen.completion_tokens)
        self.prompt_tokens.inc(gen.prompt_tokens)
        self.generation_tokens.inc(gen.completion_tokens)
        if gen.completion_tokens > 1 and gen.first_token is not None and gen.last_token is not None:
            self.tpot.observe((gen.last_token - gen.first_token) / (gen.completion_tokens - 1))


@dataclass(slots=True, eq=False)  # hashable: the registry keys collectors by identity
class EngineCollector(Collector):
    """The last stats reply (scheduler, telemetry, and the broker's count of the launcher's restarts)
    as Prometheus metrics."""

    model_name: str
    stats: dict[str, Any] = field(default_factory=dict)

    def update(self, stats: dict[str, Any]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        lv = [self.model_name]
        yield _counter("orca_mq:engine_restarts", "Restarts of server processes by the launcher's supervision.", lv,
                       self.stats.get("broker", {}).get("restarts", 0))
        sched = self.stats.get("scheduler")
        if not sched:
            return
        tel = self.stats.get("telemetry", {})
        yield _gauge("vllm:num_requests_running", "Requests in an iteration in flight.", lv, sched["running"])
        yield _gauge("vllm:num_requests_waiting", "Requests in the pool not in an iteration in flight.", lv, sched["waiting"])
        yield _gauge("orca_mq:num_requests_preempted", "Started requests not in an iteration in flight (FastServe preemption).",
                     lv, tel.get("preempted", 0))
        yield _gauge("vllm:num_requests_swapped", "Requests whose KV is in host memory (FastServe offload).", lv,
                     sched.get("on_host", 0))
        yield _gauge("vllm:kv_cache_usage_perc", "Fraction of device KV slots in use (0-1).", lv,
                     sched["used_slots"] / max(1, sched["n_slots"]))
        yield _gauge("vllm:cpu_cache_usage_perc", "Fraction of host KV slots in use (0-1).", lv,
                     sched.get("host_used_slots", 0) / max(1, sched.get("host_slots", 0)))
        queues = GaugeMetricFamily("orca_mq:mlfq_queue_length", "FastServe jobs per MLFQ level (1 = highest priority).",
                                   labels=["model_name", "level"])
        for level, n in enumerate(sched.get("queue_lengths", []), 1):
            queues.add_metric([self.model_name, str(level)], n)
        yield queues
        yield _counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lv,
                       sched.get("prefix_cache_queries", 0))
        yield _counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (their prefill skipped).", lv,
                       sched.get("prefix_cache_hits", 0))
        yield _gauge("orca_mq:prefix_cache_slots", "Device KV slots holding cached prefix blocks (shared or idle).", lv,
                     sched.get("prefix_cache_slots", 0))
        if "spec_drafts" in sched:   # speculative decoding is on
            yield _counter("vllm:spec_decode_num_drafts", "Verify rows run (a request's draft checked in an iteration).", lv,
                           sched["spec_drafts"])
            yield _counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", lv, sched["spec_draft_tokens"])
            yield _counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lv, sched["spec_accepted_tokens"])
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Drafts whose token at this position was accepted.", labels=["model_name", "position"])
            for pos, n in enumerate(sched["spec_accepted_per_pos"]):
                per_pos.add_metric([self.model_name, str(pos)], n)
            yield per_pos
        yield _counter("orca_mq:client_turn_waits", "Rows that waited an iteration for their client's turn (scheduler.client_rows).",
                       lv, sched.get("turn_waits", 0))
        yield _counter("orca_mq:kv_offload_bytes", "KV bytes offloaded to host by finished requests.", lv, tel.get("offload_bytes", 0))
        yield _counter("orca_mq:kv_upload_bytes", "KV bytes uploaded to device by finished requests.", lv, tel.get("upload_bytes", 0))
        for key, name, doc in (
            ("iteration_time", "orca_mq:iteration_time_seconds", "Iteration latency: control frame sent -> tokens back."),
            ("batch_size", "orca_mq:batch_size", "Requests per iteration."),
            ("iteration_tokens", "vllm:iteration_tokens_total", "Tokens per iteration."),
            ("queue_time", "vllm:request_queue_time_seconds", "Arrival at the scheduler -> first scheduled."),
        ):
            if key in tel:
                yield _histogram(name, doc, lv, tel[key])


def _gauge(name: str, doc: str, labels: list[str], value: float) -> Metric:
    g = GaugeMetricFamily(name, doc, labels=["model_name"])
    g.add_metric(labels, value)
    return g


def _counter(name: str, doc: str, labels: list[str], value: float) -> Metric:
    c = CounterMetricFamily(name, doc, labels=["model_name"])
    c.add_metric(labels, value)
    return c


def _histogram(name: str, doc: str, labels: list[str], h: dict[str, Any]) -> Metric:
    buckets, running = [], 0
    for bound, n in zip([*map(str, map(float, h["bounds"])), "+Inf"], h["counts"]):
        running += n
        buckets.append((bound, running))
    fam = HistogramMetricFamily(name, doc, labels=["model_name"])
    fam.add_metric(labels, buckets, h["sum"])
    return fam
