"""The dashboard's time series (`pagedllm.metrics.frontend.timeseries`): the samples one known
run of requests and steps gives, second by second, against values worked out by hand."""

from __future__ import annotations

import pytest

from pagedllm.core.messages import EngineCoreOutput
from pagedllm.metrics.frontend.timeseries import TimeSeries, percentile, percentiles
from pagedllm.metrics.stats import EngineStats

WALL_OFFSET = 1_000_000.0  # the samples' wall times are the fake clock's plus this


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def stats(running=0, waiting=0, preemptions=0, computed=0, kv=0.0, queries=0, hits=0, **extra):
    return EngineStats(running, waiting, preemptions, computed, kv, 0, 0, queries, hits, **extra)


def out(request_id: str, tokens: int, finish_reason: str | None = None) -> EngineCoreOutput:
    finished = finish_reason is not None
    return EngineCoreOutput(request_id, list(range(tokens)), finished, finish_reason=finish_reason)


def make_series(clock: FakeClock, window_s: int = 300) -> TimeSeries:
    return TimeSeries(
        window_s=window_s,
        latency_window_s=10.0,
        clock=clock,
        wall_clock=lambda: clock.now + WALL_OFFSET,
    )


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 11)]
    assert [percentile(values, p) for p in (50, 90, 99)] == [5.0, 9.0, 10.0]
    assert percentiles([0.8, 0.5]) == {"p50": 0.5, "p90": 0.8, "p99": 0.8}
    assert percentiles([]) is None


@pytest.fixture
def run():
    """Two tenants' requests over seconds 100 and 101, then a quiet second 102."""
    clock = FakeClock(100.25)
    series = make_series(clock)
    series.on_request_added("a", 100.0, 7, "t1")
    series.on_request_added("b", 100.0, 3, "t2")
    series.on_step([out("a", 1), out("b", 0)], [], stats(2, 1, 0, 10, 0.25, 10, 0), 100.5)
    series.on_step([out("a", 1), out("b", 1)], [], stats(2, 0, 0, 10, 0.5, 10, 0), 100.75)
    series.on_step(
        [out("a", 1, "length"), out("b", 0, "error")], [], stats(0, 0, 1, 15, 0.0, 20, 5), 101.25
    )
    clock.now = 101.5
    series.on_request_rejected("t2")
    series.on_request_added("c", 101.5, 4, "t1")
    series.on_request_aborted(["c"], 101.75)
    clock.now = 103.25
    return series, clock


def test_samples_of_a_known_run(run):
    series, _ = run
    snapshot = series.snapshot()
    busy, ending, quiet = snapshot["samples"]
    latencies = {"p50": 0.5, "p90": 0.75, "p99": 0.75}
    assert busy == {
        "t": WALL_OFFSET + 101,
        "running": 2,
        "waiting": 1,
        "kv_cache_usage": 0.5,
        "prompt_tokens_per_s": 10,  # both prompts: their first tokens came this second
        "prompt_tokens_computed_per_s": 10,
        "generation_tokens_per_s": 3,
        "prefix_cache_hit_rate": 0.0,
        "preemptions": 0,
        "finished": 0,
        "failed": 0,
        "aborted": 0,
        "rejected": 0,
        "ttft": latencies,  # 0.5 s (a) and 0.75 s (b)
        "tpot": None,
        "tenants": {
            "t1": tenant_sample(7, 2, ttft={"p50": 0.5, "p90": 0.5, "p99": 0.5}),
            "t2": tenant_sample(3, 1, ttft={"p50": 0.75, "p90": 0.75, "p99": 0.75}),
        },
    }
    # a ends (length): 3 tokens from 100.5 to 101.25, 0.375 s apart; b fails; c is aborted.
    assert ending["t"] == WALL_OFFSET + 102
    assert (ending["running"], ending["waiting"], ending["kv_cache_usage"]) == (2, 0, 0.5)
    assert ending["prompt_tokens_computed_per_s"] == 5
    assert ending["generation_tokens_per_s"] == 1
    assert ending["prefix_cache_hit_rate"] == 0.5
    assert ending["preemptions"] == 1
    counts = [ending[k] for k in ("finished", "failed", "aborted", "rejected")]
    assert counts == [1, 1, 1, 1]
    assert ending["ttft"] == latencies
    assert ending["tpot"] == {"p50": 0.375, "p90": 0.375, "p99": 0.375}
    assert ending["tenants"]["t1"] == tenant_sample(0, 1, finished=1, aborted=1, ttft={
        "p50": 0.5, "p90": 0.5, "p99": 0.5})  # fmt: skip
    assert ending["tenants"]["t2"]["failed"] == ending["tenants"]["t2"]["rejected"] == 1
    # Nothing ran: the gauges fall to the last step's, the latencies stay in their window.
    assert (quiet["running"], quiet["kv_cache_usage"], quiet["generation_tokens_per_s"]) == (
        0, 0.0, 0)  # fmt: skip
    assert quiet["prefix_cache_hit_rate"] is None
    assert quiet["ttft"] == latencies and quiet["tpot"]["p50"] == 0.375
    assert snapshot["totals"] == {
        "prompt_tokens": 10,
        "generation_tokens": 4,
        "finished": 1,
        "failed": 1,
        "aborted": 1,
        "rejected": 1,
        "preemptions": 1,
    }
    assert "lora_adapters" not in busy  # LoRA off: no adapter series


def tenant_sample(prompt, generation, finished=0, failed=0, aborted=0, rejected=0, ttft=None):
    return {
        "prompt_tokens_per_s": prompt,
        "generation_tokens_per_s": generation,
        "finished": finished,
        "failed": failed,
        "aborted": aborted,
        "rejected": rejected,
        "ttft": ttft,
    }


def test_since_and_the_window(run):
    series, clock = run
    assert [s["t"] for s in series.snapshot(since=WALL_OFFSET + 101)["samples"]] == [
        WALL_OFFSET + 102,
        WALL_OFFSET + 103,
    ]
    snapshot = series.snapshot(since=WALL_OFFSET + 103)
    assert snapshot["samples"] == [] and snapshot["now"] == WALL_OFFSET + 103.25
    clock.now = 1000.5  # long after: only the last window_s seconds are kept, all quiet
    samples = series.snapshot()["samples"]
    assert len(samples) == 300
    assert samples[0]["t"] == WALL_OFFSET + 701 and samples[-1]["t"] == WALL_OFFSET + 1000
    assert all(s["ttft"] is None and s["generation_tokens_per_s"] == 0 for s in samples)


def test_engines_add_up_and_a_restarted_core_counts_from_zero():
    clock = FakeClock(10.0)
    series = make_series(clock)
    series.on_step([], [], stats(2, 1, preemptions=5, kv=0.2), 10.1, engine_index=0)
    series.on_step([], [], stats(3, 0, preemptions=1, kv=0.4), 10.2, engine_index=1)
    series.on_step([], [], stats(2, 1, preemptions=2, kv=0.2), 10.3, engine_index=0)  # restarted
    clock.now = 11.0
    (sample,) = series.snapshot()["samples"]
    assert (sample["running"], sample["waiting"]) == (5, 1)
    assert sample["kv_cache_usage"] == pytest.approx(0.3)
    assert sample["preemptions"] == 5 + 1 + 2


def test_lora_adapters_running_and_waiting():
    clock = FakeClock(10.0)
    series = make_series(clock)
    lora = {"running_lora_adapters": {"a": 1}, "waiting_lora_adapters": {"b": 2}, "max_loras": 2}
    series.on_step([], [], stats(1, 2, **lora), 10.5)
    clock.now = 11.0
    (sample,) = series.snapshot()["samples"]
    assert sample["lora_adapters"] == {
        "a": {"running": 1, "waiting": 0},
        "b": {"running": 0, "waiting": 2},
    }


def test_parallel_samples_are_timed_as_their_parent():
    clock = FakeClock(10.0)
    series = make_series(clock)
    series.on_request_added("p", 10.0, 5, "t")
    series.on_step([out("p#0", 1), out("p#1", 1)], [], stats(2), 10.25)
    series.on_step([out("p#0", 1, "stop"), out("p#1", 0)], ["p#1"], stats(0), 10.75)
    clock.now = 11.0
    (sample,) = series.snapshot()["samples"]
    assert sample["ttft"] == {"p50": 0.25, "p90": 0.25, "p99": 0.25}
    assert sample["finished"] == 2 and sample["prompt_tokens_per_s"] == 10
    assert sample["tpot"] == {"p50": 0.5, "p90": 0.5, "p99": 0.5}  # p#0: 2 tokens, 0.5 s apart
    assert not series.timelines.open  # the parent is forgotten with its last sample


def test_a_parallel_request_aborted_before_its_samples_start():
    clock = FakeClock(10.0)
    series = make_series(clock)
    series.on_request_added("p", 10.0, 5, "t")
    series.on_request_aborted(["p#0", "p#1"], 10.5)
    clock.now = 11.0
    (sample,) = series.snapshot()["samples"]
    assert sample["aborted"] == 1 and not series.timelines.open


def test_a_tenant_sees_its_own_figures_alone(run):
    """`snapshot(tenant=...)`: the tenant's counts in place of everyone's, the fields that sum
    every tenant's work None, no other tenant anywhere."""
    series, _ = run
    everyone = series.snapshot()
    snapshot = series.snapshot(tenant="t2")
    busy, ending, _quiet = snapshot["samples"]
    assert set(busy) == set(everyone["samples"][0])  # the page draws either
    t2_ttft = {"p50": 0.75, "p90": 0.75, "p99": 0.75}
    assert busy["tenants"] == {"t2": tenant_sample(3, 1, ttft=t2_ttft)}
    assert (busy["prompt_tokens_per_s"], busy["generation_tokens_per_s"]) == (3, 1)
    assert busy["ttft"] == t2_ttft
    shared = ("running", "waiting", "kv_cache_usage", "prompt_tokens_computed_per_s",
              "prefix_cache_hit_rate", "preemptions", "tpot")  # fmt: skip
    assert all(sample[name] is None for sample in snapshot["samples"] for name in shared)
    counts = [ending[k] for k in ("finished", "failed", "aborted", "rejected")]
    assert counts == [0, 1, 0, 1]
    assert snapshot["totals"] == {
        "prompt_tokens": 3,
        "generation_tokens": 1,
        "finished": 0,
        "failed": 1,
        "aborted": 0,
        "rejected": 1,
        "preemptions": None,
    }
    assert "t1" not in str(snapshot)
    nobody = series.snapshot(tenant="t9")
    assert nobody["totals"]["finished"] == 0
    assert all(set(sample["tenants"]) == {"t9"} for sample in nobody["samples"])
