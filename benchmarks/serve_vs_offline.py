"""The server against the offline engine on one workload, in one run (default model, fp32).

1. Start-up: time from launching `pagedllm serve` to its first `/health` 200, twice (the
   second start finds every cache warm; `--starts N` for another count).
2. Load: `pagedllm bench serve` with `--num-prompts` random prompts of `--input-len` tokens,
   `--output-len` output tokens each (ignore_eos), `--max-concurrency` in flight.
   The API process's own CPU time (user + system, its engine-core child not included) over
   the load, per output token: what parsing, detokenizing and streaming cost, and less
   sensitive than throughput to other work on shared cores.
3. Offline: `pagedllm bench throughput` on the same prompts with `--max-num-seqs` equal to
   that concurrency, so the difference is the server's own overhead (`--skip-offline`: none).

`--http` and `--loop` are passed to the server (uvicorn's choices: httptools on uvloop by
default, `--http h11 --loop asyncio` for the pure-Python pair), so both can be measured from
one tree; `--out NAME` keeps each run's summary apart.

    .venv/bin/python -m benchmarks.serve_vs_offline [--num-prompts 200 --max-concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from pagedllm.utils import free_port

BIN = Path(sys.executable).parent
OUT = Path(__file__).parent / "out"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--plot", default=str(Path(__file__).parent / "plots" / "serve_16.png"))
    parser.add_argument("--http", default="auto", choices=("auto", "httptools", "h11"))
    parser.add_argument("--loop", default="auto", choices=("auto", "uvloop", "asyncio"))
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument(
        "--starts", type=int, default=2, help="starts timed (the second finds caches warm)"
    )
    parser.add_argument("--out", default="serve_vs_offline", help="summary file's stem in out/")
    return parser.parse_args()


def start_server(
    port: int, log_path: Path, flags: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, float]:
    """Launch the server (with extra `flags`); returns it and the seconds until /health
    answered 200."""
    started = time.monotonic()
    command = [str(BIN / "pagedllm"), "serve", "--port", str(port)]
    command += ["--disable-uvicorn-access-log", *flags]
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"server exited: see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                if reply.status == 200:
                    return server, time.monotonic() - started
        except OSError:
            time.sleep(0.05)


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    server.wait(120)


def workload_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--dataset-seed", "0",
    ]  # fmt: skip


def api_cpu_seconds(server: subprocess.Popen) -> float:
    """The API process's own CPU time so far (its children's is not included)."""
    times = psutil.Process(server.pid).cpu_times()
    return times.user + times.system


def main() -> None:
    args = parse_args()
    OUT.mkdir(exist_ok=True)
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    flags = ("--http", args.http, "--loop", args.loop)
    startups = []
    for attempt in range(args.starts):
        port = free_port()
        server, seconds = start_server(port, OUT / f"serve_start_{attempt}.log", flags)
        startups.append(round(seconds, 2))
        if attempt < args.starts - 1:
            stop_server(server)
    serve_json = OUT / "serve_load.json"
    cpu_before = api_cpu_seconds(server)
    subprocess.run(
        [str(BIN / "pagedllm"), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
         *workload_flags(args), "--max-concurrency", str(args.max_concurrency),
         "--ignore-eos", "--temperature", "1.0", "--prompt-format", "token-ids",
         "--metric-percentiles", "50,90,99", "--output-json", str(serve_json),
         "--plot", args.plot],
        check=True,
    )  # fmt: skip
    api_cpu_s = api_cpu_seconds(server) - cpu_before
    stop_server(server)
    served = json.loads(serve_json.read_text())
    summary = {
        "server_flags": list(flags),
        "load_average": list(os.getloadavg()),  # the cores are shared: what else ran
        "startup_to_health_s": startups,
        "served": {k: v for k, v in served.items() if not isinstance(v, list)},
        "api_process_cpu_s": round(api_cpu_s, 2),
        "api_process_cpu_ms_per_output_token": round(
            1000 * api_cpu_s / served["total_output_tokens"], 3
        ),
    }
    if not args.skip_offline:
        offline = offline_run(args)
        summary["offline"] = offline
        summary["served_over_offline_output_tok_s"] = round(
            served["output_throughput"] / offline["output_tokens_per_s"], 3
        )
    print(json.dumps(summary, indent=2))
    (OUT / f"{args.out}.json").write_text(json.dumps(summary, indent=2))


def offline_run(args: argparse.Namespace) -> dict:
    offline_json = OUT / "serve_offline.json"
    subprocess.run(
        [str(BIN / "pagedllm"), "bench", "throughput", *workload_flags(args),
         "--max-num-seqs", str(args.max_concurrency), "--output-json", str(offline_json)],
        check=True,
    )  # fmt: skip
    return json.loads(offline_json.read_text())


if __name__ == "__main__":
    main()
