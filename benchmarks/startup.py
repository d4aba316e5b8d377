"""Server start-up: seconds from launching `pagedllm serve` until `/health` answers 200.

Starts the server on the default model (or `--model`) on 127.0.0.1 and a free port,
polls /health every 50 ms, stops it, and repeats. The first run may include a compile of
the attention kernel (cold cache); the others show a warm start.

    .venv/bin/python -m benchmarks.startup [--runs 3] [--model PATH] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

from pagedllm.utils import free_port


def time_to_health(command: list[str], port: int, timeout_s: float) -> float:
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
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
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--timeout", type=float, default=300)
    args, extra = parser.parse_known_args()
    extra = [flag for flag in extra if flag != "--"]
    seconds = []
    for run in range(args.runs):
        port = free_port()
        command = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), *extra]
        if args.model:
            command += ["--model", args.model]
        seconds.append(time_to_health(command, port, args.timeout))
        print(f"run {run + 1}: /health after {seconds[-1]:.2f} s", flush=True)
    print(f"median {statistics.median(seconds):.2f} s, best {min(seconds):.2f} s")


if __name__ == "__main__":
    main()
