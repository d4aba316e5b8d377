"""Tensor parallelism through the real server (`serve -tp 2`, the `mp` executor, a tiny
model): it answers with one rank's greedy text; a worker rank SIGKILLed under a streaming
request ends the stream with an error event, turns `/health` to 503, makes the server exit
non-zero, and leaves no process behind (API, engine core, workers). One server start serves
both parts: each takes tens of seconds on this machine.
(Offline `LLM(tensor_parallel_size=2)`: tests/distributed/test_mp_parallel.py.)"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx2 as httpx
import psutil
import pytest
from server_utils import RunningServer, health, offline_greedy_texts

pytestmark = pytest.mark.slow  # a server with two worker processes

WAIT_S = 60.0  # bound on anything a test waits for (the machine may be busy)
MAX_TOKENS = 8
PROMPTS = [[5, 6, 7], [(7 * i) % 500 + 3 for i in range(40)]]
# The rank is stopped (SIGSTOP) before the stream is sent, so no step completes and the
# stream is certainly unfinished when the rank dies, however fast the machine.
STREAM_TOKENS = 1000


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[str]:
    """One rank's greedy texts (offline engine) for PROMPTS."""
    return offline_greedy_texts(tiny_llama, PROMPTS, MAX_TOKENS)


def spawned_children(process: psutil.Process) -> list[psutil.Process]:
    """`multiprocessing` spawn children (engine cores of an API process, workers of a core),
    oldest first."""
    children = [c for c in process.children() if "spawn_main" in " ".join(c.cmdline())]
    return sorted(children, key=lambda c: (c.create_time(), c.pid))


def resume_stopped(api: psutil.Process) -> None:
    with contextlib.suppress(psutil.Error):
        for process in api.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if process.status() == psutil.STATUS_STOPPED:
                    process.resume()


def stream_completion(server: RunningServer, events: list, started: threading.Event) -> None:
    """POST a long greedy stream; append the status and every SSE `data:` payload to
    `events`; set `started` once the status came (the request is admitted and running)."""
    body = {
        "prompt": PROMPTS[0],
        "max_tokens": STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    url = server.base_url + "/v1/completions"
    try:
        with httpx.stream("POST", url, json=body, timeout=WAIT_S) as response:
            events.append(response.status_code)
            started.set()
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    except httpx.HTTPError as error:
        events.append(error)
    finally:
        started.set()  # never leave the test waiting


def test_tp2_server_answers_as_one_rank_and_a_killed_rank_ends_it(tiny_llama, tmp_path, reference):
    server = RunningServer([str(tiny_llama), "-tp", "2"], tmp_path / "tp2.log")
    api = psutil.Process(server.process.pid)
    try:
        (core,) = spawned_children(api)
        workers = spawned_children(core)
        assert len(workers) == 2, workers
        everything = [api, *api.children(recursive=True)]  # core, workers, resource tracker

        for prompt, text in zip(PROMPTS, reference, strict=True):
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            response = server.post("/v1/completions", {**body, "ignore_eos": True})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text

        events: list = []
        started = threading.Event()
        victim = workers[-1]  # the last started: rank 1
        # Stopped first: the stream's steps wait for it, so the request is still owed when
        # the rank dies, however fast the machine would have finished it.
        victim.suspend()
        streamer = threading.Thread(target=stream_completion, args=(server, events, started))
        streamer.start()
        # Its 200 is sent as the stream starts, in the same step of the server's event loop
        # that hands the request to the engine.
        assert started.wait(WAIT_S), "the stream did not start"
        assert events[0] == 200, events
        victim.kill()  # SIGKILL, which ends a stopped process too
        killed_at = time.monotonic()

        # The API process answers 503 from the moment it sees the core die, then exits.
        while (status := health(server)) == 200 and time.monotonic() - killed_at < WAIT_S:
            time.sleep(0.05)
        assert status == 503, f"/health answered {status} after the rank died"
        streamer.join(WAIT_S)
        assert not streamer.is_alive(), "the stream did not end"
        assert events[-1] == "[DONE]", events[-3:]
        assert "error" in events[-2], events[-3:]
        assert not any(
            choice.get("finish_reason") for event in events[1:-2] for choice in event["choices"]
        ), "the stream finished before the rank died"
        assert server.process.wait(WAIT_S) == 1, server.log()
        print(f"rank killed -> 503 and server exit in {time.monotonic() - killed_at:.1f} s")
        _, alive = psutil.wait_procs(everything, timeout=WAIT_S)
        assert not alive, f"processes left behind: {alive}"
        assert f"(pid {victim.pid}) died with exit code -9" in server.log(), server.log()
    finally:
        resume_stopped(api)  # a failed assertion must not leave a stopped rank behind
        server.stop()
