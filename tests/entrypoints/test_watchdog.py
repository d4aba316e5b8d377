"""Engine supervision and shutdown on a tiny model: a frozen core (SIGSTOP) is reported and
recovers; with --restart-on-engine-failure a frozen or killed core is replaced, in-flight
requests end with an OpenAI error and the next one is served; a core stopped while it
restarts is killed at --engine-startup-timeout and another started, and when every attempt
fails (at --engine-restart-timeout) the server says why and exits 1; a drain that times out
ends every request in OpenAI's shape; SIGTERM to the whole process group drains and exits
0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from functools import partial
from pathlib import Path

import httpx2 as httpx
import psutil
import pytest
from server_utils import RunningServer, health, queue_is_full, wait_until

from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.frontend.async_llm import (
    FIRST_START_TIMEOUT_S,
    MIN_RESTART_TIMEOUT_S,
    RESTART_TIMEOUT_FACTOR,
    AsyncLLM,
)

WAIT_S = 120.0  # bound on anything a test waits for (the machine may be busy)
# Small enough to see a freeze quickly, large enough that a busy machine's step is no stall.
ITERATION_TIMEOUT = ["--engine-iteration-timeout", "2"]


def core_process(server: RunningServer) -> psutil.Process:
    """The engine-core process: the API process's child started by multiprocessing's spawn."""
    children = psutil.Process(server.process.pid).children()
    return next(c for c in children if "spawn_main" in " ".join(c.cmdline()))


# Tokens each request of the SIGTERM drain test generates. The core is stopped until the
# signal was sent, so the requests are in flight when it lands whatever their length; this
# many keep them running well past the moment the server begins to drain.
DRAIN_TOKENS = 100


def body(max_tokens: int, stream: bool = False) -> dict:
    return {
        "prompt": "hello",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def start_request(server: RunningServer, max_tokens: int) -> dict:
    """POST a completion in a thread; the dict gets its `response`."""
    result: dict = {}

    def run() -> None:
        result["response"] = server.post("/v1/completions", body(max_tokens))

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def start_stream(server: RunningServer, max_tokens: int, first_event: bool = True) -> dict:
    """Stream a completion in a thread; returns once its first event arrived (without
    `first_event`: once its status came, which the server sends as the stream starts, in the
    same step of its event loop that hands the request to the engine). The dict gets the
    `status` and every non-empty SSE `lines`."""
    result: dict = {"lines": [], "started": threading.Event()}

    def run() -> None:
        url = server.base_url + "/v1/completions"
        payload = body(max_tokens, stream=True)
        try:
            with httpx.stream(
                "POST", url, json=payload, headers=server.headers, timeout=WAIT_S
            ) as r:
                result["status"] = r.status_code
                if not first_event:
                    result["started"].set()
                for line in r.iter_lines():
                    if line:
                        result["lines"].append(line)
                        result["started"].set()
        finally:
            result["started"].set()

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    assert result["started"].wait(WAIT_S), "stream never started"
    if first_event:
        assert result["lines"], f"stream ended before its first event: {result}"
    else:
        assert result.get("status") == 200, f"stream refused: {result}"
    return result


def finish(pending: dict) -> None:
    pending["thread"].join(WAIT_S)
    assert not pending["thread"].is_alive(), "request did not end"


def assert_openai_error(response: httpx.Response, status: int, words: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and words in error["message"], error
    return error


def assert_stream_ended_with_error(pending: dict, status: int, words: str) -> None:
    lines = pending["lines"]
    assert pending["status"] == 200
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == status and words in error["message"], error
    # Every event before the error was an ordinary chunk.
    assert all("choices" in json.loads(line.removeprefix("data: ")) for line in lines[:-2])


def with_core_resumed(server: RunningServer) -> None:
    """A failed assertion must not leave a stopped core behind (it would never shut down)."""
    if server.process.poll() is not None:
        return
    for child in psutil.Process(server.process.pid).children():
        if child.status() == psutil.STATUS_STOPPED:
            child.resume()


@pytest.mark.slow  # a server
def test_frozen_core_is_reported_and_recovers(tiny_llama, tmp_path):
    server = RunningServer([str(tiny_llama), *ITERATION_TIMEOUT], tmp_path / "log")
    try:
        core = core_process(server)
        core.suspend()
        try:
            # Sent to the frozen core: it owes this request outputs and sends none, however
            # fast the model would have finished it (nothing stalls while nothing is owed).
            pending = start_request(server, max_tokens=200)
            wait_until(lambda: health(server) == 503, "/health to report the stall")
            assert "Engine core stalled" in server.log()
            assert server.metric("engine_stalled") == 1
            refused = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert_openai_error(refused, 503, "engine")
        finally:
            core.resume()
        wait_until(lambda: health(server) == 200, "/health to recover")
        finish(pending)
        # Without --restart-on-engine-failure the core is only reported: it kept the request.
        assert pending["response"].status_code == 200, pending["response"].text
        assert pending["response"].json()["usage"]["completion_tokens"] == 200
        assert "made progress again" in server.log()
        assert core.is_running() and core_process(server).pid == core.pid
        wait_until(lambda: server.metric("engine_stalled") == 0, "the stall gauge to clear")
    finally:
        with_core_resumed(server)
        assert server.stop() == 0, server.log()


@pytest.mark.slow  # a server
@pytest.mark.parametrize("failure", ["freeze", "kill"])
def test_restart_replaces_a_failed_core_and_serves_again(failure, tiny_llama, tmp_path):
    # A killed core is replaced for its death: no stall timeout in reach of this test. A queue
    # of two: the two requests' admission (they stay queued without a first token) is seen
    # from outside without a model step.
    timeout = ITERATION_TIMEOUT if failure == "freeze" else ["--engine-iteration-timeout", "3600"]
    args = [str(tiny_llama), *timeout, "--restart-on-engine-failure"]
    args += ["--max-num-queued-requests", "2"]
    server = RunningServer(args, tmp_path / "log")
    try:
        old_core = core_process(server)
        # Stopped before the requests are sent: no step runs, so both are certainly still
        # owed when the core fails, however fast the machine would have finished them, and
        # no slow step can be taken for a stall first. "freeze" leaves it stopped for the
        # watchdog to find.
        old_core.suspend()
        stream = start_stream(server, max_tokens=1000, first_event=False)
        plain = start_request(server, max_tokens=1000)
        # Admitted means handed to the engine in the same step of the server's event loop.
        wait_until(lambda: queue_is_full(server), "both requests admitted")
        if failure == "kill":
            old_core.kill()  # SIGKILL ends a stopped process too
        finish(plain)
        finish(stream)
        assert_openai_error(plain["response"], 500, "engine")
        assert_stream_ended_with_error(stream, 500, "engine")

        wait_until(lambda: health(server) == 200, "the new core")
        wait_until(lambda: not old_core.is_running(), "the old core to be gone", WAIT_S)
        new_core = core_process(server)
        assert new_core.pid != old_core.pid
        answer = server.post("/v1/completions", body(max_tokens=8))
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        assert server.metric("engine_restarts_total") == 1
        assert server.metric("engine_stalled") == 0
        log = server.log()
        assert "Restarting the engine core" in log and "Engine core restarted" in log
        if failure == "freeze":
            assert "Engine core stalled" in log
        # Only the new core (and multiprocessing's resource tracker) is left.
        children = psutil.Process(server.process.pid).children(recursive=True)
        cores = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert [c.pid for c in cores] == [new_core.pid]
    finally:
        with_core_resumed(server)
        assert server.stop() == 0, server.log()


# Written into a folder on the server's PYTHONPATH: Python imports `sitecustomize` in every
# process it starts, so an engine core (multiprocessing's spawn_main) that finds a claim file
# left by the test takes it and stops itself (SIGSTOP) before anything else, as a core
# stopped while it starts up: exactly one core per file, none before the test asks.
STOP_HOOK = """
import os, signal
claims = os.environ.get("PAGEDLLM_TEST_STOP_CORES")
with open("/proc/self/cmdline", "rb") as cmdline:
    is_core = b"spawn_main" in cmdline.read()
if claims and is_core:
    for name in sorted(os.listdir(claims)):
        try:
            os.unlink(os.path.join(claims, name))
        except FileNotFoundError:  # another core took it
            continue
        open(os.path.join(claims + ".stopped", str(os.getpid())), "w").close()
        os.kill(os.getpid(), signal.SIGSTOP)
        break
"""


def stop_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """Install STOP_HOOK for servers started next: (the folder where each file makes one
    core stop, the folder where each stopped core leaves its pid)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STOP_HOOK)
    claims, stopped = tmp_path / "claims", tmp_path / "claims.stopped"
    claims.mkdir()
    stopped.mkdir()
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("PAGEDLLM_TEST_STOP_CORES", str(claims))
    return claims, stopped


def stop_next_cores(claims: Path, count: int) -> None:
    for number in range(count):
        (claims / str(number)).touch()


def stopped_cores(stopped: Path) -> list[psutil.Process]:
    """The cores the hook stopped that still exist (not yet killed and reaped)."""
    alive = []
    for entry in stopped.iterdir():
        try:
            process = psutil.Process(int(entry.name))
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def kill_stopped_cores(stopped: Path) -> None:
    """A failed assertion must not leave a core of the test's stopped forever."""
    for process in stopped_cores(stopped):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


# The start-up deadline of a test whose restart must serve (the first start's too): a stopped
# core is killed this long after it was started, and an unhindered tiny core starts well
# within it even on a busy machine.
STARTUP_TIMEOUT = ["--engine-startup-timeout", "20"]
# The restart deadline of a test whose restarts all stop: no core has to start within it, and
# the first start keeps its own (600 s).
STOPPED_RESTART_TIMEOUT = ["--engine-restart-timeout", "2"]


def restarting_server(tiny_llama, tmp_path, monkeypatch, attempts: int, deadline: list[str]):
    """A server that restarts failed cores with `deadline`'s flags, and the hook that makes
    the next cores stop themselves: (server, claims, stopped)."""
    claims, stopped = stop_hook(tmp_path, monkeypatch)
    args = [str(tiny_llama), "--restart-on-engine-failure", "--engine-iteration-timeout", "3600"]
    args += [*deadline, "--engine-restart-attempts", str(attempts)]
    return RunningServer(args, tmp_path / "log"), claims, stopped


@pytest.mark.slow  # a server
def test_a_core_stopped_while_it_restarts_is_killed_and_another_serves(
    tiny_llama, tmp_path, monkeypatch
):
    server, claims, stopped = restarting_server(
        tiny_llama, tmp_path, monkeypatch, attempts=3, deadline=STARTUP_TIMEOUT
    )
    try:
        old_core = core_process(server)
        stop_next_cores(claims, 1)  # the first core started in its place stops at once
        old_core.kill()
        wait_until(lambda: bool(stopped_cores(stopped)), "the new core to stop")
        # While the stopped core is waited for, the server says so and refuses new requests.
        assert health(server) == 503
        refused = server.post("/v1/completions", body(max_tokens=2))
        assert_openai_error(refused, 503, "restarting after a failure (start attempt 1 of 3)")

        wait_until(lambda: health(server) == 200, "a core that serves", WAIT_S)
        answer = server.post("/v1/completions", body(max_tokens=8))
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
        log = server.log()
        assert "start attempt 1 of 3 failed: the new core was not ready within 20 s" in log
        assert "Engine core restarted" in log and "Giving up" not in log
        assert server.metric("engine_restarts_total") == 1
        # The stopped core was killed and reaped; only the serving core is left.
        assert stopped_cores(stopped) == []
        children = psutil.Process(server.process.pid).children(recursive=True)
        cores = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert [c.pid for c in cores] == [core_process(server).pid]
        assert cores[0].status() != psutil.STATUS_STOPPED
    finally:
        kill_stopped_cores(stopped)
        assert server.stop() == 0, server.log()


@pytest.mark.slow  # a server
def test_a_core_that_never_comes_up_ends_the_server_with_the_reason(
    tiny_llama, tmp_path, monkeypatch
):
    server, claims, stopped = restarting_server(
        tiny_llama, tmp_path, monkeypatch, attempts=2, deadline=STOPPED_RESTART_TIMEOUT
    )
    try:
        old_core = core_process(server)
        stop_next_cores(claims, 2)  # every attempt stops
        old_core.kill()
        wait_until(lambda: bool(stopped_cores(stopped)), "the first new core to stop")
        refused = server.post("/v1/completions", body(max_tokens=2))
        assert_openai_error(refused, 503, "restarting after a failure")

        assert server.process.wait(WAIT_S) == 1, server.log()
        log = server.log()
        assert "start attempt 1 of 2 failed: the new core was not ready within 2 s" in log
        assert "trying again in 1 s" in log
        assert "start attempt 2 of 2 failed: the new core was not ready within 2 s" in log
        # The flag that set the deadline is the one to raise.
        assert "Giving up: the server exits" in log and "raise --engine-restart-timeout" in log
        assert "Engine core restarted" not in log
        assert len(list(stopped.iterdir())) == 2 and not list(claims.iterdir())
        # Both stopped cores were killed: the server left nothing behind.
        wait_until(lambda: stopped_cores(stopped) == [], "the stopped cores to be gone")
    finally:
        kill_stopped_cores(stopped)
        server.stop()


@pytest.mark.slow  # a server
def test_drain_timeout_ends_requests_with_openai_errors(tiny_llama, tmp_path):
    args = [str(tiny_llama), "--shutdown-timeout", "1", "--max-num-queued-requests", "2"]
    server = RunningServer(args, tmp_path / "log")
    try:
        core = core_process(server)
        # Stopped before the requests are sent and until the drain gave up on them: they
        # certainly outlast it, however fast the machine would have finished them.
        core.suspend()
        try:
            stream = start_stream(server, max_tokens=1000, first_event=False)
            plain = start_request(server, max_tokens=1000)
            wait_until(lambda: queue_is_full(server), "both requests admitted")
            server.process.send_signal(signal.SIGTERM)
            finish(plain)
            finish(stream)
        finally:
            core.resume()
        assert_openai_error(plain["response"], 503, "shutting down")
        assert_stream_ended_with_error(stream, 503, "shutting down")
        assert server.process.wait(WAIT_S) == 0, server.log()
        assert "ending 2 request(s)" in server.log()
    finally:
        server.stop()


@pytest.mark.slow  # a server
@pytest.mark.parametrize("run", range(3))
def test_sigterm_to_the_process_group_drains_and_exits_zero(run, tiny_llama, tmp_path, monkeypatch):
    # Its own session, so the server's process group holds it and its children alone, as a
    # systemd unit's control group does (KillMode=control-group signals all of them).
    with monkeypatch.context() as patch:
        patch.setattr(subprocess, "Popen", partial(subprocess.Popen, start_new_session=True))
        args = [str(tiny_llama), "--shutdown-timeout", "120", "--max-num-queued-requests", "4"]
        server = RunningServer(args, tmp_path / "log")
    try:
        api = psutil.Process(server.process.pid)
        processes = [api, *api.children(recursive=True)]
        core = core_process(server)
        assert os.getpgid(core.pid) == server.process.pid
        # Stopped until the signal was sent: all four are certainly still in flight when it
        # lands, however fast the machine would have finished them. (The core ignores
        # SIGTERM, stopped or not.)
        core.suspend()
        try:
            streams = [
                start_stream(server, max_tokens=DRAIN_TOKENS, first_event=False) for _ in range(2)
            ]
            plains = [start_request(server, max_tokens=DRAIN_TOKENS) for _ in range(2)]
            # All four admitted (a queue of four is full): one still connecting when the
            # signal lands is refused by a server that has stopped accepting, which is right
            # but not what this tests.
            wait_until(lambda: queue_is_full(server), "all four requests admitted")
            os.killpg(server.process.pid, signal.SIGTERM)
        finally:
            core.resume()
        for pending in plains + streams:
            finish(pending)
        assert server.process.wait(WAIT_S) == 0, server.log()
        for pending in plains:
            response = pending["response"]
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == DRAIN_TOKENS
        for pending in streams:
            assert pending["lines"][-1] == "data: [DONE]"
            assert not any('"error"' in line for line in pending["lines"])
        _, alive = psutil.wait_procs(processes, timeout=30)
        assert not alive, f"left running: {alive}"
    finally:
        server.stop()


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan")])
def test_engine_iteration_timeout_must_be_positive_and_finite(value):
    with pytest.raises(ValueError, match="engine_iteration_timeout"):
        ServerConfig(served_model_names=("m",), engine_iteration_timeout=value)


@pytest.mark.parametrize("name", ["engine_startup_timeout", "engine_restart_timeout"])
@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan")])
def test_engine_start_deadlines_must_be_positive_and_finite(name, value):
    with pytest.raises(ValueError, match=name):
        ServerConfig(served_model_names=("m",), **{name: value})


def test_engine_restart_attempts_must_be_at_least_one():
    with pytest.raises(ValueError, match="engine_restart_attempts must be >= 1"):
        ServerConfig(served_model_names=("m",), engine_restart_attempts=0)


def test_a_restart_deadline_is_the_one_given_or_follows_the_first_start():
    engine = AsyncLLM.__new__(AsyncLLM)  # the deadline's arithmetic alone: no core started
    engine.startup_timeout_s, engine.first_start_s = None, None
    engine.restart_timeout_given_s = None
    assert engine.restart_timeout_s == FIRST_START_TIMEOUT_S  # no first start to go by
    engine.first_start_s = 5.0  # a few seconds say little: the floor
    assert engine.restart_timeout_s == MIN_RESTART_TIMEOUT_S
    engine.first_start_s = 100.0
    assert engine.restart_timeout_s == RESTART_TIMEOUT_FACTOR * 100.0
    engine.startup_timeout_s = 7.0
    assert engine.restart_timeout_s == 7.0
    assert engine.restart_timeout_flag == "--engine-startup-timeout"
    engine.restart_timeout_given_s = 3.0  # a restart's own deadline comes first
    assert engine.restart_timeout_s == 3.0
    assert engine.restart_timeout_flag == "--engine-restart-timeout"
