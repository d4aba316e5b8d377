"""A soak of mixed traffic against `pagedllm serve`: does it stay up, answer everyone, and
hold its memory and file descriptors over a long run?

Starts the server (two tenants from a keys file, `--scheduling-policy fair`, restart on
engine failure), then keeps `--concurrency` clients busy for `--duration` seconds with a mix
of streaming chat, plain completions, n > 1, structured output, tool calls, streams the
client aborts after a few chunks, requests whose client disconnects before the answer, and
bad requests. Every request is classed:

- completed: a good request answered 200 and complete (finish_reason on every choice;
  a stream ended by `[DONE]` with no error event);
- refused: a bad request answered 4xx in OpenAI's error shape, or any request answered
  429/503 with Retry-After (overload is allowed to refuse);
- cancelled: the client went away on purpose (abort, disconnect);
- failed: anything else (5xx, a good request refused, an incomplete 200, a connection error).

Resident memory and open files of the API process and the engine core are read after a
warm-up and again after the run once the server is idle; restarts from /metrics.

    .venv/bin/python -m benchmarks.soak [--duration 1800 --concurrency 8 --output-json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from benchmarks.peers.servers import Server
from benchmarks.tenant_server import start_tenant_server

KEYS = {"tenant-a": "sk-soak-a", "tenant-b": "sk-soak-b"}
# /metrics shows a tenant only its own series: the engine-wide ones are read as the admin.
ADMIN_KEY = "sk-soak-admin"
WARMUP_REQUESTS = 2
# After the run: how long the server may take to go idle (blocks back, queues empty).
SETTLE_S = 10.0

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# Bodies every one of which the server must refuse with a 4xx (raw text: NaN, surrogates).
BAD_BODIES = [
    '{"prompt": "hi", "max_tokens": 4, "temperature": NaN}',
    '{"prompt": "hi", "max_tokens": 4, "top_p": Infinity}',
    '{"prompt": "hi", "max_tokens": 4, "seed": 18446744073709551615, "n": 2}',
    '{"prompt": "hi", "max_tokens": 99999999999999999999999999}',
    '{"prompt": "hi \\ud800", "max_tokens": 4}',
    '{"prompt": [[1, 2, 49152]], "max_tokens": 4}',
    '{"prompt": "hi", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [49152]}',
    '{"prompt": "hi", "max_tokens": 4, "logit_bias": {"99999999": 1}}',
    '{"prompt": "hi", "max_tokens": 4, "no_such_field": 1}',
    '{"prompt": 5, "max_tokens": "four"}',
    '{"prompt": "hi", "max_tokens": 4, "n": 0}',
    "{not json",
    json.dumps({"prompt": "hi", "max_tokens": 4, "guided_json": _deep_schema(120)}),
]


def chat(content: str, **fields: Any) -> dict:
    return {"messages": [{"role": "user", "content": content}], **fields}


class Soak:
    def __init__(self, base_url: str, seed: int) -> None:
        self.base_url = base_url
        self.random = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.failures: list[str] = []
        self.statuses: Counter[int] = Counter()

    def headers(self) -> dict[str, str]:
        key = self.random.choice(list(KEYS.values()))
        return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def record(self, kind: str, outcome: str, detail: str = "") -> None:
        self.kinds[kind] += 1
        self.counts[outcome] += 1
        if outcome == "failed" and len(self.failures) < 50:
            self.failures.append(f"{kind}: {detail[:300]}")

    async def post(self, session: aiohttp.ClientSession, path: str, body: Any, **kwargs):
        data = body if isinstance(body, str) else json.dumps(body)
        return session.post(self.base_url + path, data=data, headers=self.headers(), **kwargs)

    # ---- the kinds of traffic ------------------------------------------------------------
    async def plain(self, session) -> tuple[str, str]:
        body = {"prompt": "The capital of France is", "max_tokens": 16}
        return await self.json_request(session, "/v1/completions", body, choices=1)

    async def parallel(self, session) -> tuple[str, str]:
        body = {"prompt": "Once upon a time", "max_tokens": 12, "n": 3, "temperature": 0.8}
        return await self.json_request(session, "/v1/completions", body, choices=3)

    async def structured(self, session) -> tuple[str, str]:
        body = chat(
            "Describe a person as JSON.",
            max_tokens=48,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
            },
        )
        return await self.json_request(session, "/v1/chat/completions", body, choices=1)

    async def tools(self, session) -> tuple[str, str]:
        body = chat("What is the weather in Paris?", max_tokens=48, tools=[WEATHER_TOOL],
                    tool_choice="required")  # fmt: skip
        return await self.json_request(session, "/v1/chat/completions", body, choices=1)

    async def stream(self, session) -> tuple[str, str]:
        body = chat("Write a short poem about the sea.", max_tokens=32, stream=True)
        return await self.stream_request(session, body, abort_after=None)

    async def abort(self, session) -> tuple[str, str]:
        body = chat("Count from one to one hundred.", max_tokens=64, stream=True)
        return await self.stream_request(session, body, abort_after=2)

    async def disconnect(self, session) -> tuple[str, str]:
        body = {"prompt": "Tell me a long story.", "max_tokens": 64}
        try:
            async with await self.post(
                session, "/v1/completions", body, timeout=aiohttp.ClientTimeout(total=0.3)
            ) as reply:
                await reply.read()
                return self.judge_json(reply.status, await reply.json(), choices=1)
        except TimeoutError:
            return "cancelled", ""

    async def bad(self, session) -> tuple[str, str]:
        body = self.random.choice(BAD_BODIES)
        async with await self.post(session, "/v1/completions", body) as reply:
            payload = await reply.json(content_type=None)
            self.statuses[reply.status] += 1
            if 400 <= reply.status < 500 and isinstance(payload.get("error"), dict):
                return "refused", ""
            return "failed", f"HTTP {reply.status} for {body[:80]}: {payload}"

    # ---- judging answers -----------------------------------------------------------------
    async def json_request(self, session, path: str, body: dict, choices: int):
        async with await self.post(session, path, body) as reply:
            payload = await reply.json(content_type=None)
            return self.judge_json(reply.status, payload, choices)

    def judge_json(self, status: int, payload: Any, choices: int) -> tuple[str, str]:
        self.statuses[status] += 1
        if status in (429, 503):
            return "refused", ""
        if status != 200:
            return "failed", f"HTTP {status}: {payload}"
        got = payload.get("choices") or []
        if len(got) != choices or not all(c.get("finish_reason") for c in got):
            return "failed", f"incomplete: {payload}"
        return "completed", ""

    async def stream_request(self, session, body: dict, abort_after: int | None):
        async with await self.post(session, "/v1/chat/completions", body) as reply:
            self.statuses[reply.status] += 1
            if reply.status in (429, 503):
                return "refused", ""
            if reply.status != 200:
                return "failed", f"HTTP {reply.status}: {await reply.text()}"
            chunks, finished = 0, False
            async for line in reply.content:
                text = line.decode().strip()
                if not text.startswith("data:"):
                    continue
                data = text[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return "failed", f"error event: {chunk}"
                chunks += 1
                finished |= any(c.get("finish_reason") for c in chunk.get("choices", ()))
                if abort_after is not None and chunks >= abort_after:
                    return "cancelled", ""  # leaving the block closes the connection
            if abort_after is not None:
                return "completed" if finished else "failed", "stream ended early"
            return ("completed", "") if finished else ("failed", "no finish_reason")

    # ---- the run -------------------------------------------------------------------------
    def kinds_table(self) -> list[tuple[str, float, Callable[[Any], Awaitable]]]:
        return [
            ("stream", 3, self.stream),
            ("plain", 2, self.plain),
            ("parallel", 1, self.parallel),
            ("structured", 1, self.structured),
            ("tools", 1, self.tools),
            ("abort", 1, self.abort),
            ("disconnect", 1, self.disconnect),
            ("bad", 2, self.bad),
        ]

    async def client(self, session, deadline: float) -> None:
        table = self.kinds_table()
        weights = [w for _, w, _ in table]
        while time.monotonic() < deadline:
            kind, _, send = self.random.choices(table, weights)[0]
            try:
                outcome, detail = await send(session)
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as error:
                outcome, detail = "failed", f"{type(error).__name__}: {error}"
            self.record(kind, outcome, detail)

    async def run(self, duration_s: float, concurrency: int) -> float:
        deadline = time.monotonic() + duration_s
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            started = time.monotonic()
            await asyncio.gather(*(self.client(session, deadline) for _ in range(concurrency)))
            return time.monotonic() - started


def process_usage(server: Server) -> dict[str, dict[str, int]]:
    """RSS (bytes) and open file descriptors of the API process and its children."""
    root = psutil.Process(server.process.pid)
    usage = {}
    for name, process in [("api", root), *(("core", c) for c in root.children(recursive=True))]:
        usage[name] = {"rss": process.memory_info().rss, "open_fds": process.num_fds()}
    return usage


def scrape(base_url: str, names: tuple[str, ...]) -> dict[str, float]:
    """The sum over series of each named metric on /metrics."""
    import urllib.request

    request = urllib.request.Request(
        base_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        text = reply.read().decode()
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for name in names:
            if line.startswith((f"pagedllm:{name}{{", f"pagedllm:{name} ")):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def growth(before: dict, after: dict) -> dict[str, dict[str, float]]:
    return {
        proc: {
            key: round(100.0 * (after[proc][key] - value) / value, 2)
            for key, value in before[proc].items()
        }
        for proc in before
        if proc in after
    }


async def warm_up(base_url: str) -> None:
    soak = Soak(base_url, seed=0)
    async with aiohttp.ClientSession() as session:
        for _ in range(WARMUP_REQUESTS):
            await soak.plain(session)
            await soak.structured(session)
            await soak.tools(session)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-memory",
        default="1GiB",
        help="the server's KV pool; small enough to be faulted in whole before the first reading",
    )
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--out-dir", default="benchmarks/out/soak", help="server log, keys file")
    args = parser.parse_args()

    flags = [
        "--scheduling-policy", "fair", "--restart-on-engine-failure",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--kv-cache-memory", args.kv_cache_memory, "--admin-api-key", ADMIN_KEY,
    ]  # fmt: skip
    server = start_tenant_server("soak", KEYS, Path(args.out_dir), flags)
    try:
        asyncio.run(warm_up(server.base_url))
        time.sleep(2.0)
        before = process_usage(server)
        soak = Soak(server.base_url, args.seed)
        seconds = asyncio.run(soak.run(args.duration, args.concurrency))
        time.sleep(SETTLE_S)
        after = process_usage(server)
        metrics = scrape(server.base_url, ("engine_restarts_total", "kv_cache_usage_perc"))
    finally:
        server.stop()
    report = {
        "duration_s": round(seconds, 1),
        "concurrency": args.concurrency,
        "sent": sum(soak.counts.values()),
        **{outcome: soak.counts[outcome] for outcome in ("completed", "refused", "cancelled")},
        "failed": soak.counts["failed"],
        "by_kind": dict(soak.kinds),
        "http_statuses": {str(k): v for k, v in sorted(soak.statuses.items())},
        "num_5xx": sum(v for k, v in soak.statuses.items() if k >= 500),
        "engine_restarts": metrics["engine_restarts_total"],
        "kv_cache_usage_at_end": metrics["kv_cache_usage_perc"],
        "usage_before": before,
        "usage_after": after,
        "growth_percent": growth(before, after),
        "server_exit_code": server.process.returncode,
        "failures": soak.failures,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    return 0 if report["failed"] == 0 and report["num_5xx"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
