"""Prefill/decode disaggregation over HTTP: a prefill server, a decode server and
`pagedllm proxy` on 127.0.0.1. Greedy output through the proxy equals one engine alone, the
decode server computes only each prompt's last token, and with the prefill server killed the
proxy still answers (the decode server prefills itself)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest
from entrypoints.server_utils import RunningServer, offline_greedy_texts, wait_until
from process_guard import dies_with_us
from tiers import slow_fixture

from pagedllm.utils import free_port

MAX_TOKENS = 12


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 400 + 3 for i in range(length)]


@pytest.fixture(scope="module")
@slow_fixture
def cluster(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-logs")
    kv_port = free_port()
    consumer_config = {"kv_role": "kv_consumer", "kv_port": kv_port}
    producer_config = {
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"peer": f"127.0.0.1:{kv_port}", "timeout_s": 5},
    }
    common = [str(tiny_llama), "--max-model-len", "256", "--served-model-name", "tiny"]
    decode = RunningServer(
        [*common, "--kv-transfer-config", json.dumps(consumer_config)], logs / "decode.log"
    )
    prefill = RunningServer(
        [*common, "--kv-transfer-config", json.dumps(producer_config)], logs / "prefill.log"
    )
    proxy_port = free_port()
    proxy_log = open(logs / "proxy.log", "w")  # noqa: SIM115 - closed at teardown
    proxy = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "proxy",
         "--prefill", prefill.base_url, "--decode", decode.base_url,
         "--host", "127.0.0.1", "--port", str(proxy_port)],
        stdout=proxy_log, stderr=subprocess.STDOUT, preexec_fn=dies_with_us(),
    )  # fmt: skip
    proxy_url = f"http://127.0.0.1:{proxy_port}"

    def proxy_healthy() -> bool:
        try:
            return httpx.get(proxy_url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(proxy_healthy, "the proxy", timeout_s=60)
        yield prefill, decode, proxy_url
    finally:
        proxy.terminate()
        proxy.wait(30)
        proxy_log.close()
        prefill.stop()
        decode.stop()


def complete(url: str, token_ids: list[int], stream: bool = False) -> str:
    body = {
        "model": "tiny",
        "prompt": token_ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_proxy_output_equals_one_engine_and_decode_computes_one_token(cluster, tiny_llama):
    prefill, decode, proxy_url = cluster
    prompts = [prompt(1, 100), prompt(2, 64), prompt(3, 37)]
    want = offline_greedy_texts(tiny_llama, prompts, MAX_TOKENS)
    for token_ids, text, stream in zip(prompts, want, [False, True, False], strict=True):
        computed = decode.metric("prompt_tokens_computed_total")
        assert complete(proxy_url, token_ids, stream) == text
        # The decode server ran only the last prompt token: the rest came from the prefill.
        assert decode.metric("prompt_tokens_computed_total") - computed == 1
    assert prefill.metric("prompt_tokens_computed_total") >= sum(len(p) for p in prompts)
    assert "kv_tier_events_total" in decode.get("/metrics").text


def test_killing_the_prefill_server_falls_back_to_local_prefill(cluster, tiny_llama):
    prefill, decode, proxy_url = cluster
    prompts = [prompt(10 + i, 120) for i in range(6)]
    want = offline_greedy_texts(tiny_llama, prompts, MAX_TOKENS)
    answers: dict[int, str] = {}

    def ask(index: int) -> None:
        answers[index] = complete(proxy_url, prompts[index])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    prefill.process.kill()  # mid-run: some prefills are in flight or not yet asked for
    for thread in threads:
        thread.join(120)
    assert answers == dict(enumerate(want))
    # With the prefill server gone, the decode server prefills a new prompt itself.
    computed = decode.metric("prompt_tokens_computed_total")
    late = prompt(99, 80)
    assert complete(proxy_url, late) == offline_greedy_texts(tiny_llama, [late], MAX_TOKENS)[0]
    assert decode.metric("prompt_tokens_computed_total") - computed == len(late)
