"""The OpenAI-compatible server on the default model, driven by the official `openai` client
and raw HTTP: answers equal the offline engine's, usage is exact, streams are well formed,
errors have OpenAI's shape, and disconnects free their KV blocks."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx2 as httpx
import openai
import pytest
from server_utils import API_KEY, MODEL
from test_vllm_metrics import DASHBOARD_METRICS

from pagedllm import SamplingParams

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def test_models_version_health_and_auth(server):
    before = int(time.time())
    models = server.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert before <= models["data"][0]["created"] <= time.time() + 1  # vLLM's: not 0
    assert server.get("/version").json()["version"]
    assert httpx.get(server.base_url + "/health").status_code == 200  # open to all
    for path in ("/v1/models", "/metrics", "/version"):
        response = httpx.get(server.base_url + path)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == 401
    wrong = httpx.post(
        server.base_url + "/tokenize",
        json={"prompt": "hi"},
        headers={"Authorization": "Bearer nope"},
    )
    assert wrong.status_code == 401


def test_completion_equals_offline_engine_and_usage_is_exact(server, client, llm):
    prompt = "The three primary colors are"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    expected = llm.generate(prompt, greedy(24), use_tqdm=False)[0]
    assert response.choices[0].text == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(llm.get_tokenizer().encode(prompt))
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + 24


def test_chat_equals_offline_engine_and_usage_is_exact(server, client, llm):
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=32, temperature=0
    )
    expected = llm.chat(QUESTION, greedy(32), use_tqdm=False)[0]
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason == "stop"
    tokenized = server.post("/tokenize", {"messages": QUESTION}).json()
    assert response.usage.prompt_tokens == tokenized["count"] == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_chat_stream_with_usage(server, client):
    full = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=32, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_completion_stream_ends_with_done(server):
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json=body, headers=server.headers
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert sum(len(c["choices"]) for c in chunks) >= 1 and "usage" not in chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_seed_stop_and_logprobs(server, client, llm):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=16, temperature=1.0, seed=7, n=2)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    stopped = client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=30, temperature=0, stop=[" 6"]
    )
    assert stopped.choices[0].finish_reason == "stop" and " 6" not in stopped.choices[0].text
    assert stopped.choices[0].text.rstrip().endswith("5,")
    with_logprobs = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == with_logprobs.usage.completion_tokens
    expected = llm.chat(QUESTION, greedy(8, logprobs=3), use_tqdm=False)[0].outputs[0]
    for entry, token_id, position in zip(
        content, expected.token_ids, expected.logprobs, strict=True
    ):
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def test_vllm_extra_fields_via_extra_body(server, client):
    response = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=12,
        temperature=0.8,
        extra_body={"top_k": 5, "min_p": 0.05, "ignore_eos": True, "min_tokens": 12,
                    "repetition_penalty": 1.1, "priority": 0, "request_id": "my-id-1"},
    )  # fmt: skip
    assert response.usage.completion_tokens == 12 and response.id == "my-id-1"
    raw = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "user": "u1"})
    assert raw.status_code == 200 and raw.headers["x-request-id"] == raw.json()["id"]
    echoed = server.post(
        "/v1/completions", {"prompt": "Hi there", "max_tokens": 2, "echo": True, "logprobs": 1}
    ).json()["choices"][0]
    assert echoed["text"].startswith("Hi there")
    assert echoed["logprobs"]["token_logprobs"][0] is None
    assert len(echoed["logprobs"]["tokens"]) == 2 + 2  # two prompt tokens, two generated


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, 400, None),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ("/v1/chat/completions", {"messages": QUESTION, "tools": [{"x": 1}]}, 400, "tools"),
        ("/v1/chat/completions", {"messages": QUESTION, "n": 0}, 400, "n"),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    response = server.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_malformed_huge_and_too_long_prompts(server):
    malformed = httpx.post(
        server.base_url + "/v1/completions",
        content=b'{"prompt": "x",',
        headers={**server.headers, "Content-Type": "application/json"},
    )
    assert malformed.status_code == 400 and "JSON" in malformed.json()["error"]["message"]
    # Under the body limit (1.5 MiB for 8192 tokens) but more characters than the context holds.
    huge = server.post("/v1/completions", {"prompt": "a" * 1_000_000, "max_tokens": 1})
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "input_tokens"
    oversized = server.post("/v1/completions", {"prompt": "a" * 10_000_000, "max_tokens": 1})
    assert oversized.status_code == 413
    assert "--max-request-body-bytes" in oversized.json()["error"]["message"]
    long_prompt = "hello " * 9000
    too_long = server.post("/v1/completions", {"prompt": long_prompt, "max_tokens": 1})
    error = too_long.json()["error"]
    assert too_long.status_code == 400 and error["param"] == "input_tokens"
    num_tokens = server.post("/tokenize", {"prompt": long_prompt}).json()["count"]
    assert f"{num_tokens} input tokens" in error["message"] and "8192" in error["message"]
    assert server.get("/health").status_code == 200
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_tokenize_detokenize(server, llm):
    tokens = server.post("/tokenize", {"prompt": "Hello world"}).json()
    assert tokens["tokens"] == llm.get_tokenizer().encode("Hello world")
    text = server.post("/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"


def test_64_concurrent_streams_complete_and_free_every_block(server, llm):
    prompts = [f"Write {i % 7 + 1} words about the number {i}:" for i in range(64)]
    lengths = [4 + (i * 5) % 37 for i in range(64)]

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=600
        ) as client:
            return await asyncio.gather(
                *(one(client, p, n) for p, n in zip(prompts, lengths, strict=True))
            )

    texts = asyncio.run(run_all())
    expected = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert texts == [o.outputs[0].text for o in expected]
    assert server.metric("kv_cache_usage_perc") == 0.0
    assert server.metric("num_requests_running") == 0.0


def aborted_total(server) -> float:
    """Sequences the server has counted as finished by an abort."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in server.get("/metrics").text.splitlines()
        if line.startswith("pagedllm:request_success_total{") and 'finished_reason="abort"' in line
    )


def test_disconnect_frees_blocks_at_once(server):
    body = {"prompt": "Tell me a story.", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    aborted = aborted_total(server)
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json=body, headers=server.headers
    ) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metric("kv_cache_usage_perc") > 0.0
    # The bound is only a hang-guard: what shows the blocks went at the disconnect, not at
    # the end of the 4000 tokens however fast the machine runs them, is that the request
    # was aborted.
    deadline = time.monotonic() + 60
    while server.metric("kv_cache_usage_perc") > 0.0:
        assert time.monotonic() < deadline, "blocks still held after the disconnect"
        time.sleep(0.02)
    assert aborted_total(server) == aborted + 1
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_metrics_use_vllm_names(server):
    text = server.get("/metrics").text
    for name in (
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
        "prompt_tokens_total", "generation_tokens_total", "request_success_total",
        "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
        "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
    ):  # fmt: skip
        assert f"pagedllm:{name}" in text, name
    assert server.metric("generation_tokens_total") > 0
    # The disconnected stream (`vllm:` has an abort series from the start, at 0).
    assert re.search(r'pagedllm:request_success_total\{[^}]*finished_reason="abort"', text)


def test_vllm_dashboard_finds_its_series(server):
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3}).status_code == 200
    text = server.get("/metrics").text
    for name in DASHBOARD_METRICS:  # each with the served model's name
        assert re.search(rf'^{name}\{{[^}}]*model_name="{MODEL}"', text, re.M), name
    assert re.search(r'^vllm:cache_config_info\{[^}]*block_size="\d+"[^}]*\} 1\.0$', text, re.M)
    for phase in ("prefill", "decode", "inference"):
        count = re.search(rf"^vllm:request_{phase}_time_seconds_count\{{.*\}} (\S+)$", text, re.M)
        assert count and float(count[1]) >= 1, phase


def test_cors_preflight_needs_no_key(server):
    response = httpx.options(
        server.base_url + "/v1/chat/completions",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] in ("*", "https://app.example")


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_against_the_server(server, tmp_path, endpoint):
    from pagedllm.entrypoints.cli import main

    report = tmp_path / "serve.json"
    status = main(
        ["bench", "serve", "--base-url", server.base_url, "--endpoint", endpoint,
         "--api-key", API_KEY, "--num-prompts", "8", "--input-len", "16", "--output-len", "8",
         "--ignore-eos", "--max-concurrency", "4", "--disable-tqdm",
         "--output-json", str(report)]
    )  # fmt: skip
    assert status == 0
    result = json.loads(report.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 64
    assert result["median_ttft_ms"] > 0 and result["mean_itl_ms"] > 0


def test_prompt_logprobs_are_returned_as_the_offline_engine_scores_the_prompt(server, llm):
    """vLLM's shape: per completion choice (chat: top level), one entry per prompt token, None
    for the first, keyed by token id with logprob, rank and text."""
    prompt = "The three primary colors are"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    choice = server.post("/v1/completions", body).json()["choices"][0]
    expected = llm.generate(prompt, greedy(1, prompt_logprobs=2), use_tqdm=False)[0]
    positions = choice["prompt_logprobs"]
    assert len(positions) == len(expected.prompt_token_ids) and positions[0] is None
    for token_id, entry, offline in zip(
        expected.prompt_token_ids[1:], positions[1:], expected.prompt_logprobs[1:], strict=True
    ):
        assert str(token_id) in entry and len(entry) in (2, 3)  # the prompt's token + top 2
        assert set(entry) == {str(t) for t in offline}
        for key, logprob in entry.items():
            assert logprob["logprob"] == pytest.approx(offline[int(key)].logprob, abs=1e-4)
            assert logprob["rank"] == offline[int(key)].rank
    plain = server.post("/v1/completions", {**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 1}
    answer = server.post("/v1/chat/completions", chat).json()
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]
    assert answer["prompt_logprobs"][0] is None


def test_prompt_logprobs_with_stream_are_refused_by_name(server):
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": QUESTION}),
    ):
        body = {"model": MODEL, "max_tokens": 1, "stream": True, "prompt_logprobs": 1, **body}
        response = server.post(path, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt_logprobs"


def test_echo_with_max_tokens_zero_scores_the_prompt(server, llm):
    """lm-eval's loglikelihood request: the prompt back with its logprobs, nothing generated."""
    prompt = "The three primary colors are"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    answer = server.post("/v1/completions", body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["text"] == prompt
    assert answer.json()["usage"]["completion_tokens"] == 0
    expected = llm.generate(prompt, greedy(1, prompt_logprobs=1), use_tqdm=False)[0]
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(expected.prompt_token_ids) and token_logprobs[0] is None
    for token_id, value, offline in zip(
        expected.prompt_token_ids[1:], token_logprobs[1:], expected.prompt_logprobs[1:], strict=True
    ):
        assert value == pytest.approx(offline[token_id].logprob, abs=1e-4)
    refused = server.post("/v1/completions", {**body, "echo": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
