"""`vllm bench serve` and GuideLLM against `pagedllm serve`, and whether their TTFT is honest.

Starts `pagedllm serve` (the default model, or `--model`) on a free port of 127.0.0.1,
writes the model's tokenizer to a folder (`pagedllm export-tokenizer`: both tools make their
random prompts with it, offline), then
1. after one warm-up request, at low load (one request at a time, `--low-load-prompts`
   each): our own streaming client (`benchmarks.peers.ttft_probe`: time to the first chunk
   and to the first content), then `vllm bench serve --max-concurrency 1`, then GuideLLM's
   synchronous profile; each one's TTFT is set beside the server's own mean over the same
   requests (`vllm:time_to_first_token_seconds` in /metrics, read before and after), a
   floor no honest client goes below;
2. under load: `vllm bench serve` and GuideLLM, each `--num-prompts` requests at
   `--concurrency` in flight.
Both tools: chat endpoint, streaming, `--input-len` random tokens in, `--output-len` out,
EOS ignored (vLLM's at temperature 0; GuideLLM sends no temperature, so the server's default).
The tools live in their own virtualenvs under the peers' cache root (installed on first use,
see benchmarks/peers/install.py). Results: benchmarks/out/load_generators/ (each tool's own
JSON under raw/, `load_generators.json`, `RESULTS-load-generators.md`, also printed).

    .venv/bin/python -m benchmarks.load_generators [--model M] [--num-prompts 32]
        [--input-len 256] [--output-len 64] [--concurrency 8] [--low-load-prompts 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers import guidellm_peer, install, servers, ttft_probe, vllm_peer
from benchmarks.peers.common import (
    DEFAULT_PEERS_DIR,
    REPO,
    PeerPaths,
    Runner,
    StepError,
    read_json,
    write_json,
)
from benchmarks.peers.loadgen_report import guidellm_rows, markdown_table, vllm_row
from pagedllm.utils import free_port

DEFAULT_OUT = REPO / "benchmarks" / "out" / "load_generators"
TOOLS = ("vllm-bench", "guidellm")
PAGEDLLM = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


@dataclass(frozen=True)
class Load:
    """One run of one tool: how many requests, how many in flight."""

    name: str
    prompts: int
    concurrency: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as `pagedllm serve` takes it")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--low-load-prompts", type=int, default=4)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument(
        "--server-threads", type=int, default=None,
        help="OMP_NUM_THREADS for the server (default: torch's, one a core); on cores other "
        "jobs share, one thread avoids waiting at every parallel region for a descheduled one",
    )  # fmt: skip
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    return parser.parse_args()


def start_server(args: argparse.Namespace, paths: PeerPaths) -> servers.Server:
    port = free_port()
    command = [*PAGEDLLM, "serve", *([args.model] if args.model else []), "--host",
               "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
               *args.serve_arg]  # fmt: skip
    print(f"== start pagedllm serve\n$ {' '.join(command)} &", flush=True)
    env = {"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else None
    server = servers.start_server("pagedllm", command, port, paths.run_logs / "server.log", env)
    print(f"   healthy after {server.startup_s} s", flush=True)
    return server


def served_model_name(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as reply:
        return json.load(reply)["data"][0]["id"]


def vllm_bench_command(
    paths: PeerPaths, base_url: str, model: str, tokenizer: Path, load: Load,
    args: argparse.Namespace, out_json: Path,
) -> list[str]:  # fmt: skip
    return [
        *vllm_peer.cli_command(paths), "bench", "serve", "--backend", "openai-chat",
        "--base-url", base_url, "--endpoint", "/v1/chat/completions", "--model", model,
        "--tokenizer", str(tokenizer), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(load.prompts), "--max-concurrency", str(load.concurrency),
        "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(out_json.parent),
        "--result-filename", out_json.name, "--disable-tqdm",
    ]  # fmt: skip


def guidellm_command(
    paths: PeerPaths, base_url: str, model: str, tokenizer: Path, load: Load,
    args: argparse.Namespace, out_json: Path,
) -> list[str]:  # fmt: skip
    profile = (
        "kind=synchronous"
        if load.concurrency == 1
        else f"kind=concurrent,streams={load.concurrency}"
    )
    return guidellm_peer.run_command(
        paths, base_url, model, tokenizer, profile, load.prompts, args.input_len,
        args.output_len, out_json,
    )  # fmt: skip


def run_tool(
    tool: str, load: Load, command: list[str], out_json: Path, paths: PeerPaths, runner: Runner
) -> dict[str, Any]:
    """Runs one tool once; returns its rows (or its error) and the load average before."""
    env = vllm_peer.VLLM_ENV if tool == "vllm-bench" else guidellm_peer.GUIDELLM_ENV
    out_json.unlink(missing_ok=True)
    record: dict[str, Any] = {"tool": tool, "load": load.name,
                              "load_average_before": round(os.getloadavg()[0], 2)}  # fmt: skip
    print(f"== {tool}, {load.name}", flush=True)
    try:
        seconds = runner.run(f"{tool} {load.name}", command,
                             paths.run_logs / f"{tool}_{load.name}.log", env=env)  # fmt: skip
    except StepError as error:
        return {**record, "error": str(error)}
    report = read_json(out_json)
    if not report:
        return {**record, "error": f"{tool} wrote no report at {out_json}"}
    rows = [vllm_row(report)] if tool == "vllm-bench" else guidellm_rows(report)
    return {**record, "seconds": round(seconds, 1), "rows": rows}


def main() -> None:
    args = parse_args()
    paths = PeerPaths(args.peers_dir.expanduser().resolve(), args.out_dir.resolve())
    paths.make_dirs()
    runner = Runner()
    not_ready = install.prepare_load_generators(list(TOOLS), paths, runner)
    tokenizer = paths.out / "tokenizer"
    runner.run("export tokenizer", [*PAGEDLLM, "export-tokenizer", args.model or "",
               str(tokenizer)], paths.run_logs / "export-tokenizer.log")  # fmt: skip
    settings = {key: str(value) if isinstance(value, Path) else value
                for key, value in vars(args).items()}  # fmt: skip
    record: dict[str, Any] = {"machine": machine(), "args": settings, "not_ready": not_ready}
    server = start_server(args, paths)
    try:
        record.update(run_all(args, paths, runner, server, tokenizer, not_ready))
    finally:
        server.stop()
    record["commands"] = runner.commands
    write_json(paths.out / "load_generators.json", record)
    text = report_markdown(record)
    (paths.out / "RESULTS-load-generators.md").write_text(text)
    print(text)


def run_all(
    args: argparse.Namespace, paths: PeerPaths, runner: Runner, server: servers.Server,
    tokenizer: Path, not_ready: dict[str, str | None],
) -> dict[str, Any]:  # fmt: skip
    base_url = server.base_url
    model = served_model_name(base_url)
    low = Load("low", args.low_load_prompts, 1)
    loaded = Load("loaded", args.num_prompts, args.concurrency)
    *prompts, warm_up = ttft_probe.random_prompts(
        tokenizer, args.low_load_prompts + 1, args.input_len
    )
    # A fresh server's first request pays for one-time work; no tool should measure that.
    ttft_probe.stream_chat(base_url, model, warm_up, args.output_len)
    print("== our own client, one request at a time", flush=True)
    before = ttft_probe.server_ttft_totals(base_url)
    probe = ttft_probe.probe(base_url, model, prompts, args.output_len)
    probe["server_ttft_ms_mean"] = ttft_probe.mean_ms_between(
        before, ttft_probe.server_ttft_totals(base_url)
    )
    runs = []
    for load in (low, loaded):
        for tool, make in (("vllm-bench", vllm_bench_command), ("guidellm", guidellm_command)):
            if not_ready[tool]:
                runs.append({"tool": tool, "load": load.name, "error": not_ready[tool]})
                continue
            out_json = paths.out / "raw" / f"{tool}_{load.name}.json"
            out_json.parent.mkdir(parents=True, exist_ok=True)
            command = make(paths, base_url, model, tokenizer, load, args, out_json)
            before = ttft_probe.server_ttft_totals(base_url)
            run = run_tool(tool, load, command, out_json, paths, runner)
            after = ttft_probe.server_ttft_totals(base_url)
            run["server_ttft_ms_mean"] = ttft_probe.mean_ms_between(before, after)
            run["server_requests"] = after[1] - before[1]
            runs.append(run)
    return {"model": model, "server_startup_s": server.startup_s, "probe": probe, "runs": runs}


def machine() -> dict[str, Any]:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile")
    return {
        "cpus": os.cpu_count(),
        "flags": [flag for flag in wanted if flag in flags],
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "time_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def report_markdown(record: dict[str, Any]) -> str:
    """The run as Markdown: machine, TTFT check, both tools' tables, errors."""
    host = record["machine"]
    probe = record["probe"]
    lines = [
        f"# Load generators against pagedllm serve ({host['time_utc']} UTC)",
        "",
        f"CPU flags: {' '.join(host['flags'])}; {host['cpus']} CPUs; load average at start "
        f"{host['load_average_at_start']}. Model: {record['model']}.",
        "",
        "## TTFT at one request in flight (ms)",
        "",
        "The server's mean is its own arrival-to-first-token time over the same requests",
        "(/metrics, read before and after): a floor for what a client can honestly report.",
        "",
        "| measured by | median | mean | server's mean, same requests |",
        "|---|---|---|---|",
        f"| own client, first chunk with choices | {probe['first_chunk_ms_median']} | | |",
        f"| own client, first content token | {probe['first_content_ms_median']} "
        f"| {probe['first_content_ms_mean']} | {probe['server_ttft_ms_mean']} |",
    ]
    rows_by_load: dict[str, list[dict[str, Any]]] = {}
    for run in record["runs"]:
        for row in run.get("rows", []):
            rows_by_load.setdefault(run["load"], []).append(row)
            if run["load"] == "low":
                lines.append(
                    f"| {row['tool']} | {row['ttft_ms']['median']} | {row['ttft_mean_ms']} "
                    f"| {run['server_ttft_ms_mean']} ({run['server_requests']} requests) |"
                )
    lines += ["", f"Largest gap first chunk → first content: {probe['max_gap_ms']} ms."]
    for load, rows in rows_by_load.items():
        lines += ["", f"## {load} load (median / p99 ms)", "", markdown_table(rows)]
    errors = [f"- {run['tool']} ({run['load']}): {run['error']}" for run in record["runs"]
              if "error" in run]  # fmt: skip
    if errors:
        lines += ["", "## Errors", "", *errors]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
