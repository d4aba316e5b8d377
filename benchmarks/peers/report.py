"""The side-by-side report: Markdown tables from every JSON file in the results folder.

Reads `run.json` (machine, versions, rates), `ceiling.json`, `install.json`,
`offline_*.json` and `serve_*.json`, so a partial re-run (`--only`, `--skip-serve`) still
reports everything measured so far. Figures are absolute, with ratios ours ÷ peer; an
engine that could not install or run shows why. Achieved model FLOP/s use
`benchmarks.ceiling`'s count (2 × parameters × tokens + logits + attention).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import ceiling
from benchmarks.peers.common import read_json
from benchmarks.peers.install import ENGINES

OURS = "pagedllm"
ENGINE_ORDER = {name: index for index, name in enumerate(ENGINES)}


def cell(text: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def fmt(value: Any, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def ratio(ours: float | None, peer: float | None) -> str:
    return f"{ours / peer:.2f}×" if ours and peer else "n/a"


def records(out: Path, pattern: str) -> list[dict[str, Any]]:
    """The JSON records matching `pattern`, ours first, then in the order engines are listed."""
    found = [r for r in (read_json(p) for p in sorted(out.glob(pattern))) if r]
    return sorted(found, key=lambda r: ENGINE_ORDER.get(r.get("engine"), len(ENGINE_ORDER)))


def ceiling_fraction(record: dict[str, Any], matmul_gflops: float | None) -> str:
    if not matmul_gflops or not record.get("elapsed_s"):
        return "n/a"
    achieved = ceiling.run_flops(record) / record["elapsed_s"] / 1e9
    return f"{achieved:.1f} GFLOP/s = {100 * achieved / matmul_gflops:.0f}%"


def offline_table(out: Path, matmul_gflops: float | None) -> list[str]:
    rows = records(out, "offline_*.json")
    ours = next((r.get("requests_per_s") for r in rows if r["engine"] == OURS), None)
    lines = [
        "## Offline throughput",
        "",
        "| engine | workload | req/s | output tok/s | total tok/s | seconds | rounds (s) "
        "| model FLOP/s, % of matmul ceiling | pagedllm ÷ engine (req/s) | load (1 min) before |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['engine']} | {r.get('workload', '')} | failed: "
                         f"{cell(r['error'])} |||||||| ")  # fmt: skip
            continue
        lines.append(
            f"| {r['engine']} | {r['workload']} | {r['requests_per_s']} | "
            f"{r['output_tokens_per_s']} | {r['total_tokens_per_s']} | {r['elapsed_s']} | "
            f"{r.get('rounds_elapsed_s')} | {ceiling_fraction(r, matmul_gflops)} | "
            f"{ratio(ours, r['requests_per_s'])} | {r.get('load_average_before', 'n/a')} |"
        )
    return lines


SERVE_HEADER = (
    "| engine | req/s sent → done | done / failed | output tok/s | TTFT med / p99 ms "
    "| TPOT med / p99 ms | ITL med / p99 ms | ours ÷ peer: tok/s, TTFT med, TPOT med "
    "| load (1 min) before; idle CPU % of each server |"
)


def serve_row(r: dict[str, Any], ours: dict[str, Any] | None) -> str:
    if r.get("error"):
        return f"| {r['engine']} | {r['rate']} | failed: {cell(r['error'])} |||||||"

    def pair(metric: str) -> str:
        return f"{fmt(r.get(f'median_{metric}_ms'))} / {fmt(r.get(f'p99_{metric}_ms'))}"

    mine = ours or {}
    ratios = ", ".join([
        ratio(mine.get("output_throughput"), r.get("output_throughput")),
        ratio(mine.get("median_ttft_ms"), r.get("median_ttft_ms")),
        ratio(mine.get("median_tpot_ms"), r.get("median_tpot_ms")),
    ])  # fmt: skip
    started = f" (ready in {r['startup_s']} s)" if r.get("startup_s") is not None else ""
    return (
        f"| {r['engine']}{started} | {r['rate']} → {fmt(r.get('request_throughput'), 2)} | "
        f"{r.get('completed')} / {r.get('failed')} | {fmt(r.get('output_throughput'))} | "
        f"{pair('ttft')} | {pair('tpot')} | {pair('itl')} | {ratios} | "
        f"{r.get('load_average_before', 'n/a')}; {cell(r.get('idle_cpu_percent'))} |"
    )


def serve_tables(out: Path) -> list[str]:
    rows = records(out, "serve_*.json")
    lines = ["## Serving (`pagedllm bench serve`, Poisson arrivals)", ""]
    for rate in sorted({r["rate"] for r in rows}, key=float):
        at_rate = [r for r in rows if r["rate"] == rate]
        ours = next((r for r in at_rate if r["engine"] == OURS and not r.get("error")), None)
        workload = next((r.get("workload") for r in at_rate if r.get("workload")), "")
        lines += [f"### {rate} req/s — {workload}", "", SERVE_HEADER, "|---" * 9 + "|"]
        lines += [serve_row(r, ours) for r in at_rate]
        lines.append("")
    lines.append("Latency ratios ours ÷ peer: below 1 means pagedllm is faster.")
    return lines


def context_sections(out: Path) -> list[str]:
    run = read_json(out / "run.json") or {}
    limits = read_json(out / "ceiling.json") or {}
    install = read_json(out / "install.json") or {}
    lines = ["## Machine", ""]
    lines += [f"- {key}: {cell(value)}" for key, value in run.get("machine", {}).items()]
    if limits:
        rate = f"{limits['ceiling_gflops']:.1f} GFLOP/s; by rows per step: {limits['by_rows']}"
        lines.append(f"- fp32 matmul ceiling at the model's shapes: {rate}")
    lines += ["", "## Versions", ""]
    lines += [f"- {key}: {cell(value)}" for key, value in run.get("versions", {}).items()]
    lines += ["", "## Install steps (cache root: " + cell(run.get("peers_dir", "?")) + ")", ""]
    for step, stamp in install.items():
        state = f"failed: {cell(stamp['error'])}" if stamp.get("error") else (
            f"{stamp.get('seconds')} s, finished {stamp.get('finished')}")  # fmt: skip
        lines.append(f"- {step}: {state}")
    if run.get("rates_note"):
        lines += ["", f"Serving rates: {run['rates_note']}"]
    return lines


def commands_section(out: Path) -> list[str]:
    commands = read_json(out / "commands.json") or {}
    lines = ["", "## Commands", "", "```"]
    lines += [f"# {step}\n{command}" for step, command in commands.items()]
    return [*lines, "```"]


def build_report(out: Path) -> str:
    matmul = (read_json(out / "ceiling.json") or {}).get("ceiling_gflops")
    run = read_json(out / "run.json") or {}
    lines = ["# pagedllm vs peer engines, side by side", "", cell(run.get("note", "")), ""]
    lines += [*offline_table(out, matmul), "", *serve_tables(out), ""]
    lines += [*context_sections(out), *commands_section(out)]
    return "\n".join(lines) + "\n"
