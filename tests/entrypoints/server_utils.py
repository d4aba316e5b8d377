"""Start `pagedllm serve` as a subprocess on 127.0.0.1 and a free port; stop it afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2 as httpx
from process_guard import dies_with_us

from pagedllm.utils import free_port

STARTUP_TIMEOUT_S = 180.0
API_KEY = "sk-test-key"
MODEL = "SmolLM2-135M-Instruct"  # the default model's served name


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def health(server: RunningServer) -> int:
    """/health's status code, or 0 once the server no longer answers."""
    try:
        return httpx.get(server.base_url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def queue_is_full(server: RunningServer) -> bool:
    """Whether the admission queue (`--max-num-queued-requests`) refuses one more request.
    The probe asks for more tokens than any context holds: refused at the capacity check
    (503) when the queue is full, else refused as invalid (400) before it is admitted, so it
    never takes a place itself. A request stays queued until its first token, so with the
    engine core stopped this tells, without a model step, that requests were admitted (and
    so handed to the engine, in the same step of the server's event loop)."""
    probe = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 1_000_000})
    if probe.status_code == 503 and "--max-num-queued-requests" in probe.text:
        return True
    assert probe.status_code == 400, probe.text
    return False


def shared_server(tmp_path_factory, name: str, args: list[str]) -> Iterator[RunningServer]:
    """A server on `args` with the tests' API key, its log in a fresh `name` folder, for a
    fixture shared by many tests to yield from; it must stop cleanly (its log's tail says
    why not)."""
    log = tmp_path_factory.mktemp(name) / "server.log"
    running = RunningServer(args, log, api_key=API_KEY)
    yield running
    assert running.stop() == 0, running.log()[-20000:]


class RunningServer:
    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--disable-uvicorn-access-log"]
        if api_key:
            command += ["--api-key", api_key]
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PAGEDLLM_DEBUG": "1"}
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=dies_with_us()
        )
        self._wait_healthy()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.base_url + path, headers=self.headers, timeout=60, **kwargs)

    def post(self, path: str, body=None, **kwargs) -> httpx.Response:
        return httpx.post(
            self.base_url + path, json=body, headers=self.headers, timeout=120, **kwargs
        )

    def metric(self, name: str) -> float:
        """One sample of `pagedllm:<name>` from /metrics (the first series with that name)."""
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(f"pagedllm:{name}{{") or line.startswith(f"pagedllm:{name} "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def offline_greedy_texts(model, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """The offline engine's greedy texts (EOS ignored): what a server must answer."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(model))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [output.outputs[0].text for output in outputs]
