"""Time to first token as a user sees it: one streamed chat request at a time, timed by hand.

The reference the load generators' TTFT is checked against. For each request it records
when the first chunk with `choices` arrived (what `vllm bench serve` times) and when the
first chunk with non-empty content arrived (the first token a user sees); a server that
sent an empty chunk before prefill would show a gap between the two. Prompts are random
token ids decoded by the model's tokenizer, different in every request so that no prefix
cache serves them.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


def random_prompts(tokenizer_dir: Path, count: int, input_len: int, seed: int = 1) -> list[str]:
    """`count` prompts of about `input_len` tokens each: random ids, decoded."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    special = set(tokenizer.all_special_ids)
    prompts = []
    for index in range(count):
        rng = random.Random(seed * 1_000_003 + index)
        ids: list[int] = []
        while len(ids) < input_len:
            token = rng.randrange(tokenizer.vocab_size)
            if token not in special:
                ids.append(token)
        prompts.append(tokenizer.decode(ids))
    return prompts


def stream_chat(
    base_url: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 300.0
) -> dict[str, Any]:
    """One streamed chat completion; seconds to the first chunk, first content, and end."""
    target = urlsplit(base_url)
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
    }  # fmt: skip
    connection = http.client.HTTPConnection(target.hostname, target.port, timeout=timeout_s)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", json.dumps(body),
                       {"Content-Type": "application/json"})  # fmt: skip
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"chat request failed: {response.status} {response.read()[:300]!r}")
    first_chunk = first_content = None
    chunks_before_content = 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        choices = json.loads(line[5:]).get("choices")
        if not choices:
            continue
        now = time.perf_counter() - started
        first_chunk = now if first_chunk is None else first_chunk
        if choices[0].get("delta", {}).get("content"):
            first_content = now
            break
        chunks_before_content += 1
    for _ in response:  # the rest of the answer, so the server is idle for the next one
        pass
    total = time.perf_counter() - started
    connection.close()
    return {
        "first_chunk_s": first_chunk, "first_content_s": first_content, "total_s": total,
        "chunks_before_content": chunks_before_content,
    }  # fmt: skip


def probe(base_url: str, model: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Sends `prompts` one after another; medians in ms and every request's figures."""
    requests = [stream_chat(base_url, model, prompt, max_tokens) for prompt in prompts]
    return {
        "requests": requests,
        "first_chunk_ms_median": _median_ms(r["first_chunk_s"] for r in requests),
        "first_content_ms_median": _median_ms(r["first_content_s"] for r in requests),
        "first_content_ms_mean": round(
            1000 * statistics.mean(r["first_content_s"] or 0 for r in requests), 1
        ),
        "max_gap_ms": max_gap_ms(requests),
    }


def server_ttft_totals(base_url: str) -> tuple[float, int]:
    """The server's own TTFT (request arrival to first token), summed over every request so
    far, and their count, from `vllm:time_to_first_token_seconds` in /metrics. Two readings
    bracket a run: their difference is the server's mean over that run's requests, a floor
    for any client's TTFT of the same requests (the client also waits for the HTTP)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return parse_ttft_totals(text)


def parse_ttft_totals(metrics_text: str) -> tuple[float, int]:
    seconds, count = 0.0, 0
    for line in metrics_text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("vllm:time_to_first_token_seconds_sum"):
            seconds += float(value)
        elif name.startswith("vllm:time_to_first_token_seconds_count"):
            count += int(float(value))
    return seconds, count


def mean_ms_between(before: tuple[float, int], after: tuple[float, int]) -> float | None:
    """The server's mean TTFT in ms over the requests between two readings."""
    count = after[1] - before[1]
    return round(1000 * (after[0] - before[0]) / count, 1) if count else None


def max_gap_ms(requests: list[dict[str, Any]]) -> float | None:
    """The longest wait from the first chunk to the first content over `requests` (None when
    a request got no content at all: then the gap has no end)."""
    gaps = [r["first_content_s"] - r["first_chunk_s"] for r in requests
            if r["first_content_s"] is not None]  # fmt: skip
    return round(1000 * max(gaps), 2) if len(gaps) == len(requests) and gaps else None


def _median_ms(seconds) -> float | None:
    values = [s for s in seconds if s is not None]
    return round(1000 * statistics.median(values), 1) if values else None
