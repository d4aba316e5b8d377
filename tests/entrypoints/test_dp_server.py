"""Data parallelism through the real server (`-dp 2`, a tiny model): every request answered
with DP=1's greedy output, prefix-aware routing beating round robin on the prefix-cache hit
rate of a shared-prefix workload (round robin measured offline, same router), per-engine
metrics, a dead core ending the server without restart, and a failed core replaced alone
with it.
(Offline `LLM(data_parallel_size=2)`: tests/engine/test_dp_llm.py.)"""

from __future__ import annotations

import contextlib
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import psutil
import pytest
from server_utils import RunningServer, health, queue_is_full, wait_until

from pagedllm import LLM, SamplingParams
from pagedllm.client.dp_router import ROUTING_ENV

pytestmark = pytest.mark.slow  # servers with two engine-core processes

WAIT_S = 120.0  # bound on anything a test waits for (the machine may be busy)
MAX_TOKENS = 6
BLOCK = 16  # the default block size
GROUPS = 3  # shared prefixes; with 2 cores round robin sends every group to both
PER_GROUP = 4
PREFIX_BLOCKS = 4
SUFFIX_LEN = 8


def shared_prefix_prompts() -> list[list[int]]:
    """GROUPS groups of prompts sharing a PREFIX_BLOCKS-block prefix, interleaved A B C A ..."""
    prefixes = [
        [(37 * group + 11 * i) % 500 + 3 for i in range(PREFIX_BLOCKS * BLOCK)]
        for group in range(GROUPS)
    ]
    return [
        prefixes[group] + [(7 * n + group + 13 * j) % 500 + 3 for j in range(SUFFIX_LEN)]
        for n in range(PER_GROUP)
        for group in range(GROUPS)
    ]


def mixed_prompts() -> list[list[int]]:
    return [[(5 * n + 3 * i) % 500 + 3 for i in range(5 + 9 * n)] for n in range(10)]


def engine_series(server: RunningServer, name: str) -> dict[str, float]:
    """`pagedllm:<name>` per `engine` label."""
    series = {}
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(f"pagedllm:{name}{{"):
            engine = re.search(r'engine="(\d+)"', line)
            assert engine is not None, line
            series[engine.group(1)] = float(line.rsplit(" ", 1)[1])
    return series


def hit_rate(server: RunningServer) -> float:
    hits = sum(engine_series(server, "prefix_cache_hits_total").values())
    queries = sum(engine_series(server, "prefix_cache_queries_total").values())
    return hits / queries


def complete(server: RunningServer, prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def core_processes(server: RunningServer) -> list[psutil.Process]:
    """The engine-core processes, oldest first (core 0 starts first)."""
    children = psutil.Process(server.process.pid).children()
    cores = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    return sorted(cores, key=lambda c: c.create_time())


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """DP=1 greedy texts (offline engine) for the prompts the tests send."""
    llm = LLM(str(tiny_llama))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompts = mixed_prompts() + shared_prefix_prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {tuple(p): o.outputs[0].text for p, o in zip(prompts, outputs, strict=True)}


def start_dp_server(tiny_llama, tmp_path, monkeypatch, policy: str, *extra: str):
    monkeypatch.setenv(ROUTING_ENV, policy)
    return RunningServer([str(tiny_llama), "-dp", "2", *extra], tmp_path / f"{policy}.log")


def run_workload(server: RunningServer, reference: dict) -> float:
    """The shared-prefix workload one request at a time (so the hits do not depend on timing),
    then concurrent requests; returns the prefix-cache hit rate of the shared-prefix workload."""
    assert len(core_processes(server)) == 2
    for prompt in shared_prefix_prompts():
        assert complete(server, prompt)["choices"][0]["text"] == reference[tuple(prompt)]
    rate = hit_rate(server)
    queries = engine_series(server, "prefix_cache_queries_total")
    assert set(queries) == {"0", "1"} and all(queries.values()), queries  # both cores used
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: complete(server, p), mixed_prompts()))
    for prompt, answer in zip(mixed_prompts(), answers, strict=True):
        assert answer["choices"][0]["text"] == reference[tuple(prompt)]
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    wait_until(
        lambda: sum(engine_series(server, "num_requests_running").values()) == 0, "idle cores"
    )
    assert set(engine_series(server, "engine_stalled").values()) == {0.0}
    return rate


def round_robin_hit_rate(tiny_llama, monkeypatch) -> float:
    """The same workload, one request at a time, over an offline DP=2 engine routing round
    robin: the same router and the same per-core prefix caches as the server's, without a
    second server start."""
    monkeypatch.setenv(ROUTING_ENV, "round_robin")
    llm = LLM(str(tiny_llama), data_parallel_size=2)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for prompt in shared_prefix_prompts():
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return llm.get_stats().prefix_cache_hit_rate


def test_dp2_answers_as_dp1_beats_round_robin_and_ends_with_a_dead_core(
    tiny_llama, tmp_path, monkeypatch, reference
):
    server = start_dp_server(tiny_llama, tmp_path, monkeypatch, "prefix")
    try:
        prefix_rate = run_workload(server, reference)
        # Without --restart-on-engine-failure a dead core ends the server, as with one core.
        cores = core_processes(server)
        cores[1].kill()
        wait_until(lambda: health(server) != 200, "/health to turn 503")
        assert server.process.wait(WAIT_S) == 1, server.log()
        assert "Engine core 1 died" in server.log()
        _, alive = psutil.wait_procs(cores, timeout=10)
        assert not alive, f"core processes left behind: {alive}"
    finally:
        server.stop()
    rr_rate = round_robin_hit_rate(tiny_llama, monkeypatch)
    print(f"prefix-cache hit rate: prefix routing {prefix_rate:.3f}, round robin {rr_rate:.3f}")
    # Prefix routing: each group's first prompt misses, the other 3 hit 4 blocks of 4.5.
    # Round robin sends every group to both cores: 2 misses per group.
    hit = PREFIX_BLOCKS * BLOCK / (PREFIX_BLOCKS * BLOCK + SUFFIX_LEN)
    assert prefix_rate == pytest.approx(hit * (PER_GROUP - 1) / PER_GROUP, abs=1e-9)
    assert rr_rate == pytest.approx(hit * (PER_GROUP - 2) / PER_GROUP, abs=1e-9)
    assert prefix_rate > rr_rate


def test_dp2_replaces_a_killed_core_alone(tiny_llama, tmp_path, monkeypatch):
    # Both cores are stopped for a while below (core 1 while core 0 is replaced): no stall
    # timeout in reach of this test. A queue of two: the two requests' admission (they stay
    # queued without a first token) is seen from outside without a model step.
    args = ("--restart-on-engine-failure", "--engine-iteration-timeout", "3600")
    args += ("--max-num-queued-requests", "2")
    server = start_dp_server(tiny_llama, tmp_path, monkeypatch, "prefix", *args)
    try:
        core0, core1 = core_processes(server)
        results: dict[str, httpx.Response] = {}

        def run(name: str, prompt: list[int], max_tokens: int) -> threading.Thread:
            body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}

            def post() -> None:
                results[name] = server.post("/v1/completions", body)

            thread = threading.Thread(target=post, daemon=True)
            thread.start()
            return thread

        # One block each core holds (nothing held, equal loads: the cores in turn, 0 first):
        # prefix routing then sends a prompt starting with it to that core, whatever the
        # order the two requests below arrive in.
        held = [[(37 * core + 11 * i) % 500 + 3 for i in range(BLOCK)] for core in range(2)]
        for prefix in held:
            complete(server, prefix)
        # Stopped before the requests are sent: both are certainly still owed when core 0
        # dies, however fast the machine would have finished them.
        core0.suspend()
        core1.suspend()
        try:
            doomed = run("doomed", held[0] + [5, 6, 7], 1000)
            survivor = run("survivor", held[1] + [8, 9, 10], 300)
            # Admitted means routed and handed to its core in the same step of the server's
            # event loop.
            wait_until(lambda: queue_is_full(server), "both requests admitted")
            core0.kill()  # SIGKILL ends a stopped process too
            doomed.join(WAIT_S)
            assert results["doomed"].status_code == 500, results["doomed"].text
        finally:
            core1.resume()
        survivor.join(WAIT_S)
        assert results["survivor"].status_code == 200, results["survivor"].text
        assert results["survivor"].json()["usage"]["completion_tokens"] == 300
        wait_until(lambda: health(server) == 200, "the new core")
        assert engine_series(server, "engine_restarts_total") == {"0": 1.0, "1": 0.0}
        new_cores = core_processes(server)
        assert core1 in new_cores and core0 not in new_cores and len(new_cores) == 2
        for prompt in mixed_prompts()[:4]:  # both cores serve again
            assert complete(server, prompt)["usage"]["completion_tokens"] == MAX_TOKENS
        assert "Restarting the engine core 0" in server.log()
    finally:
        with contextlib.suppress(psutil.Error):  # a failed assertion must not leave one stopped
            for core in core_processes(server):
                if core.status() == psutil.STATUS_STOPPED:
                    core.resume()
        assert server.stop() == 0, server.log()
