"""Offline throughput of each engine on the workload file, engines alternating by round.

pagedllm: `pagedllm bench throughput`. vLLM: its `LLM` API (`run_vllm_offline.py` in the
vLLM virtualenv). Transformers: padded batches of `generate` (`run_hf_generate.py`).
llama.cpp has no batched offline API: `llama-server` with many slots, every request sent
at once by `pagedllm bench serve --request-rate inf` (on the F32 GGUF, and on the Q4_1
file as `llamacpp-q4_1`). Each run's seconds exclude loading the model. Results go to
`offline_<engine>.json`: the median round, every round, or why the engine could not run.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.peers import llamacpp, models, servers, vllm_peer
from benchmarks.peers.common import OUR_BIN, PeerPaths, Runner, StepError, read_json, write_json
from benchmarks.peers.workload import Workload, as_throughput, bench_serve_command
from pagedllm.utils import free_port

PEERS_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class OfflineSettings:
    paths: PeerPaths
    workload: Workload
    hf_batch_size: int = 64
    llama_slots: int = 64
    q4_num_prompts: int | None = None  # llama.cpp's Q4_1 path is 3-4× slower than the rest

    def workload_for(self, engine: str) -> Workload:
        if engine == "llamacpp-q4_1" and self.q4_num_prompts:
            return replace(
                self.workload, num_prompts=min(self.q4_num_prompts, self.workload.num_prompts)
            )
        return self.workload


def run_pagedllm(s: OfflineSettings, runner: Runner, out: Path) -> None:
    w = s.workload
    command = [
        str(OUR_BIN / "pagedllm"), "bench", "throughput", "--dataset-name", "file",
        "--dataset-path", str(w.path), "--num-prompts", str(w.num_prompts),
        "--dtype", "float32", "--output-json", str(out),
    ]  # fmt: skip
    runner.run("offline pagedllm", command, s.paths.run_logs / "offline_pagedllm.log")


def run_vllm(s: OfflineSettings, runner: Runner, out: Path) -> None:
    command = vllm_peer.offline_command(s.paths, s.workload.path, s.workload.num_prompts, out)
    log = s.paths.run_logs / "offline_vllm.log"
    runner.run("offline vllm", command, log, env=vllm_peer.VLLM_ENV, timeout=1800)


def run_transformers(s: OfflineSettings, runner: Runner, out: Path) -> None:
    command = [
        str(OUR_BIN / "python"), "-P", str(PEERS_DIR / "run_hf_generate.py"),
        "--model", str(s.paths.hf_model), "--workload", str(s.workload.path),
        "--num-prompts", str(s.workload.num_prompts),
        "--batch-size", str(min(s.hf_batch_size, s.workload.num_prompts)),
        "--output-json", str(out),
    ]  # fmt: skip
    runner.run("offline transformers", command, s.paths.run_logs / "offline_transformers.log")


def run_llama_server(
    s: OfflineSettings, runner: Runner, out: Path, engine: str, model: Path
) -> None:
    """llama-server with min(slots, prompts) slots; every prompt sent at once."""
    w = s.workload_for(engine)
    slots = min(s.llama_slots, w.num_prompts)
    port = free_port()
    command = llamacpp.server_command(s.paths, model, port, slots, w.input_len + w.output_len + 64)
    log = s.paths.run_logs / f"offline_{engine}_server.log"
    runner.note(f"offline {engine} server", command)
    print(f"$ {' '.join(command)} &", flush=True)
    raw = out.with_suffix(".serve.json")
    bench = bench_serve_command(f"http://127.0.0.1:{port}", w, "inf", raw)
    if runner.dry_run:
        runner.run(f"offline {engine} load", bench, log.with_name(f"offline_{engine}.log"))
        return
    server = servers.start_server(engine, command, port, log)
    try:
        runner.run(f"offline {engine} load", bench, log.with_name(f"offline_{engine}.log"))
    finally:
        server.stop()
    report = read_json(raw) or {}
    write_json(out, {**as_throughput(report), "startup_s": server.startup_s, "slots": slots})


def run_one(engine: str, s: OfflineSettings, runner: Runner, out: Path) -> None:
    if engine == "pagedllm":
        run_pagedllm(s, runner, out)
    elif engine == "vllm":
        run_vllm(s, runner, out)
    elif engine == "transformers":
        run_transformers(s, runner, out)
    elif engine == "llamacpp":
        run_llama_server(s, runner, out, engine, s.paths.gguf_f32)
    elif engine == "llamacpp-q4_1":
        run_llama_server(s, runner, out, engine, models.q4_1_gguf())
    else:
        raise StepError(f"no offline runner for {engine}")


def attempt(engine: str, s: OfflineSettings, runner: Runner, round_index: int) -> dict[str, Any]:
    """One round of one engine: its throughput report, or {"error": why}."""
    print(f"== offline {engine}, round {round_index + 1}", flush=True)
    out = s.paths.out / "raw" / f"offline_{engine}_r{round_index}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    load = round(os.getloadavg()[0], 2)  # others' work on the cores distorts every figure
    try:
        run_one(engine, s, runner, out)
    except (StepError, OSError) as error:
        print(f"   failed: {error}", flush=True)
        return {"error": str(error)}
    if runner.dry_run:
        return {}
    report = read_json(out)
    if not report or not report.get("num_requests"):
        return {"error": f"{engine}: no completed requests in {out}: {report}"}
    print(f"   {report['requests_per_s']} req/s, {report['output_tokens_per_s']} output tok/s")
    return {**report, "load_average_before": load}


def run_offline(
    engines: list[str], s: OfflineSettings, runner: Runner, rounds: int,
    not_ready: dict[str, str | None],
) -> None:  # fmt: skip
    """Every ready engine, `rounds` times, the order rotated each round; writes results."""
    runs: dict[str, list[dict]] = {e: [] for e in engines if not not_ready.get(e)}
    order = list(runs)
    for round_index in range(rounds):
        for engine in rotated(order, round_index):
            runs[engine].append(attempt(engine, s, runner, round_index))
    if runner.dry_run:
        return
    for engine in engines:
        workload = s.workload_for(engine)
        record = summarize(engine, runs.get(engine, []), not_ready.get(engine), workload)
        write_json(s.paths.out / f"offline_{engine}.json", record)


def rotated(items: list[str], shift: int) -> list[str]:
    """`items` rotated left by `shift`, so each round starts with a different engine."""
    if not items:
        return []
    shift %= len(items)
    return items[shift:] + items[:shift]


def summarize(
    engine: str, runs: list[dict], install_error: str | None, workload: Workload
) -> dict[str, Any]:
    record: dict[str, Any] = {"engine": engine, "workload": workload.describe()}
    if install_error:
        return {**record, "error": install_error}
    good = [r for r in runs if "error" not in r]
    if not good:
        return {**record, "error": runs[-1]["error"] if runs else "did not run"}
    median = statistics.median_low([r["elapsed_s"] for r in good])
    chosen = next(r for r in good if r["elapsed_s"] == median)
    return {**record, **chosen, "rounds_elapsed_s": [r.get("elapsed_s") for r in runs]}
