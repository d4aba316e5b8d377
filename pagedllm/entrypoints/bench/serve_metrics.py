"""Metrics of `pagedllm bench serve`, computed from what the client recorded per request.

Owns `RequestOutcome` (one request's timestamps, token counts and error) and the pure
functions that turn a list of them into the report: TTFT, ITL, TPOT, E2EL and their
summaries, throughputs, goodput against SLOs, and output tokens/s per second of the run.
Nothing here does I/O or reads a clock, so every number can be checked on synthetic data.

Times are seconds on the run's clock (0 = start of the run); summaries are in ms, as vLLM.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
# The SLOs --goodput accepts, each a bound in ms on the metric of the same name.
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestOutcome:
    """One request as the client saw it. `error` is empty when the request succeeded."""

    send_time: float
    end_time: float
    chunk_times: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error


def ttft(outcome: RequestOutcome) -> float | None:
    """Time to first token: first content chunk − send; None when no content came."""
    if not outcome.chunk_times:
        return None
    return outcome.chunk_times[0] - outcome.send_time


def itls(outcome: RequestOutcome) -> list[float]:
    """Inter-token latencies: the gaps between consecutive content chunks."""
    times = outcome.chunk_times
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def e2el(outcome: RequestOutcome) -> float:
    return outcome.end_time - outcome.send_time


def tpot(outcome: RequestOutcome) -> float | None:
    """Time per output token after the first: (E2EL − TTFT) / (output tokens − 1)."""
    first = ttft(outcome)
    if first is None or outcome.output_tokens < 2:
        return None
    return (e2el(outcome) - first) / (outcome.output_tokens - 1)


def summarize(values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean, median, std and the given percentiles (numpy's linear) of seconds, in ms.

    All zeros when there are no values (every request failed), so a report always has
    the same keys."""
    data = np.asarray(values_s, dtype=float) * 1000 if len(values_s) else np.zeros(1)
    summary = {
        "mean": float(np.mean(data)),
        "median": float(np.median(data)),
        "std": float(np.std(data)),
    }
    for q in percentiles:
        summary[f"p{_percentile_name(q)}"] = float(np.percentile(data, q))
    return summary


def _percentile_name(q: float) -> str:
    # 99 -> "99", 99.9 -> "99.9": the key names vLLM writes.
    return str(int(q)) if float(q).is_integer() else str(q)


def metric_values(outcomes: Sequence[RequestOutcome], metric: str) -> list[float]:
    """Every value of `metric` over the successful requests (ITL: all gaps, pooled)."""
    done = [o for o in outcomes if o.success]
    if metric == "itl":
        return [gap for o in done for gap in itls(o)]
    functions = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    if metric not in functions:
        raise ValueError(f"metric {metric!r} is unknown; choose from {', '.join(METRICS)}")
    values = (functions[metric](o) for o in done)
    return [v for v in values if v is not None]


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (ms bounds)."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        name, sep, value = spec.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"goodput: {spec!r} is not METRIC:MS, METRIC one of {', '.join(GOODPUT_METRICS)}"
            )
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(f"goodput: {spec!r}: {value!r} is not a number of ms") from None
        if not bound > 0 or math.isinf(bound):
            raise ValueError(f"goodput: {spec!r}: the bound must be a positive number of ms")
        slos[name] = bound
    return slos


def meets_slos(outcome: RequestOutcome, slos: dict[str, float]) -> bool:
    """A successful request whose every metric named in `slos` is within its bound (ms).

    A one-token answer has no TPOT and counts as meeting a TPOT bound, as in vLLM."""
    if not outcome.success:
        return False
    values = {"ttft": ttft(outcome), "tpot": tpot(outcome), "e2el": e2el(outcome)}
    for name, bound_ms in slos.items():
        value = values[name]
        if name == "ttft" and value is None:
            return False
        if value is not None and value * 1000 > bound_ms:
            return False
    return True


def send_rate(outcomes: Sequence[RequestOutcome]) -> float | None:
    """Requests sent per second between the first and the last send: the arrival rate the
    run achieved, to compare with --request-rate. None with fewer than two distinct sends."""
    sends = sorted(o.send_time for o in outcomes)
    if len(sends) < 2 or sends[-1] <= sends[0]:
        return None
    return (len(sends) - 1) / (sends[-1] - sends[0])


def token_rate_series(
    outcomes: Sequence[RequestOutcome], duration: float, bucket_s: float = 1.0
) -> list[float]:
    """Output tokens/s in each `bucket_s` slice of the run, from the content-chunk times.

    A chunk weighs output_tokens / chunks of its request, so the buckets add up to the
    output tokens even when a server packs several tokens into a chunk. The last slice is
    divided by the part of it the run lasted, so a short tail does not read as a slowdown."""
    count = max(1, math.ceil(duration / bucket_s))
    tokens = [0.0] * count
    for outcome in outcomes:
        if not outcome.success or not outcome.chunk_times:
            continue
        weight = outcome.output_tokens / len(outcome.chunk_times)
        for time in outcome.chunk_times:
            tokens[min(count - 1, max(0, int(time // bucket_s)))] += weight
    last = duration - (count - 1) * bucket_s
    widths = [bucket_s] * (count - 1) + [last if last > 0 else bucket_s]
    return [n / width for n, width in zip(tokens, widths, strict=True)]


def compute_metrics(
    outcomes: Sequence[RequestOutcome],
    duration: float,
    slos: dict[str, float],
    percentile_metrics: Sequence[str],
    percentiles: Sequence[float],
) -> dict[str, float | int | None]:
    """The run's summary with vLLM's key names: counts, throughputs, goodput and, for each
    of `percentile_metrics`, mean_/median_/std_/p{q}_{metric}_ms."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    done = [o for o in outcomes if o.success]
    input_tokens = sum(o.prompt_tokens for o in done)
    output_tokens = sum(o.output_tokens for o in done)
    result: dict[str, float | int | None] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "request_send_rate": send_rate(outcomes),
        "request_goodput": (
            sum(meets_slos(o, slos) for o in outcomes) / duration if slos else None
        ),
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    for metric in percentile_metrics:
        summary = summarize(metric_values(outcomes, metric), percentiles)
        result.update({f"{stat}_{metric}_ms": value for stat, value in summary.items()})
    return result


def per_request_arrays(outcomes: Sequence[RequestOutcome]) -> dict[str, list]:
    """Per-request values in request order (seconds; None where a request has none)."""
    return {
        "send_times": [o.send_time for o in outcomes],
        "ttfts": [ttft(o) if o.success else None for o in outcomes],
        "itls": [itls(o) if o.success else [] for o in outcomes],
        "tpots": [tpot(o) if o.success else None for o in outcomes],
        "e2els": [e2el(o) if o.success else None for o in outcomes],
        "input_lens": [o.prompt_tokens for o in outcomes],
        "output_lens": [o.output_tokens if o.success else 0 for o in outcomes],
        "errors": [o.error for o in outcomes],
    }
