"""A stream's first chunk means its first token exists: clients and load generators (vLLM's
`bench serve`, OpenAI's SDK users) time it as the time to first token."""

from __future__ import annotations

import json
import time

import httpx2 as httpx
import pytest
from server_utils import MODEL

# Long enough that prefilling it takes far longer than sending a chunk.
LONG_TEXT = " ".join(f"item {i} is a fruit." for i in range(240))


def _engine_ttft(server) -> tuple[float, float]:
    """(sum, count) of the server's time-to-first-token histogram; its series appears with
    the first request it observes."""
    try:
        sums = server.metric("time_to_first_token_seconds_sum")
        return sums, server.metric("time_to_first_token_seconds_count")
    except KeyError:
        return 0.0, 0.0


def _first_chunk_after(server, path: str, body: dict) -> tuple[float, dict]:
    """(seconds from sending the request to its first SSE data line, that chunk)."""
    started = time.monotonic()
    with httpx.stream(
        "POST", server.base_url + path, json=body, headers=server.headers, timeout=120
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                elapsed = time.monotonic() - started
                first = json.loads(line.removeprefix("data: "))
                rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]"
                return elapsed, first
    raise AssertionError("the stream sent no data")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}]}),
        ("/v1/completions", {"prompt": LONG_TEXT}),
    ],
)
def test_first_chunk_arrives_no_earlier_than_the_first_token(server, path, body):
    body = {**body, "model": MODEL, "max_tokens": 2, "temperature": 0, "stream": True}
    ttft_sum, ttft_count = _engine_ttft(server)
    elapsed, first = _first_chunk_after(server, path, body)
    after_sum, after_count = _engine_ttft(server)
    assert after_count == ttft_count + 1
    engine_ttft = after_sum - ttft_sum
    # The engine's clock starts when the request reaches it, after the client sent it.
    assert engine_ttft > 0
    assert elapsed >= engine_ttft, (elapsed, engine_ttft)
    if path == "/v1/chat/completions":
        assert first["choices"][0]["delta"]["role"] == "assistant"
        # vLLM's fields on every chunk's choice, the first included.
        assert first["choices"][0]["stop_reason"] is None
        assert first["choices"][0]["finish_reason"] is None
