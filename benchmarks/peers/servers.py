"""A server process under test: start it, wait for /health, measure it idle, stop it.

Every engine's server (pagedllm, vLLM, llama-server) answers `GET /health` with 200 once
it can take requests; the time until then is its start-up. Stopping sends SIGTERM to the
server's process group (its workers included), then SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.peers.common import StepError, merged_env, tail


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    port: int
    log: Path
    startup_s: float = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def idle_cpu_percent(self, seconds: float = 1.0) -> float:
        """CPU use of the server and its children over `seconds` (100 = one core busy)."""
        try:
            root = psutil.Process(self.process.pid)
            processes = [root, *root.children(recursive=True)]
            for process in processes:
                process.cpu_percent(None)
            time.sleep(seconds)
            return round(sum(p.cpu_percent(None) for p in processes if p.is_running()), 1)
        except psutil.Error:
            return -1.0

    def stop(self, grace_s: float = 60.0) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def start_server(
    name: str,
    command: list[str],
    port: int,
    log: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 900.0,
) -> Server:
    """Launches `command` in its own process group; returns once /health answers 200."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=merged_env(env),
            start_new_session=True,
        )  # fmt: skip
    server = Server(name, process, port, log)
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise StepError(f"{name} server exited with {process.returncode}; {tail(log)}")
        if healthy(server.base_url):
            server.startup_s = round(time.monotonic() - started, 1)
            return server
        time.sleep(0.5)
    server.stop(grace_s=10)
    raise StepError(f"{name} server not healthy after {timeout_s} s; {tail(log)}")


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False
