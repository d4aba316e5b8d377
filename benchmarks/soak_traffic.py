"""The soak's requests (`benchmarks.soak` runs them): what each kind sends and how its answer
is classed, as `Attempt`s; `soak_chaos.final_class` then tells the engine kills' casualties
from failures.

Classes:
- completed: a good request answered 200 and complete (finish_reason on every choice; a
  stream ended by `[DONE]` with no error event; a response `completed` or `incomplete`);
- refused: a bad request answered 4xx in OpenAI's error shape; any request answered 429/503
  (overload and an engine restarting are allowed to refuse); a request naming a runtime LoRA
  adapter answered 404 on `model` when that adapter was unloaded after the request was sent;
- cancelled: the client went away on purpose (abort, disconnect);
- failed: anything else (5xx, a good request refused, an incomplete 200, a connection error,
  a `previous_response_id` the store no longer knows).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from benchmarks.soak_loras import AdapterPool
from benchmarks.tenant_server import prompt_text

KEYS = {"tenant-a": "sk-soak-a", "tenant-b": "sk-soak-b", "tenant-c": "sk-soak-c"}
# Loads and unloads adapters, reads every tenant's series on /metrics.
ADMIN_KEY = "sk-soak-admin"
# Prompts of the disk-tier kind start with one of these long prefixes (hits in the pool,
# written through to the disk tier, read back from it by each new core after a kill).
NUM_PREFIXES = 4
PREFIX_WORDS = 320
# Stored response ids a tenant's follow-ups draw from (well under --responses-store-size).
RECENT_RESPONSES = 16
# A client refused with 429/503 waits this long before its next request (the server's
# Retry-After is of this order): hammering a restarting server measures nothing.
REFUSED_PAUSE_S = 1.0

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
    '{"prompt": 5, "max_tokens": "four"}',
    '{"prompt": "hi", "max_tokens": 4, "n": 0}',
    "{not json",
    json.dumps({"prompt": "hi", "max_tokens": 4, "guided_json": _deep_schema(120)}),
]


def chat(content: str, **fields: Any) -> dict:
    return {"messages": [{"role": "user", "content": content}], **fields}


@dataclass(frozen=True)
class Judged:
    outcome: str
    detail: str = ""
    status: int | None = None
    # The server's fault: a 5xx, or an error event in a 200 stream (what a kill causes).
    server_error: bool = False


@dataclass(frozen=True)
class Attempt:
    kind: str
    judged: Judged
    started: float  # time.monotonic()
    ended: float


def failed(detail: str, status: int | None = None, server_error: bool = False) -> Judged:
    if status is not None and status >= 500:
        server_error = True
    return Judged("failed", detail, status, server_error)


class Soak:
    def __init__(self, base_url: str, seed: int, adapters: AdapterPool | None = None) -> None:
        self.base_url = base_url
        self.random = random.Random(seed)
        self.adapters = adapters
        self.attempts: list[Attempt] = []
        self.stored_ids: dict[str, list[str]] = {tenant: [] for tenant in KEYS}
        prefix_rng = random.Random(1234)
        self.prefixes = [prompt_text(prefix_rng, PREFIX_WORDS) for _ in range(NUM_PREFIXES)]

    def headers(self, tenant: str | None = None) -> dict[str, str]:
        key = KEYS[tenant] if tenant is not None else self.random.choice(list(KEYS.values()))
        return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    async def post(self, session: aiohttp.ClientSession, path: str, body: Any, **kwargs):
        data = body if isinstance(body, str) else json.dumps(body)
        headers = self.headers(kwargs.pop("tenant", None))
        return session.post(self.base_url + path, data=data, headers=headers, **kwargs)

    # ---- the kinds of traffic ------------------------------------------------------------
    async def plain(self, session) -> Judged:
        body = {"prompt": "The capital of France is", "max_tokens": 16}
        return await self.json_request(session, "/v1/completions", body, choices=1)

    async def parallel(self, session) -> Judged:
        body = {"prompt": "Once upon a time", "max_tokens": 12, "n": 3, "temperature": 0.8}
        return await self.json_request(session, "/v1/completions", body, choices=3)

    async def structured(self, session) -> Judged:
        body = chat(
            "Describe a person as JSON.",
            max_tokens=48,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
            },
        )
        return await self.json_request(session, "/v1/chat/completions", body, choices=1)

    async def tools(self, session) -> Judged:
        body = chat("What is the weather in Paris?", max_tokens=48, tools=[WEATHER_TOOL],
                    tool_choice="required")  # fmt: skip
        return await self.json_request(session, "/v1/chat/completions", body, choices=1)

    async def stream(self, session) -> Judged:
        body = chat("Write a short poem about the sea.", max_tokens=32, stream=True)
        return await self.stream_request(session, body, abort_after=None)

    async def abort(self, session) -> Judged:
        body = chat("Count from one to one hundred.", max_tokens=64, stream=True)
        return await self.stream_request(session, body, abort_after=2)

    async def disconnect(self, session) -> Judged:
        body = {"prompt": "Tell me a long story.", "max_tokens": 64}
        try:
            async with await self.post(
                session, "/v1/completions", body, timeout=aiohttp.ClientTimeout(total=0.3)
            ) as reply:
                await reply.read()
                return self.judge_json(reply.status, await reply.json(), choices=1)
        except TimeoutError:
            return Judged("cancelled")

    async def bad(self, session) -> Judged:
        body = self.random.choice(BAD_BODIES)
        async with await self.post(session, "/v1/completions", body) as reply:
            payload = await reply.json(content_type=None)
            refusal = 400 <= reply.status < 500 or reply.status == 503
            if refusal and isinstance(payload.get("error"), dict):
                return Judged("refused", status=reply.status)
            return failed(f"HTTP {reply.status} for {body[:80]}: {payload}", reply.status)

    async def shared_prefix(self, session) -> Judged:
        """A long shared prefix and a short fresh tail: the disk tier's traffic."""
        tail = prompt_text(self.random, 12)
        body = {"prompt": f"{self.random.choice(self.prefixes)} {tail}", "max_tokens": 8}
        return await self.json_request(session, "/v1/completions", body, choices=1)

    async def lora(self, session) -> Judged:
        """A completion or chat on a runtime-loaded adapter (the base model when none is)."""
        name = self.adapters.pick(self.random) if self.adapters else None
        sent_at = time.monotonic()
        body: dict = {"prompt": "A LoRA adapter says", "max_tokens": 12}
        path = "/v1/completions"
        if self.random.random() < 0.5:
            body, path = chat("Say something.", max_tokens=12), "/v1/chat/completions"
        if name is not None:
            body["model"] = name
        async with await self.post(session, path, body) as reply:
            payload = await reply.json(content_type=None)
            if reply.status == 404 and name is not None:
                error = payload.get("error") or {}
                if error.get("param") == "model" and self.adapters.unloaded_since(name, sent_at):
                    return Judged("refused", "adapter unloaded meanwhile", 404)
            return self.judge_json(reply.status, payload, choices=1)

    async def responses(self, session) -> Judged:
        """A stored response, or a follow-up on one of the tenant's recent ones."""
        tenant = self.random.choice(list(KEYS))
        recent = self.stored_ids[tenant]
        body: dict = {"input": "Name a colour.", "max_output_tokens": 12, "store": True}
        if recent and self.random.random() < 0.6:
            body |= {"input": "And another?", "previous_response_id": self.random.choice(recent)}
        async with await self.post(session, "/v1/responses", body, tenant=tenant) as reply:
            payload = await reply.json(content_type=None)
            if reply.status in (429, 503):
                return Judged("refused", status=reply.status)
            if reply.status != 200:
                return failed(f"HTTP {reply.status} for {body}: {payload}", reply.status)
            if payload.get("status") not in ("completed", "incomplete") or not payload.get("id"):
                return failed(f"incomplete response: {payload}", reply.status)
            recent.append(payload["id"])
            del recent[:-RECENT_RESPONSES]
            return Judged("completed", status=200)

    # ---- judging answers -----------------------------------------------------------------
    async def json_request(self, session, path: str, body: dict, choices: int) -> Judged:
        async with await self.post(session, path, body) as reply:
            payload = await reply.json(content_type=None)
            return self.judge_json(reply.status, payload, choices)

    def judge_json(self, status: int, payload: Any, choices: int) -> Judged:
        if status in (429, 503):
            return Judged("refused", status=status)
        if status != 200:
            return failed(f"HTTP {status}: {payload}", status)
        got = payload.get("choices") or []
        if len(got) != choices or not all(c.get("finish_reason") for c in got):
            return failed(f"incomplete: {payload}", status)
        return Judged("completed", status=status)

    async def stream_request(self, session, body: dict, abort_after: int | None) -> Judged:
        async with await self.post(session, "/v1/chat/completions", body) as reply:
            if reply.status in (429, 503):
                return Judged("refused", status=reply.status)
            if reply.status != 200:
                return failed(f"HTTP {reply.status}: {await reply.text()}", reply.status)
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
                    return failed(f"error event: {chunk}", 200, server_error=True)
                chunks += 1
                finished |= any(c.get("finish_reason") for c in chunk.get("choices", ()))
                if abort_after is not None and chunks >= abort_after:
                    return Judged("cancelled", status=200)  # leaving the block closes it
            if abort_after is not None and not finished:
                return failed("stream ended early", 200)
            return Judged("completed", status=200) if finished else failed("no finish", 200)

    # ---- the run -------------------------------------------------------------------------
    def kinds_table(self) -> list[tuple[str, float, Callable[[Any], Awaitable[Judged]]]]:
        return [
            ("stream", 3, self.stream),
            ("plain", 2, self.plain),
            ("parallel", 1, self.parallel),
            ("structured", 1, self.structured),
            ("tools", 1, self.tools),
            ("abort", 1, self.abort),
            ("disconnect", 1, self.disconnect),
            ("bad", 2, self.bad),
            ("shared_prefix", 2, self.shared_prefix),
            ("lora", 2, self.lora),
            ("responses", 2, self.responses),
        ]

    async def send(self, session, kind: str, send: Callable[[Any], Awaitable[Judged]]) -> None:
        started = time.monotonic()
        try:
            judged = await send(session)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as error:
            judged = failed(f"{type(error).__name__}: {error}")
        self.attempts.append(Attempt(kind, judged, started, time.monotonic()))
        if judged.outcome == "refused" and judged.status in (429, 503):
            await asyncio.sleep(REFUSED_PAUSE_S)

    async def client(self, session, deadline: float) -> None:
        table = self.kinds_table()
        weights = [w for _, w, _ in table]
        while time.monotonic() < deadline:
            kind, _, send = self.random.choices(table, weights)[0]
            await self.send(session, kind, send)
