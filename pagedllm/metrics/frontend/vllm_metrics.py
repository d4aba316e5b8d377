"""vLLM's own `vllm:` metric family, exported beside `pagedllm:` so that vLLM's Grafana
dashboard and alerts work against this server unchanged.

Names, types, label sets and fixed buckets are vLLM's (`vllm/v1/metrics/loggers.py`, v0.10):
every series has `model_name` and `engine` (the data-parallel core's index, "0" without data
parallelism), and no `tenant` label: each one sums every tenant's work, so a tenant's view of
`/metrics` leaves the whole family out (`_TenantView` keeps only samples labelled with the
tenant). `vllm:cache_config_info` is vLLM's info-style gauge: value 1, the cache settings as
labels (with `engine`, without `model_name`, as vLLM's).

`VllmMetrics` computes nothing itself: `PrometheusMetrics` reads each figure once (a step's
counter deltas, a sequence's latencies from its timeline) and hands it to both families. A
request with n > 1 counts as n sequences, as in the `pagedllm:` family.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from pagedllm.config import CacheConfig

PREFIX = "vllm:"
# vLLM's fixed buckets (the latency ones are the `pagedllm:` family's too).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
# vLLM creates a `request_success` series for each of its finish reasons up front.
FINISH_REASONS = ("stop", "length", "abort")


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


def cache_config_labels(cache_config: CacheConfig) -> dict[str, str]:
    """`vllm:cache_config_info`'s labels: the settings vLLM's `CacheConfig` names alike (its
    other fields, GPU memory and swap settings, have no counterpart here)."""
    return {
        "block_size": str(cache_config.block_size),
        "cache_dtype": str(cache_config.cache_dtype).removeprefix("torch."),
        "enable_prefix_caching": str(cache_config.enable_prefix_caching),
        # vLLM counts its blocks the same way: the null block included.
        "num_gpu_blocks": str(cache_config.num_blocks),
        "kv_cache_memory_bytes": str(cache_config.kv_cache_memory),
    }


@dataclass(frozen=True)
class StepDeltas:
    """What one core's counters advanced by since its previous snapshot."""

    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


@dataclass(frozen=True)
class FinishedTimes:
    """A finished sequence's figures, read once from its timeline for both families."""

    e2e: float
    queue: float | None
    prefill: float | None
    decode: float | None
    inference: float | None
    time_per_output_token: float | None
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class _EngineChildren:
    """One core's children of every `vllm:` metric (looked up once, not per token)."""

    num_requests_running: Gauge
    num_requests_waiting: Gauge
    gpu_cache_usage: Gauge
    kv_cache_usage: Gauge
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    num_preemptions: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    iteration_tokens: Histogram
    ttft: Histogram
    time_per_output_token: Histogram
    request_time_per_output_token: Histogram
    time_per_prefill_token: Histogram
    e2e: Histogram
    queue_time: Histogram
    inference_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    request_max_num_generation_tokens: Histogram
    step_tokens: int = 0  # tokens of the step being read (`iteration_tokens_total`)


class VllmMetrics:
    """The `vllm:` series in `registry`, one set of children per engine core."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        max_model_len: int,
        num_engines: int,
        cache_info: dict[str, str] | None = None,
    ) -> None:
        self._registry = registry
        self._model_name = model_name
        self._labels = ["model_name", "engine"]
        self._request_success = Counter(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            [*self._labels, "finished_reason"],
            registry=registry,
        )
        metrics = self._metrics(token_buckets(max_model_len))
        # vLLM's newer name for the same per-token samples: renamed when read, so that each
        # token is observed once for both names.
        registry.register(
            _Renamed(
                metrics["time_per_output_token"],
                PREFIX + "inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
            )
        )
        self._engines = [
            _EngineChildren(**{key: m.labels(model_name, str(i)) for key, m in metrics.items()})
            for i in range(num_engines)
        ]
        for engine in range(num_engines):
            for reason in FINISH_REASONS:
                self._request_success.labels(model_name, str(engine), reason)
        if cache_info is not None:
            self._cache_config_info(cache_info, num_engines)

    # ---- what PrometheusMetrics hands over ------------------------------------------------
    def on_engine_stats(
        self, engine: int, running: int, waiting: int, kv_usage: float, deltas: StepDeltas
    ) -> None:
        children = self._engines[engine]
        children.num_requests_running.set(running)
        children.num_requests_waiting.set(waiting)
        # vLLM still exports the pre-0.9 name, and its dashboard charts that one.
        children.gpu_cache_usage.set(kv_usage)
        children.kv_cache_usage.set(kv_usage)
        children.prefix_cache_queries.inc(deltas.prefix_cache_queries)
        children.prefix_cache_hits.inc(deltas.prefix_cache_hits)
        children.num_preemptions.inc(deltas.num_preemptions)

    def on_first_tokens(self, engine: int, ttft: float, num_prompt_tokens: int) -> None:
        children = self._engines[engine]
        children.ttft.observe(ttft)
        children.prompt_tokens.inc(num_prompt_tokens)
        children.step_tokens += num_prompt_tokens  # vLLM counts a prompt in its first step

    def on_generated(self, engine: int, num_new: int, gap: float | None) -> None:
        """`num_new` tokens arrived; `gap`: each one's inter-token latency (None: the first)."""
        children = self._engines[engine]
        children.generation_tokens.inc(num_new)
        children.step_tokens += num_new
        if gap is not None:
            for _ in range(num_new):
                children.time_per_output_token.observe(gap)

    def end_step(self, engine: int) -> None:
        """A core's step was read: the tokens it carried are one `iteration_tokens` sample."""
        children = self._engines[engine]
        if children.step_tokens:
            children.iteration_tokens.observe(children.step_tokens)
            children.step_tokens = 0

    def on_finished(self, engine: int, reason: str, times: FinishedTimes) -> None:
        children = self._engines[engine]
        self._request_success.labels(self._model_name, str(engine), reason).inc()
        children.e2e.observe(times.e2e)
        children.request_prompt_tokens.observe(times.num_prompt_tokens)
        children.request_generation_tokens.observe(times.num_generation_tokens)
        # Per sequence: a request with n > 1 counts as n sequences here, as everywhere.
        children.request_max_num_generation_tokens.observe(times.num_generation_tokens)
        _observe(children.queue_time, times.queue)
        _observe(children.request_time_per_output_token, times.time_per_output_token)
        if times.prefill is None:  # never scheduled or no token: no phases to time
            return
        children.prefill_time.observe(times.prefill)
        _observe(children.decode_time, times.decode)
        _observe(children.inference_time, times.inference)
        if times.num_prompt_tokens > 0:
            children.time_per_prefill_token.observe(times.prefill / times.num_prompt_tokens)

    # ---- internals --------------------------------------------------------------------------
    def _metrics(self, lengths: Sequence[int]) -> dict[str, Gauge | Counter | Histogram]:
        """Every per-engine `vllm:` metric by `_EngineChildren` field, with vLLM's help text."""

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, self._labels, registry=self._registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, self._labels, registry=self._registry)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(
                PREFIX + name, doc, self._labels, buckets=buckets, registry=self._registry
            )

        phase = "Histogram of time spent in {} phase for request."
        return {
            "num_requests_running": gauge(
                "num_requests_running", "Number of requests in model execution batches."
            ),
            "num_requests_waiting": gauge(
                "num_requests_waiting", "Number of requests waiting to be processed."
            ),
            "gpu_cache_usage": gauge(
                "gpu_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage. "
                "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            ),
            "kv_cache_usage": gauge(
                "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
            ),
            "prefix_cache_queries": counter(
                "prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
            ),
            "prefix_cache_hits": counter(
                "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
            ),
            "num_preemptions": counter(
                "num_preemptions", "Cumulative number of preemption from the engine."
            ),
            "prompt_tokens": counter("prompt_tokens", "Number of prefill tokens processed."),
            "generation_tokens": counter(
                "generation_tokens", "Number of generation tokens processed."
            ),
            "iteration_tokens": histogram(
                "iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                ITERATION_TOKEN_BUCKETS,
            ),
            "ttft": histogram(
                "time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT_BUCKETS,
            ),
            "time_per_output_token": histogram(
                "time_per_output_token_seconds",
                "Histogram of time per output token in seconds. "
                "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                TPOT_BUCKETS,
            ),
            "request_time_per_output_token": histogram(
                "request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                TPOT_BUCKETS,
            ),
            "time_per_prefill_token": histogram(
                "time_per_prefill_token_request_seconds",
                "Time spent per token during prefill phase in seconds",
                PREFILL_TOKEN_BUCKETS,
            ),
            "e2e": histogram(
                "e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                LATENCY_BUCKETS,
            ),
            "queue_time": histogram(
                "request_queue_time_seconds", phase.format("WAITING"), LATENCY_BUCKETS
            ),
            "inference_time": histogram(
                "request_inference_time_seconds", phase.format("RUNNING"), LATENCY_BUCKETS
            ),
            "prefill_time": histogram(
                "request_prefill_time_seconds", phase.format("PREFILL"), LATENCY_BUCKETS
            ),
            "decode_time": histogram(
                "request_decode_time_seconds", phase.format("DECODE"), LATENCY_BUCKETS
            ),
            "request_prompt_tokens": histogram(
                "request_prompt_tokens", "Number of prefill tokens processed.", lengths
            ),
            "request_generation_tokens": histogram(
                "request_generation_tokens", "Number of generation tokens processed.", lengths
            ),
            "request_max_num_generation_tokens": histogram(
                "request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.",
                lengths,
            ),
        }

    def _cache_config_info(self, cache_info: dict[str, str], num_engines: int) -> None:
        """vLLM's info gauge: permanently 1, one series per engine, settings as labels."""
        info = Gauge(
            PREFIX + "cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*cache_info, "engine"],
            registry=self._registry,
        )
        for engine in range(num_engines):
            info.labels(*cache_info.values(), str(engine)).set(1)


class _Renamed:
    """A collector showing `metric`'s samples under another name (for `generate_latest`,
    which needs only `collect`)."""

    def __init__(self, metric: Histogram, name: str, documentation: str) -> None:
        self.metric = metric
        self.name = name
        self.documentation = documentation

    def collect(self) -> Iterator[Metric]:
        for family in self.metric.collect():
            renamed = Metric(self.name, self.documentation, family.type, family.unit)
            renamed.samples = [
                sample._replace(name=self.name + sample.name.removeprefix(family.name))
                for sample in family.samples
            ]
            yield renamed


def _observe(histogram: Histogram, value: float | None) -> None:
    if value is not None:
        histogram.observe(value)
