"""Serving: every engine's OpenAI-compatible server under the same load at the same rates.

All selected servers are started first (pagedllm serve, vllm serve, llama-server on the
F32 GGUF); then for each request rate, engine after engine, `pagedllm bench serve` sends
the workload file (Poisson arrivals, token-id prompts, EOS ignored) and writes its JSON and
plot. Just before each load, every server's idle CPU is measured and recorded: an idle
server that spins would distort the others, and the report shows it. Results go to
`serve_<engine>_<rate>.json`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers import llamacpp, servers, vllm_peer
from benchmarks.peers.common import OUR_BIN, PeerPaths, Runner, StepError, read_json, write_json
from benchmarks.peers.workload import Workload, bench_serve_command, serve_summary
from pagedllm.utils import free_port

DEFAULT_RATE = 0.8  # req/s, when no offline figure is at hand
RATE_FACTORS = (0.25, 0.9, 1.5)  # low, near saturation, over


@dataclass(frozen=True)
class ServeSettings:
    paths: PeerPaths
    workload: Workload
    plots: Path
    llama_slots: int = 64


def choose_rates(out: Path) -> tuple[list[str], str]:
    """Rates from pagedllm's offline req/s (else the best peer's): low, near, over.

    Returns the rates and a sentence saying where they came from."""
    figures = {}
    for path in sorted(out.glob("offline_*.json")):
        record = read_json(path) or {}
        if record.get("requests_per_s"):
            figures[record["engine"]] = record["requests_per_s"]
    if "pagedllm" in figures:
        source, reference = "pagedllm's offline", figures["pagedllm"]
    elif figures:
        source, reference = max(figures.items(), key=lambda item: item[1])
        source = f"{source}'s offline"
    else:
        source, reference = "the default", DEFAULT_RATE
    rates = [f"{factor * reference:.2g}" for factor in RATE_FACTORS]
    return rates, f"{', '.join(rates)} req/s = {RATE_FACTORS} × {source} {reference} req/s"


def server_command(
    engine: str, s: ServeSettings, port: int
) -> tuple[list[str], dict[str, str] | None]:
    if engine == "pagedllm":
        command = [str(OUR_BIN / "pagedllm"), "serve", "--host", "127.0.0.1", "--port",
                   str(port), "--dtype", "float32", "--disable-uvicorn-access-log"]  # fmt: skip
        return command, None
    if engine == "vllm":
        return vllm_peer.serve_command(s.paths, port), vllm_peer.VLLM_ENV
    if engine == "llamacpp":
        context = s.workload.input_len + s.workload.output_len + 64
        command = llamacpp.server_command(s.paths, s.paths.gguf_f32, port, s.llama_slots, context)
        return command, None
    raise StepError(f"no server for {engine}")


def start_all(
    engines: list[str], s: ServeSettings, runner: Runner, errors: dict[str, str]
) -> dict[str, servers.Server]:
    """Starts each engine's server; an engine that fails to start gets its reason in
    `errors`. In dry-run mode the commands are only printed."""
    running: dict[str, servers.Server] = {}
    for engine in engines:
        port = free_port()
        command, env = server_command(engine, s, port)
        runner.note(f"serve {engine} server", command, env)
        print(f"== start {engine} server\n$ {' '.join(command)} &", flush=True)
        if runner.dry_run:
            continue
        log = s.paths.run_logs / f"serve_{engine}_server.log"
        try:
            running[engine] = servers.start_server(engine, command, port, log, env)
            print(f"   healthy after {running[engine].startup_s} s", flush=True)
        except (StepError, OSError) as error:
            print(f"   failed: {error}", flush=True)
            errors[engine] = str(error)
    return running


def load_one(
    engine: str, rate: str, s: ServeSettings, runner: Runner,
    running: dict[str, servers.Server],
) -> dict[str, Any]:  # fmt: skip
    """One `bench serve` run against one server; returns the record for its JSON file."""
    out = s.paths.out / "raw" / f"serve_{engine}_{rate}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    server = running.get(engine)
    base_url = server.base_url if server else "http://127.0.0.1:PORT"
    command = bench_serve_command(base_url, s.workload, rate, out, s.plots / f"{engine}_{rate}.png")
    record: dict[str, Any] = {"engine": engine, "rate": rate, "workload": s.workload.describe()}
    if server:
        record["load_average_before"] = round(os.getloadavg()[0], 2)
        record["idle_cpu_percent"] = {n: x.idle_cpu_percent() for n, x in running.items()}
        record["startup_s"] = server.startup_s
    print(f"== serve {engine} at {rate} req/s", flush=True)
    try:
        log = s.paths.run_logs / f"serve_{engine}_{rate}.log"
        runner.run(f"serve {engine} {rate}", command, log)
    except StepError as error:
        return {**record, "error": str(error)}
    report = read_json(out)
    if not runner.dry_run and not report:
        return {**record, "error": f"bench serve wrote no report at {out}"}
    return {**record, **serve_summary(report or {})}


def run_serving(
    engines: list[str], rates: list[str], s: ServeSettings, runner: Runner,
    not_ready: dict[str, str | None],
) -> None:  # fmt: skip
    """Starts the servers, runs every rate across every engine, stops the servers."""
    errors = {e: why for e, why in not_ready.items() if why and e in engines}
    running = start_all([e for e in engines if e not in errors], s, runner, errors)
    try:
        for rate in rates:
            for engine in engines:
                if engine in errors:
                    record = {"engine": engine, "rate": rate, "error": errors[engine]}
                else:
                    record = load_one(engine, rate, s, runner, running)
                if not runner.dry_run:
                    write_json(s.paths.out / f"serve_{engine}_{rate}.json", record)
    finally:
        for server in running.values():
            server.stop()
