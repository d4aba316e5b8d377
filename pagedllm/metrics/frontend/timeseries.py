"""The dashboard's live time series: one sample a second over the last few minutes, in memory.

`TimeSeries` is a `TimelineSink` (in the server it follows `PrometheusMetrics`: it consumes the
same timelines): engine gauges and counters from each step's stats, tokens and latencies from
each sequence's timeline (`metrics.timeline`), failed and aborted sequences from their finish,
and requests refused before they ran (429, 503) from the server's middleware (`rejected`).

Seconds are closed lazily, whenever an event arrives or the samples are read: nothing runs
while nobody looks and nothing happens. A closed second becomes one sample (a JSON-ready
dict) in a deque of fixed length. Each sample holds:

- `running`, `waiting`, `kv_cache_usage`: the highest seen during the second (summed over
  data-parallel cores; KV usage their mean), so a short burst still shows;
- `prompt_tokens_per_s` (prompts of sequences that got their first token, as
  `pagedllm:prompt_tokens`), `prompt_tokens_computed_per_s` (run through the model, prefix
  cache hits left out: the log line's prompt throughput), `generation_tokens_per_s`;
- `prefix_cache_hit_rate`: hits / queries during the second (None without queries);
- `preemptions`, and requests `finished` (served), `failed` (finish reason "error"),
  `aborted`, `rejected` during the second;
- `ttft`, `tpot`: p50 / p90 / p99 (nearest rank) over the sequences whose first token
  (TTFT) or finish (TPOT) fell in the last `latency_window_s` seconds (None: none did);
- `tenants`: per tenant, its tokens/s, requests and TTFT percentiles (tenants seen so far);
- `lora_adapters`: per adapter, the highest running and waiting requests (LoRA on only).

`snapshot(tenant=name)` is one tenant's view: each sample's counts, tokens and TTFT are the
tenant's own, `tenants` holds it alone, and what sums every tenant's work (engine gauges,
computed prompt tokens, prefix-cache hit rate, preemptions, TPOT, adapters) is None or left
out, so that no tenant learns from it how busy the others are.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from pagedllm.metrics.frontend.timeline import RequestTimeline, TimelineSink
from pagedllm.metrics.stats import EngineStats

PERCENTILES = (50, 90, 99)
DEFAULT_WINDOW_S = 300
DEFAULT_LATENCY_WINDOW_S = 30.0


def percentile(ordered: list[float], p: float) -> float:
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def percentiles(values: Iterable[float]) -> dict[str, float] | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return {f"p{p}": percentile(ordered, p) for p in PERCENTILES}


@dataclass
class _Counts:
    """What one tenant (or everyone) did in one second, or since the start."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    rejected: int = 0


@dataclass
class _Gauges:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    lora_adapters: dict[str, list[int]] | None = None  # name -> [running, waiting]

    def raise_to(self, other: _Gauges) -> None:
        self.running = max(self.running, other.running)
        self.waiting = max(self.waiting, other.waiting)
        self.kv_cache_usage = max(self.kv_cache_usage, other.kv_cache_usage)
        if other.lora_adapters is not None:
            mine = self.lora_adapters if self.lora_adapters is not None else {}
            for name, (running, waiting) in other.lora_adapters.items():
                old = mine.get(name, [0, 0])
                mine[name] = [max(old[0], running), max(old[1], waiting)]
            self.lora_adapters = mine


@dataclass
class _Second:
    """The second being counted: [index, index + 1) on the monotonic clock."""

    index: int
    gauges: _Gauges
    total: _Counts = field(default_factory=_Counts)
    tenants: dict[str, _Counts] = field(default_factory=dict)
    prompt_tokens_computed: int = 0
    preemptions: int = 0
    cache_queries: int = 0
    cache_hits: int = 0


class _Latencies:
    """(time, seconds) observations, kept while a sample may still need them."""

    def __init__(self) -> None:
        self._items: deque[tuple[float, float]] = deque()

    def add(self, when: float, value: float) -> None:
        self._items.append((when, value))

    def window(self, start: float, end: float) -> dict[str, float] | None:
        return percentiles(value for when, value in self._items if start <= when < end)

    def forget_before(self, start: float) -> None:
        while self._items and self._items[0][0] < start:
            self._items.popleft()


def _delta(new: int, old: int | None) -> int:
    # A restarted core counts from zero again: its first value is all new.
    if old is None or new < old:
        return new
    return new - old


class TimeSeries(TimelineSink):
    def __init__(
        self,
        window_s: int = DEFAULT_WINDOW_S,
        latency_window_s: float = DEFAULT_LATENCY_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`window_s`: samples kept (one a second); `clock`: the engine's clock (the `now` of
        the observer calls); `wall_clock`: the samples' times."""
        super().__init__()
        self.window_s = window_s
        self.latency_window_s = latency_window_s
        self._clock = clock
        self._wall_offset = wall_clock() - clock()
        self.samples: deque[dict] = deque(maxlen=window_s)
        self.totals = _Counts()
        self._tenant_totals: dict[str, _Counts] = {}
        self.total_preemptions = 0
        self._engines: dict[int, EngineStats] = {}
        self._ttft: dict[str | None, _Latencies] = {None: _Latencies()}  # None: everyone
        self._tpot = _Latencies()
        self._tenants: set[str] = set()
        self._second = _Second(math.floor(clock()), _Gauges())

    # ---- TimelineSink -------------------------------------------------------------------
    def on_timeline_started(self, timeline: RequestTimeline) -> None:
        self._tenants.add(timeline.tenant)

    def on_engine_step(self, stats: EngineStats, now: float, engine_index: int) -> None:
        self._count_engine(self._advance(now), stats, engine_index)

    def on_tokens(
        self, timeline: RequestTimeline | None, num_new: int, gap: float | None, now: float
    ) -> None:
        second = self._advance(now)
        second.total.generation_tokens += num_new
        self.totals.generation_tokens += num_new
        if timeline is None:
            return
        tenant = self._tenant_counts(second, timeline.tenant)
        tenant.generation_tokens += num_new
        tenant_totals = self._totals_of(timeline.tenant)
        tenant_totals.generation_tokens += num_new
        if gap is None:  # the first tokens
            ttft = timeline.time_to_first_token
            self._ttft[None].add(now, ttft)
            self._ttft.setdefault(timeline.tenant, _Latencies()).add(now, ttft)
            for counts in (second.total, tenant, self.totals, tenant_totals):
                counts.prompt_tokens += timeline.num_prompt_tokens

    def on_finished(self, timeline: RequestTimeline, reason: str, now: float) -> None:
        second = self._advance(now)
        outcome = {"error": "failed", "abort": "aborted"}.get(reason, "finished")
        tenant = self._tenant_counts(second, timeline.tenant)
        for counts in (second.total, tenant, self.totals, self._totals_of(timeline.tenant)):
            setattr(counts, outcome, getattr(counts, outcome) + 1)
        time_per_output_token = timeline.time_per_output_token
        if time_per_output_token is not None:
            self._tpot.add(now, time_per_output_token)

    # ---- the server's middleware ----------------------------------------------------------
    def on_request_rejected(self, tenant: str) -> None:
        """A generation request refused before it ran (a 429 or a 503)."""
        second = self._advance(self._clock())
        self._tenants.add(tenant)
        own = self._tenant_counts(second, tenant)
        for counts in (second.total, own, self.totals, self._totals_of(tenant)):
            counts.rejected += 1

    # ---- reading --------------------------------------------------------------------------
    def snapshot(self, since: float | None = None, tenant: str | None = None) -> dict:
        """Every closed second after wall time `since` (all kept ones for None), oldest first,
        with the totals since start-up: everyone's, or `tenant`'s own view of them."""
        self._advance(self._clock())
        samples = [s for s in self.samples if since is None or s["t"] > since]
        totals = {**asdict(self.totals), "preemptions": self.total_preemptions}
        if tenant is not None:
            samples = [_tenant_view(sample, tenant) for sample in samples]
            own = self._tenant_totals.get(tenant, _Counts())
            totals = {**asdict(own), "preemptions": None}
        return {
            "interval_s": 1,
            "window_s": self.window_s,
            "latency_window_s": self.latency_window_s,
            "percentiles": [f"p{p}" for p in PERCENTILES],
            "now": self._clock() + self._wall_offset,
            "totals": totals,
            "samples": samples,
        }

    # ---- internals ------------------------------------------------------------------------
    def _advance(self, now: float) -> _Second:
        """Close every second that ended by `now`; the second `now` falls in (an event from a
        second already closed counts in the current one)."""
        index = math.floor(now)
        if index <= self._second.index:
            return self._second
        # After a long quiet spell only the last window_s seconds can be kept anyway.
        first_missing = max(self._second.index + 1, index - self.window_s)
        self.samples.append(self._close(self._second))
        for missing in range(first_missing, index):
            self.samples.append(self._close(_Second(missing, self._gauges_now())))
        self._second = _Second(index, self._gauges_now())
        forget = index - self.latency_window_s
        for latencies in (*self._ttft.values(), self._tpot):
            latencies.forget_before(forget)
        return self._second

    def _close(self, second: _Second) -> dict:
        end = second.index + 1
        start = end - self.latency_window_s
        gauges = second.gauges
        sample = {
            "t": end + self._wall_offset,
            "running": gauges.running,
            "waiting": gauges.waiting,
            "kv_cache_usage": gauges.kv_cache_usage,
            "prompt_tokens_per_s": second.total.prompt_tokens,
            "prompt_tokens_computed_per_s": second.prompt_tokens_computed,
            "generation_tokens_per_s": second.total.generation_tokens,
            "prefix_cache_hit_rate": (
                second.cache_hits / second.cache_queries if second.cache_queries else None
            ),
            "preemptions": second.preemptions,
            "finished": second.total.finished,
            "failed": second.total.failed,
            "aborted": second.total.aborted,
            "rejected": second.total.rejected,
            "ttft": self._ttft[None].window(start, end),
            "tpot": self._tpot.window(start, end),
            "tenants": {
                tenant: self._tenant_sample(second, tenant, start, end)
                for tenant in sorted(self._tenants)
            },
        }
        if gauges.lora_adapters is not None:
            sample["lora_adapters"] = {
                name: {"running": running, "waiting": waiting}
                for name, (running, waiting) in sorted(gauges.lora_adapters.items())
            }
        return sample

    def _tenant_sample(self, second: _Second, tenant: str, start: float, end: float) -> dict:
        counts = second.tenants.get(tenant, _Counts())
        latencies = self._ttft.get(tenant)
        return {
            "prompt_tokens_per_s": counts.prompt_tokens,
            "generation_tokens_per_s": counts.generation_tokens,
            "finished": counts.finished,
            "failed": counts.failed,
            "aborted": counts.aborted,
            "rejected": counts.rejected,
            "ttft": latencies.window(start, end) if latencies is not None else None,
        }

    def _gauges_now(self) -> _Gauges:
        """The latest step's gauges, summed over the cores (KV usage: their mean)."""
        stats = list(self._engines.values())
        if not stats:
            return _Gauges()
        adapters: dict[str, list[int]] | None = None
        for one in stats:
            if one.running_lora_adapters is None:
                continue
            adapters = adapters if adapters is not None else {}
            for index, counts in enumerate((one.running_lora_adapters, one.waiting_lora_adapters)):
                for name, count in (counts or {}).items():
                    adapters.setdefault(name, [0, 0])[index] += count
        return _Gauges(
            running=sum(one.num_running_reqs for one in stats),
            waiting=sum(one.num_waiting_reqs for one in stats),
            kv_cache_usage=sum(one.kv_cache_usage for one in stats) / len(stats),
            lora_adapters=adapters,
        )

    def _count_engine(self, second: _Second, stats: EngineStats, engine_index: int) -> None:
        last = self._engines.get(engine_index)
        preemptions = _delta(stats.num_preemptions, last and last.num_preemptions)
        second.preemptions += preemptions
        self.total_preemptions += preemptions
        second.prompt_tokens_computed += _delta(
            stats.num_computed_prompt_tokens, last and last.num_computed_prompt_tokens
        )
        second.cache_queries += _delta(
            stats.prefix_cache_queries, last and last.prefix_cache_queries
        )
        second.cache_hits += _delta(stats.prefix_cache_hits, last and last.prefix_cache_hits)
        self._engines[engine_index] = stats
        second.gauges.raise_to(self._gauges_now())

    def _tenant_counts(self, second: _Second, tenant: str) -> _Counts:
        return second.tenants.setdefault(tenant, _Counts())

    def _totals_of(self, tenant: str) -> _Counts:
        return self._tenant_totals.setdefault(tenant, _Counts())


# A sample's fields that sum every tenant's work: shown to admins only.
_SHARED_FIELDS = (
    "running",
    "waiting",
    "kv_cache_usage",
    "prompt_tokens_computed_per_s",
    "prefix_cache_hit_rate",
    "preemptions",
    "tpot",
)


def _tenant_view(sample: dict, tenant: str) -> dict:
    """`sample` as `tenant` may see it: the same fields (the page draws either), its own
    figures in place of everyone's, the shared ones None, no other tenant, no adapters."""
    own = sample["tenants"].get(tenant) or {
        "prompt_tokens_per_s": 0,
        "generation_tokens_per_s": 0,
        "finished": 0,
        "failed": 0,
        "aborted": 0,
        "rejected": 0,
        "ttft": None,
    }
    return {
        "t": sample["t"],
        **dict.fromkeys(_SHARED_FIELDS),
        **own,
        "tenants": {tenant: own},
    }
