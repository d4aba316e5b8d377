"""The `vllm:` metric family: vLLM's names, types, labels and buckets, fed by the same request
timelines as the `pagedllm:` family (no server: the metrics are driven step by step)."""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.config import CacheConfig
from pagedllm.core.messages import EngineCoreOutput
from pagedllm.metrics.frontend.prometheus import PrometheusMetrics
from pagedllm.metrics.frontend.vllm_metrics import cache_config_labels
from pagedllm.metrics.stats import EngineStats

# Every series vLLM's Grafana dashboard queries: the `vllm:` names in the `expr` of each panel
# target of examples/online_serving/prometheus_grafana/grafana.json, vllm-project/vllm at
# commit 004f771f3a6b49597546b05c7d83686d1e121fa0 (v0.10 series; its `model_name` variable
# reads `label_values({__name__=~"vllm:.*"}, model_name)`, so each also needs that label).
DASHBOARD_METRICS = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)

# vLLM's types (vllm/v1/metrics/loggers.py, v0.10), for every `vllm:` family exported here.
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:time_per_prefill_token_request_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
}
# vLLM's fixed buckets.
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
CACHE = CacheConfig(block_size=16, num_blocks=65, kv_cache_memory=1 << 20)


def stats(running: int = 1) -> EngineStats:
    return EngineStats(running, 0, 0, 4, 0.25, 2, 0, 8, 4)


def served_two_requests() -> PrometheusMetrics:
    """Two data-parallel cores: alice's request runs on core 0 (queued 0.1 s, first token
    0.5 s after arrival, last 1.0 s later, 4 tokens), bob's on core 1 (one token)."""
    metrics = PrometheusMetrics("m", 64, num_engines=2, cache_info=cache_config_labels(CACHE))
    metrics.on_request_added("a", 100.0, 4, "alice")
    metrics.on_request_added("b", 100.0, 3, "bob")
    first = EngineCoreOutput("a", [1], False, first_scheduled_time=100.1)
    metrics.on_step([first], [], stats(), 100.5, engine_index=0)
    metrics.on_step([EngineCoreOutput("a", [2, 3], False)], [], stats(), 101.0, engine_index=0)
    last = EngineCoreOutput("a", [4], True, finish_reason="length")
    metrics.on_step([last], [], stats(0), 101.5, engine_index=0)
    only = EngineCoreOutput("b", [7], True, finish_reason="stop", first_scheduled_time=100.2)
    metrics.on_step([only], [], stats(0), 100.3, engine_index=1)
    return metrics


def samples(metrics: PrometheusMetrics, tenant: str | None = None) -> dict:
    """(sample name, labels as a sorted tuple) -> value, for the `vllm:` family."""
    text = metrics.render(tenant).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:")
    }


def value(metrics: PrometheusMetrics, name: str, engine: str, **labels: str) -> float:
    key = tuple(sorted({"model_name": "m", "engine": engine, **labels}.items()))
    return samples(metrics)[(name, key)]


def renamed(metrics: PrometheusMetrics, family: str) -> dict:
    """`family`'s samples with its name cut off (`_bucket`, `_sum`, `_count` left)."""
    return {
        (name.removeprefix(family), labels): v
        for (name, labels), v in samples(metrics).items()
        if name.startswith(family + "_")
    }


def test_every_metric_vllms_dashboard_queries_is_exported():
    exported = samples(served_two_requests())
    with_model = {name for name, labels in exported if ("model_name", "m") in labels}
    assert not set(DASHBOARD_METRICS) - with_model


def test_vllm_families_have_vllms_types_and_labels():
    text = served_two_requests().render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # The parser drops a counter's `_total` from the family's name.
    vllm = {name: f.type for name, f in families.items() if name.startswith("vllm:")}
    expected = {name.removesuffix("_total") if kind == "counter" else name: kind
                for name, kind in VLLM_TYPES.items()}  # fmt: skip
    assert vllm == expected
    for name, family in families.items():
        if not name.startswith("vllm:"):
            continue
        wanted = {"model_name", "engine"}
        if name == "vllm:cache_config_info":
            wanted = {*cache_config_labels(CACHE), "engine"}
        for sample in family.samples:
            assert set(sample.labels) - {"le", "finished_reason"} == wanted, sample
            assert "tenant" not in sample.labels


def test_histograms_use_vllms_buckets():
    text = served_two_requests().render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def bounds(name: str) -> list[float]:
        return [
            float(s.labels["le"])
            for s in families[name].samples
            if s.name.endswith("_bucket") and s.labels["engine"] == "0"
        ][:-1]  # +Inf

    for phase in ("queue", "prefill", "decode", "inference"):
        assert bounds(f"vllm:request_{phase}_time_seconds") == REQUEST_LATENCY_BUCKETS
    assert bounds("vllm:e2e_request_latency_seconds") == REQUEST_LATENCY_BUCKETS
    assert bounds("vllm:iteration_tokens_total") == ITERATION_TOKENS_BUCKETS
    assert bounds("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50]


def test_request_phases_are_timed_from_the_timeline():
    metrics = served_two_requests()
    sums = {
        phase: value(metrics, f"vllm:request_{phase}_time_seconds_sum", "0")
        for phase in ("queue", "prefill", "decode", "inference")
    }
    for phase in sums:
        assert value(metrics, f"vllm:request_{phase}_time_seconds_count", "0") == 1.0
        assert value(metrics, f"vllm:request_{phase}_time_seconds_count", "1") == 1.0
    e2e = value(metrics, "vllm:e2e_request_latency_seconds_sum", "0")
    assert sums == pytest.approx({"queue": 0.1, "prefill": 0.4, "decode": 1.0, "inference": 1.4})
    assert e2e == pytest.approx(1.5)
    assert sums["prefill"] <= sums["inference"] and sums["decode"] <= sums["inference"]
    assert sums["queue"] + sums["inference"] <= e2e + 1e-9
    # bob's single token: no decode, and its prefill is all of its inference.
    assert value(metrics, "vllm:request_decode_time_seconds_sum", "1") == 0.0
    assert value(metrics, "vllm:request_prefill_time_seconds_sum", "1") == pytest.approx(0.1)
    assert value(metrics, "vllm:time_to_first_token_seconds_sum", "0") == pytest.approx(0.5)
    assert value(metrics, "vllm:request_max_num_generation_tokens_sum", "0") == 4.0


def test_tokens_steps_and_finish_reasons_per_engine():
    metrics = served_two_requests()
    assert value(metrics, "vllm:prompt_tokens_total", "0") == 4.0
    assert value(metrics, "vllm:generation_tokens_total", "0") == 4.0
    assert value(metrics, "vllm:generation_tokens_total", "1") == 1.0
    # Core 0's steps carried 4 prompt + 1, then 2, then 1 tokens.
    assert value(metrics, "vllm:iteration_tokens_total_count", "0") == 3.0
    assert value(metrics, "vllm:iteration_tokens_total_sum", "0") == 8.0
    assert value(metrics, "vllm:time_per_output_token_seconds_count", "0") == 3.0
    assert renamed(metrics, "vllm:inter_token_latency_seconds") == renamed(
        metrics, "vllm:time_per_output_token_seconds"
    )  # one observation, two names
    success = "vllm:request_success_total"
    assert value(metrics, success, "0", finished_reason="length") == 1.0
    assert value(metrics, success, "1", finished_reason="stop") == 1.0
    assert value(metrics, success, "1", finished_reason="abort") == 0.0  # created up front
    assert value(metrics, "vllm:num_requests_running", "0") == 0.0
    assert value(metrics, "vllm:kv_cache_usage_perc", "0") == 0.25
    assert value(metrics, "vllm:gpu_cache_usage_perc", "0") == 0.25
    assert value(metrics, "vllm:prefix_cache_hits_total", "0") == 4.0  # not 4 per step


def test_cache_config_info_is_vllms_info_gauge():
    info = {k: v for k, v in samples(served_two_requests()).items() if "cache_config" in k[0]}
    assert len(info) == 2 and set(info.values()) == {1.0}
    labels = dict(next(iter(info))[1])
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == "65"
    assert labels["enable_prefix_caching"] == "True" and labels["cache_dtype"] == "float32"
    assert (
        cache_config_labels(CacheConfig(16, 9, 1, cache_dtype=torch.bfloat16))["cache_dtype"]
        == "bfloat16"
    )


def test_a_tenant_sees_no_vllm_series():
    metrics = served_two_requests()
    assert not samples(metrics, "alice")
    alice = metrics.render("alice").decode()
    assert "vllm:" not in alice and "pagedllm:generation_tokens_total{" in alice
    assert samples(metrics)  # the admin's view has them


def test_an_abort_before_any_token_is_counted_without_phases():
    metrics = PrometheusMetrics("m", 64)
    metrics.on_request_added("a", 10.0, 2, "default")
    metrics.on_request_aborted(["a"], 12.0)
    assert value(metrics, "vllm:request_success_total", "0", finished_reason="abort") == 1.0
    assert value(metrics, "vllm:e2e_request_latency_seconds_sum", "0") == 2.0
    assert value(metrics, "vllm:request_prefill_time_seconds_count", "0") == 0.0
