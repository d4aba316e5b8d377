"""Server start-up: seconds from launching `pagedllm serve` until `/health` answers 200,
and the resident memory of its processes then and after a settle period.

Starts the server on the default model (or `--model`) on 127.0.0.1 and a free port,
polls /health every 50 ms, reads the RSS of the API process (the one launched) and of the
engine-core process (its child) at the first 200 and again `--settle` seconds later (the
KV pool may keep faulting in on idle CPU after the server is ready), stops it, and
repeats. The first run may include a compile of the attention kernel (cold cache); the
others show a warm start.

    .venv/bin/python -m benchmarks.startup [--runs 3] [--settle 20] [--model PATH] [-- serve flags]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import psutil

from pagedllm.utils import free_port


@dataclass
class StartupRun:
    seconds: float
    api_rss_at_ready: int
    core_rss_at_ready: int
    api_rss_settled: int
    core_rss_settled: int


def process_rss(pid: int) -> tuple[int, int]:
    """(API process RSS, summed RSS of its children: the engine core and any workers)."""
    try:
        root = psutil.Process(pid)
        children = root.children(recursive=True)
        api = root.memory_info().rss
    except psutil.Error:
        return 0, 0
    core = 0
    for child in children:
        with contextlib.suppress(psutil.Error):
            core += child.memory_info().rss
    return api, core


def _wait_for_health(process: subprocess.Popen, port: int, timeout_s: float) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return time.perf_counter() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"/health did not answer within {timeout_s} s")


def start_and_measure(command: list[str], port: int, timeout_s: float, settle_s: float):
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        seconds = _wait_for_health(process, port, timeout_s)
        at_ready = process_rss(process.pid)
        time.sleep(settle_s)
        settled = process_rss(process.pid)
        return StartupRun(seconds, *at_ready, *settled)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--settle", type=float, default=20.0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--timeout", type=float, default=300)
    args, extra = parser.parse_known_args()
    extra = [flag for flag in extra if flag != "--"]
    runs = []
    for run in range(args.runs):
        port = free_port()
        command = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), *extra]
        if args.model:
            command += ["--model", args.model]
        r = start_and_measure(command, port, args.timeout, args.settle)
        runs.append(r)
        print(
            f"run {run + 1}: /health after {r.seconds:.2f} s; RSS at ready: API "
            f"{_gb(r.api_rss_at_ready)}, core {_gb(r.core_rss_at_ready)}; after "
            f"{args.settle:.0f} s: API {_gb(r.api_rss_settled)}, core {_gb(r.core_rss_settled)}",
            flush=True,
        )
    seconds = [r.seconds for r in runs]
    print(f"median {statistics.median(seconds):.2f} s, best {min(seconds):.2f} s")
    print(
        "median RSS after settling: API "
        f"{_gb(statistics.median(r.api_rss_settled for r in runs))}, core "
        f"{_gb(statistics.median(r.core_rss_settled for r in runs))}"
    )


if __name__ == "__main__":
    main()
