"""Both load generators' JSON reports read into one row shape, and the table they make.

`vllm bench serve --save-result` writes one run with `median_<metric>_ms` and
`p99_<metric>_ms` keys; `guidellm run --output kind=json` writes a list of benchmarks, each
with distributions (median, percentiles) per metric. The two tools name things differently:

- TTFT: vLLM's stops at the first streamed chunk with `choices`; GuideLLM's at the first
  chunk with content. Both are the first token when the server sends no chunk before it.
- TPOT (decode time per token, TTFT excluded, `(E2E - TTFT) / (tokens - 1)`): vLLM's
  `tpot`; GuideLLM calls this `inter_token_latency_ms` (its own `time_per_output_token_ms`
  divides the whole latency, TTFT included, by the tokens).
- ITL (the gap between streamed chunks): vLLM only.
"""

from __future__ import annotations

from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")
HEADER = (
    "| tool | load | done / failed | req/s | output tok/s "
    "| TTFT | TPOT | ITL | E2E |\n|---|---|---|---|---|---|---|---|---|"
)


def vllm_row(report: dict[str, Any]) -> dict[str, Any]:
    """One row from a `vllm bench serve` result file."""
    concurrency = report.get("max_concurrency")
    rate = report.get("request_rate")
    load = f"{concurrency} concurrent" if concurrency else f"{rate} req/s"
    row: dict[str, Any] = {
        "tool": "vllm bench serve",
        "load": load,
        "completed": report["completed"],
        "failed": report.get("failed", 0),
        "duration_s": round(report["duration"], 2),
        "requests_per_s": round(report["request_throughput"], 3),
        "output_tokens_per_s": round(report["output_throughput"], 1),
    }
    row["ttft_mean_ms"] = round(report["mean_ttft_ms"], 1)
    for metric in METRICS:
        median = report.get(f"median_{metric}_ms")
        row[f"{metric}_ms"] = None if median is None else _pair(median, report[f"p99_{metric}_ms"])
    return row


def guidellm_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per benchmark in a `guidellm run` JSON report."""
    return [_guidellm_row(benchmark) for benchmark in report["benchmarks"]]


def _guidellm_row(benchmark: dict[str, Any]) -> dict[str, Any]:
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    seconds = benchmark["duration"]
    output_tokens = metrics["output_token_count"]["successful"]["total_sum"]
    latency_s = _successful(metrics, "request_latency")
    return {
        "tool": "guidellm",
        "load": _guidellm_load(benchmark["config"]["strategy"]),
        "completed": totals["successful"],
        "failed": totals["errored"] + totals["incomplete"],
        "duration_s": round(seconds, 2),
        "requests_per_s": round(totals["successful"] / seconds, 3),
        "output_tokens_per_s": round(output_tokens / seconds, 1),
        "ttft_ms": _pair(*_successful(metrics, "time_to_first_token_ms")),
        "ttft_mean_ms": round(metrics["time_to_first_token_ms"]["successful"]["mean"], 1),
        "tpot_ms": _pair(*_successful(metrics, "inter_token_latency_ms")),
        "itl_ms": None,
        "e2el_ms": _pair(1000 * latency_s[0], 1000 * latency_s[1]),
    }


def _guidellm_load(strategy: dict[str, Any]) -> str:
    kind = strategy["type_"]
    if kind == "synchronous":
        return "1 concurrent (synchronous)"
    if kind == "concurrent":
        return f"{strategy['streams']} concurrent"
    if strategy.get("rate") is not None:
        return f"{strategy['rate']} req/s ({kind})"
    return kind


def _successful(metrics: dict[str, Any], name: str) -> tuple[float, float]:
    summary = metrics[name]["successful"]
    return summary["median"], summary["percentiles"]["p99"]


def _pair(median: float, p99: float) -> dict[str, float]:
    return {"median": round(median, 1), "p99": round(p99, 1)}


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table; latencies as median / p99 in ms."""
    lines = [HEADER]
    for row in rows:
        cells = [
            row["tool"], row["load"], f"{row['completed']} / {row['failed']}",
            f"{row['requests_per_s']:.2f}", f"{row['output_tokens_per_s']:.1f}",
            *(_cell(row[f"{metric}_ms"]) for metric in METRICS),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(pair: dict[str, float] | None) -> str:
    return "—" if pair is None else f"{pair['median']:,.0f} / {pair['p99']:,.0f}"
