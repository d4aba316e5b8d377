"""Prometheus metrics for the server: vLLM's own `vllm:` family, and beside it the
`pagedllm:` family (vLLM's names under `pagedllm:`, with a `tenant` label).

`PrometheusMetrics` watches the engine from the API process (it is an `AsyncLLM` step
observer, a `TimelineSink`): engine gauges and counters come from each step's stats snapshot;
per-sequence latencies (time to first token, inter-token, end-to-end, queue time, and vLLM's
prefill / decode / inference phases) from each sequence's timeline (`metrics.timeline`: the
times the API process sees its tokens arrive). Each figure is read once and handed to both
families (`vllm_metrics.VllmMetrics` holds the `vllm:` series and their documentation).
A request with n > 1 counts as n sequences.

In the `pagedllm:` family, per-sequence series carry a `tenant` label (the API key's tenant,
`default` without keys), so their number is bounded by the configured tenants. Engine series
(scheduler gauges, KV usage, prefix-cache and preemption counters, the stall gauge, restarts)
carry an `engine` label, as vLLM's: "0" to "N-1" for `data_parallel_size` N, "0" alone
without data parallelism. Each core's counters advance by the deltas of that core's own
snapshots, so summing over `engine` gives the engine-wide totals. The `vllm:` family has
vLLM's labels alone (`model_name`, `engine`): every series there is engine-wide.

With LoRA on, `lora_requests_info` (vLLM's) tells which adapters have requests: its labels
`running_lora_adapters` and `waiting_lora_adapters` list them (comma-separated names, in
order), `max_lora` is the engine's max_loras, and its value is when that was last seen (Unix
time). vLLM keeps a series for every combination ever seen; here each engine keeps only its
current one, so adapters loaded and unloaded at runtime cannot grow the output without bound.

`render(tenant)` is one tenant's view: its own per-tenant series and nothing else (engine
series and the whole `vllm:` family, which sum every tenant's work, and the adapter series
would tell it about the others).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

from pagedllm.core.messages import EngineCoreOutput
from pagedllm.metrics.frontend.timeline import RequestTimeline, TimelineSink
from pagedllm.metrics.frontend.vllm_metrics import (
    LATENCY_BUCKETS,
    TTFT_BUCKETS,
    FinishedTimes,
    StepDeltas,
    VllmMetrics,
    token_buckets,
)
from pagedllm.metrics.frontend.vllm_metrics import TPOT_BUCKETS as ITL_BUCKETS
from pagedllm.metrics.stats import EngineStats

# As vLLM: no `_created` series, which dashboards do not use and which double the output.
disable_created_metrics()

PREFIX = "pagedllm:"


@dataclass
class _EngineSeries:
    """One engine core's children of the per-engine metrics."""

    num_requests_running: Gauge
    num_requests_waiting: Gauge
    kv_cache_usage: Gauge
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    prompt_tokens_computed: Counter
    num_preemptions: Counter
    engine_stalled: Gauge
    engine_restarts: Counter
    spec_decode_num_drafts: Counter
    spec_decode_num_draft_tokens: Counter
    spec_decode_num_accepted_tokens: Counter
    last_stats: EngineStats | None = None  # the core's previous snapshot (counter deltas)
    lora_labels: tuple[str, ...] | None = None  # its current lora_requests_info series


@dataclass
class _TenantSeries:
    """One tenant's children of the per-tenant metrics (looked up once, not per token)."""

    prompt_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue_time: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram


class PrometheusMetrics(TimelineSink):
    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        num_engines: int = 1,
        max_loras: int | None = None,
        cache_info: dict[str, str] | None = None,
    ) -> None:
        """`max_loras`: the engine's, when it runs with LoRA (None: no LoRA metrics);
        `cache_info`: `vllm:cache_config_info`'s labels (`vllm_metrics.cache_config_labels`;
        None: no such series). The dashboard's time series `follow` its timelines."""
        super().__init__()
        self.registry = CollectorRegistry()
        self._vllm = VllmMetrics(self.registry, model_name, max_model_len, num_engines, cache_info)
        labels = ["model_name"]
        engine_labels = [*labels, "engine"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, engine_labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, engine_labels, registry=self.registry)

        per_engine = {
            "num_requests_running": gauge("num_requests_running", "Requests in model steps."),
            "num_requests_waiting": gauge("num_requests_waiting", "Requests waiting to run."),
            "kv_cache_usage": gauge("kv_cache_usage_perc", "KV-cache usage (1 means 100%)."),
            "prefix_cache_queries": counter("prefix_cache_queries", "Tokens looked up."),
            "prefix_cache_hits": counter("prefix_cache_hits", "Tokens served from the cache."),
            "prompt_tokens_computed": counter(
                "prompt_tokens_computed",
                "Prompt tokens run through the model (not served from the prefix cache or a "
                "KV tier).",
            ),
            "num_preemptions": counter("num_preemptions", "Preemptions by the scheduler."),
            "engine_stalled": gauge(
                "engine_stalled",
                "1 while the engine core owes outputs and has sent none for "
                "--engine-iteration-timeout seconds.",
            ),
            "engine_restarts": counter(
                "engine_restarts",
                "Engine cores started after one failed (--restart-on-engine-failure)",
            ),
            "spec_decode_num_drafts": counter(
                "spec_decode_num_drafts", "Speculative drafts verified (one request, one step)."
            ),
            "spec_decode_num_draft_tokens": counter(
                "spec_decode_num_draft_tokens", "Speculative draft tokens verified."
            ),
            "spec_decode_num_accepted_tokens": counter(
                "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."
            ),
        }
        self._accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted, by position in the draft.",
            [*engine_labels, "position"],
            registry=self.registry,
        )
        # KV tiers: one series per `KVTierStats` counter (created when first reported).
        self._kv_tier_events = Counter(
            PREFIX + "kv_tier_events",
            "KV tier counters: blocks saved to / loaded from host memory, written to / read "
            "from disk, failed reads, swaps, blocks and requests sent to / received from a "
            "peer (seconds for send_seconds).",
            [*engine_labels, "event"],
            registry=self.registry,
        )
        self._model_name = model_name
        self._max_loras = max_loras
        self._lora_info = None
        if max_loras is not None:
            self._lora_info = Gauge(
                PREFIX + "lora_requests_info",
                "Running stats on lora requests: adapters with running and waiting requests "
                "(the value: when last updated, Unix time).",
                [*engine_labels, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )
        # Every core's series exist from the start (a stall gauge at 0, restarts at 0).
        self._engines = [
            self._engine_series(per_engine, str(index)) for index in range(num_engines)
        ]
        self._by_tenant: dict[str, _TenantSeries] = {}
        tenant_labels = [*labels, "tenant"]

        def per_tenant_counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*tenant_labels, *extra], registry=self.registry)

        def per_tenant_histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(
                PREFIX + name, doc, tenant_labels, buckets=buckets, registry=self.registry
            )

        lengths = token_buckets(max_model_len)
        self._per_tenant = {
            "prompt_tokens": per_tenant_counter(
                "prompt_tokens", "Prompt tokens of started sequences."
            ),
            "generation_tokens": per_tenant_counter("generation_tokens", "Generated tokens."),
            "ttft": per_tenant_histogram(
                "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
            ),
            "itl": per_tenant_histogram(
                "inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS
            ),
            "tpot": per_tenant_histogram(
                "request_time_per_output_token_seconds", "Time per output token.", ITL_BUCKETS
            ),
            "e2e": per_tenant_histogram(
                "e2e_request_latency_seconds", "End-to-end latency.", LATENCY_BUCKETS
            ),
            "queue_time": per_tenant_histogram(
                "request_queue_time_seconds",
                "Time from arrival to first scheduling.",
                LATENCY_BUCKETS,
            ),
            "request_prompt_tokens": per_tenant_histogram(
                "request_prompt_tokens", "Prompt length.", lengths
            ),
            "request_generation_tokens": per_tenant_histogram(
                "request_generation_tokens", "Generated length.", lengths
            ),
        }
        self._request_success = per_tenant_counter(
            "request_success", "Finished sequences by finish reason.", ("finished_reason",)
        )

    # ---- TimelineSink ---------------------------------------------------------------------
    def on_engine_step(self, stats: EngineStats, now: float, engine_index: int) -> None:
        series = self._engines[engine_index]
        self._update_spec_decode(series, stats, str(engine_index))
        self._update_lora_info(series, stats, str(engine_index))
        self._update_kv_tiers(series, stats, str(engine_index))
        deltas = self._update_engine(series, stats)
        self._vllm.on_engine_stats(
            engine_index,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            stats.kv_cache_usage,
            deltas,
        )

    def on_step(
        self,
        outputs: list[EngineCoreOutput],
        stopped: list[str],
        stats: EngineStats,
        now: float,
        engine_index: int = 0,
    ) -> None:
        super().on_step(outputs, stopped, stats, now, engine_index)
        self._vllm.end_step(engine_index)  # the step's tokens, counted by on_tokens

    def on_tokens(
        self, timeline: RequestTimeline | None, num_new: int, gap: float | None, now: float
    ) -> None:
        if timeline is None:
            return
        series = self._series(timeline.tenant)
        engine = timeline.engine_index
        if gap is None:  # the first tokens
            ttft = timeline.time_to_first_token
            series.ttft.observe(ttft)
            series.prompt_tokens.inc(timeline.num_prompt_tokens)
            self._vllm.on_first_tokens(engine, ttft, timeline.num_prompt_tokens)
            # vLLM observes the queue time at the finish; this family at the first token.
            queue_time = timeline.queue_time
            if queue_time is not None:
                series.queue_time.observe(queue_time)
        else:
            for _ in range(num_new):
                series.itl.observe(gap)
        series.generation_tokens.inc(num_new)
        self._vllm.on_generated(engine, num_new, gap)

    def on_finished(self, timeline: RequestTimeline, reason: str, now: float) -> None:
        series = self._series(timeline.tenant)
        times = _finished_times(timeline, now)
        self._request_success.labels(self._model_name, timeline.tenant, reason).inc()
        series.e2e.observe(times.e2e)
        series.request_prompt_tokens.observe(times.num_prompt_tokens)
        series.request_generation_tokens.observe(times.num_generation_tokens)
        if times.time_per_output_token is not None:
            series.tpot.observe(times.time_per_output_token)
        self._vllm.on_finished(timeline.engine_index, reason, times)

    # ---- engine supervision (AsyncLLM's on_stalled and on_restarted) ------------------------
    def on_engine_stalled(self, engine_index: int, stalled: bool) -> None:
        self._engines[engine_index].engine_stalled.set(1 if stalled else 0)

    def on_engine_restarted(self, engine_index: int) -> None:
        series = self._engines[engine_index]
        series.engine_restarts.inc()
        # A new core counts from zero: its first snapshot is no delta of the old core's last.
        series.last_stats = None

    def render(self, tenant: str | None = None) -> bytes:
        """Every series (None), or only `tenant`'s own ones."""
        if tenant is None:
            return generate_latest(self.registry)
        return generate_latest(_TenantView(self.registry, tenant))  # type: ignore[arg-type]

    # ---- internals --------------------------------------------------------------------------
    @staticmethod
    def _update_engine(series: _EngineSeries, stats: EngineStats) -> StepDeltas:
        """Set the core's `pagedllm:` series; returns its counters' deltas for `vllm:`'s."""
        series.num_requests_running.set(stats.num_running_reqs)
        series.num_requests_waiting.set(stats.num_waiting_reqs)
        series.kv_cache_usage.set(stats.kv_cache_usage)
        last = series.last_stats
        deltas = StepDeltas(
            prefix_cache_queries=stats.prefix_cache_queries
            - (last.prefix_cache_queries if last else 0),
            prefix_cache_hits=stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0),
            num_preemptions=stats.num_preemptions - (last.num_preemptions if last else 0),
        )
        series.prefix_cache_queries.inc(deltas.prefix_cache_queries)
        series.prefix_cache_hits.inc(deltas.prefix_cache_hits)
        series.num_preemptions.inc(deltas.num_preemptions)
        series.prompt_tokens_computed.inc(
            stats.num_computed_prompt_tokens - (last.num_computed_prompt_tokens if last else 0)
        )
        series.last_stats = stats
        return deltas

    def _update_kv_tiers(self, series: _EngineSeries, stats: EngineStats, engine: str) -> None:
        if stats.kv_tiers is None:
            return
        last = series.last_stats.kv_tiers if series.last_stats is not None else None
        for event, value in stats.kv_tiers.items():
            delta = value - (last or {}).get(event, 0)
            if delta > 0:
                self._kv_tier_events.labels(self._model_name, engine, event).inc(delta)

    def _update_spec_decode(self, series: _EngineSeries, stats: EngineStats, engine: str) -> None:
        """Speculative decoding's counters advance by what the core counted since last."""
        if stats.spec_decode is None:
            return
        last = series.last_stats
        delta = stats.spec_decode.since(last.spec_decode if last is not None else None)
        series.spec_decode_num_drafts.inc(delta.num_drafts)
        series.spec_decode_num_draft_tokens.inc(delta.num_draft_tokens)
        series.spec_decode_num_accepted_tokens.inc(delta.num_accepted_tokens)
        for position, count in enumerate(delta.num_accepted_tokens_per_pos):
            self._accepted_per_pos.labels(self._model_name, engine, str(position)).inc(count)

    def _update_lora_info(self, series: _EngineSeries, stats: EngineStats, engine: str) -> None:
        """The engine's one `lora_requests_info` series, moved to the step's adapters."""
        if self._lora_info is None:
            return
        labels = (
            self._model_name,
            engine,
            str(self._max_loras),
            _adapter_names(stats.waiting_lora_adapters),
            _adapter_names(stats.running_lora_adapters),
        )
        if series.lora_labels is not None and series.lora_labels != labels:
            self._lora_info.remove(*series.lora_labels)
        series.lora_labels = labels
        self._lora_info.labels(*labels).set(time.time())

    def _engine_series(self, per_engine: dict, engine: str) -> _EngineSeries:
        children = {
            name: metric.labels(self._model_name, engine) for name, metric in per_engine.items()
        }
        return _EngineSeries(**children)

    def _series(self, tenant: str) -> _TenantSeries:
        series = self._by_tenant.get(tenant)
        if series is None:
            children = {
                name: metric.labels(self._model_name, tenant)
                for name, metric in self._per_tenant.items()
            }
            series = self._by_tenant[tenant] = _TenantSeries(**children)
        return series


class _TenantView:
    """A collector of `registry`'s samples labelled with `tenant` (for `generate_latest`,
    which needs only `collect`); a metric with none of them is left out whole."""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self.registry = registry
        self.tenant = tenant

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            samples = [s for s in family.samples if s.labels.get("tenant") == self.tenant]
            if samples:
                own = Metric(family.name, family.documentation, family.type, family.unit)
                own.samples = samples
                yield own


def _finished_times(timeline: RequestTimeline, now: float) -> FinishedTimes:
    return FinishedTimes(
        e2e=now - timeline.arrival_time,
        queue=timeline.queue_time,
        prefill=timeline.prefill_time,
        decode=timeline.decode_time,
        inference=timeline.inference_time,
        time_per_output_token=timeline.time_per_output_token,
        num_prompt_tokens=timeline.num_prompt_tokens,
        num_generation_tokens=timeline.num_generation_tokens,
    )


def _adapter_names(counts: dict[str, int] | None) -> str:
    """Adapters with at least one request, comma-separated in name order."""
    return ",".join(sorted(name for name, count in (counts or {}).items() if count > 0))
