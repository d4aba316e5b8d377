"""Prometheus metrics for the server, named one-to-one after vLLM's (`vllm:x` -> `pagedllm:x`).

`PrometheusMetrics` watches the engine from the API process (it is an `AsyncLLM` step
observer): engine gauges and counters come from each step's stats snapshot; per-sequence
latencies (time to first token, inter-token, end-to-end, queue time) from the times the
API process sees each sequence's tokens arrive. A request with n > 1 counts as n sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from pagedllm.core.scheduler import EngineCoreOutput
from pagedllm.metrics.stats import EngineStats

# As vLLM: no `_created` series, which dashboards do not use and which double the output.
disable_created_metrics()

PREFIX = "pagedllm:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's 1-2-5 series)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return buckets
            buckets.append(value)
        scale *= 10


@dataclass
class _Sequence:
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_generation_tokens: int = 0


class PrometheusMetrics:
    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self._sequences: dict[str, _Sequence] = {}
        self._last_stats: EngineStats | None = None
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(
                PREFIX + name, doc, labels, buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in model steps.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage (1 means 100%).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Tokens looked up.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Tokens served from the cache.")
        self.num_preemptions = counter("num_preemptions", "Preemptions by the scheduler.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of started sequences.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished sequences by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "Time per output token.", ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end latency.", LATENCY_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first scheduling.", LATENCY_BUCKETS
        )
        lengths = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length.", lengths)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated length.", lengths
        )

    # ---- StepObserver -----------------------------------------------------------------------
    def on_request_added(self, request_id: str, arrival_time: float, num_prompt: int) -> None:
        self._sequences[request_id] = _Sequence(arrival_time, num_prompt)

    def on_step(
        self, outputs: list[EngineCoreOutput], stopped: list[str], stats: EngineStats, now: float
    ) -> None:
        self._update_engine(stats)
        stopped_ids = set(stopped)
        for output in outputs:
            sequence = self._sequence(output.request_id)
            if sequence is None:
                continue
            if output.new_token_ids:
                self._observe_tokens(sequence, output, now)
            if output.finished or output.request_id in stopped_ids:
                reason = output.finish_reason if output.finished else "stop"
                self._finish(output.request_id, reason or "stop", now)

    def on_request_aborted(self, request_ids: list[str], now: float) -> None:
        for request_id in request_ids:
            if request_id in self._sequences:
                self._finish(request_id, "abort", now)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- internals --------------------------------------------------------------------------
    def _sequence(self, request_id: str) -> _Sequence | None:
        sequence = self._sequences.get(request_id)
        if sequence is None and "#" in request_id:  # a parallel sample: timed as its parent
            parent = self._sequences.get(request_id.rsplit("#", 1)[0])
            if parent is not None:
                sequence = _Sequence(parent.arrival_time, parent.num_prompt_tokens)
                self._sequences[request_id] = sequence
        return sequence

    def _update_engine(self, stats: EngineStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        last = self._last_stats
        self.prefix_cache_queries.inc(
            stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0)
        )
        self.prefix_cache_hits.inc(
            stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0)
        )
        self.num_preemptions.inc(stats.num_preemptions - (last.num_preemptions if last else 0))
        self._last_stats = stats

    def _observe_tokens(self, sequence: _Sequence, output: EngineCoreOutput, now: float) -> None:
        num_new = len(output.new_token_ids)
        if sequence.first_token_time is None:
            sequence.first_token_time = now
            self.ttft.observe(now - sequence.arrival_time)
            self.prompt_tokens.inc(sequence.num_prompt_tokens)
            if output.first_scheduled_time is not None:
                self.queue_time.observe(
                    max(0.0, output.first_scheduled_time - sequence.arrival_time)
                )
        else:
            gap = (now - sequence.last_token_time) / num_new
            for _ in range(num_new):
                self.itl.observe(gap)
        sequence.last_token_time = now
        sequence.num_generation_tokens += num_new
        self.generation_tokens.inc(num_new)

    def _finish(self, request_id: str, reason: str, now: float) -> None:
        sequence = self._sequences.pop(request_id)
        self._request_success.labels(self._model_name, reason).inc()
        self.e2e.observe(now - sequence.arrival_time)
        self.request_prompt_tokens.observe(sequence.num_prompt_tokens)
        self.request_generation_tokens.observe(sequence.num_generation_tokens)
        if sequence.first_token_time is not None and sequence.num_generation_tokens > 1:
            decode_time = sequence.last_token_time - sequence.first_token_time
            self.tpot.observe(decode_time / (sequence.num_generation_tokens - 1))
