"""`pagedllm bench serve`: an asyncio load generator for any OpenAI-compatible server.

Owns the run: its validated config (`ServeBenchConfig`), turning dataset requests into
prompts (text through a tokenizer, or token ids), the arrival schedule (Poisson, or gamma
with a burstiness, as vLLM), sending streaming requests with aiohttp and recording when
each content chunk arrives, and the report (table on stdout, JSON). The numbers themselves
come from `serve_metrics`; the figure from `plots`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from pagedllm.entrypoints.bench.datasets import FIRST_PLAIN_TOKEN_ID, BenchRequest
from pagedllm.entrypoints.bench.runs import format_table
from pagedllm.entrypoints.bench.serve_metrics import (
    METRICS,
    RequestOutcome,
    compute_metrics,
    parse_goodput,
    per_request_arrays,
    token_rate_series,
)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
PROMPT_FORMATS = ("text", "token-ids")
# Without a tokenizer, token ids are drawn below this; every common vocabulary is larger.
TOKENIZER_FREE_VOCAB_SIZE = 32000
# Common English words, one token each (with their leading space) in BPE vocabularies, so
# a tokenizer-free prompt of N ids is about N tokens long on the server.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her an be this are which "
    "or had not but it were they all one have has more time when their there been some can"
)
_WORDS = _WORD_TEXT.split()
_ERROR_TEXT_LIMIT = 300


@dataclass(frozen=True)
class ServeBenchConfig:
    """Everything a `bench serve` run needs besides its prompts; checked at construction."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    goodput: tuple[str, ...] = ()
    percentile_metrics: tuple[str, ...] = METRICS
    metric_percentiles: tuple[float, ...] = (90.0, 99.0)
    prompt_format: str = "text"
    api_key: str | None = dataclasses.field(default=None, repr=False)
    request_timeout_s: float = 3600.0
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(
                f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}"
            )
        if not self.request_rate > 0:
            raise ValueError(
                f"request_rate must be > 0 (inf: all at once), got {self.request_rate}"
            )
        if not 0 < self.burstiness < math.inf:
            raise ValueError(f"burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        self._check_report_settings()
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}")
        if self.prompt_format == "token-ids" and self.is_chat:
            raise ValueError("prompt_format token-ids needs /v1/completions: chat takes text")

    def _check_report_settings(self) -> None:
        parse_goodput(self.goodput)
        unknown = set(self.percentile_metrics) - set(METRICS)
        if unknown or not self.percentile_metrics:
            raise ValueError(
                f"percentile_metrics must be some of {', '.join(METRICS)}, "
                f"got {', '.join(self.percentile_metrics) or 'none'}"
            )
        if not all(0 < q <= 100 for q in self.metric_percentiles):
            raise ValueError(
                f"metric_percentiles must be in (0, 100], got {self.metric_percentiles}"
            )

    @property
    def is_chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def slos(self) -> dict[str, float]:
        return parse_goodput(self.goodput)

    def public(self) -> dict[str, Any]:
        """The config for the JSON report: without the API key."""
        report = dataclasses.asdict(self)
        del report["api_key"]
        # JSON has no infinity: write "inf" as the flag takes it.
        if math.isinf(self.request_rate):
            report["request_rate"] = "inf"
        return report


@dataclass(frozen=True)
class Prompt:
    """What one request sends: text or token ids, with the dataset's lengths."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


class WordCodec:
    """Stands in for a tokenizer with --tokenizer-free: a token id decodes to a common word,
    and the words of a text prompt (file dataset) get ids that decode back to them."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self._ids:
                self._ids[word] = FIRST_PLAIN_TOKEN_ID + len(self._ids)
                self._words[self._ids[word]] = word
            ids.append(self._ids[word])
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return " ".join(self._words.get(t) or _WORDS[t % len(_WORDS)] for t in token_ids)


def load_prompt_tokenizer(
    tokenizer: str | None, tokenizer_free: bool, vocab_size: int | None
) -> tuple[Any, int]:
    """The tokenizer that turns dataset ids into text, and the vocab size ids are drawn from.

    Without --tokenizer, the default model's tokenizer when it is installed; else (or with
    --tokenizer-free) a `WordCodec`, with a warning when it was not asked for."""
    if vocab_size is not None and vocab_size <= FIRST_PLAIN_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_PLAIN_TOKEN_ID}, got {vocab_size}")
    if not tokenizer_free:
        from pagedllm.model.loader import load_tokenizer, resolve_model

        try:
            loaded = load_tokenizer(resolve_model(tokenizer))
            return loaded, vocab_size or len(loaded)
        except ValueError as error:
            if tokenizer is not None:
                raise ValueError(f"tokenizer {tokenizer!r}: {error}") from error
            print(f"warning: no tokenizer ({error}); sending word prompts", file=sys.stderr)
    return WordCodec(), vocab_size or TOKENIZER_FREE_VOCAB_SIZE


def prepare_prompts(
    requests: Sequence[BenchRequest], tokenizer: Any, prompt_format: str
) -> list[Prompt]:
    def render(ids: list[int]) -> str | list[int]:
        return list(ids) if prompt_format == "token-ids" else tokenizer.decode(ids)

    return [
        Prompt(render(r.prompt_token_ids), len(r.prompt_token_ids), r.output_len) for r in requests
    ]


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request is sent, in seconds after the first (which goes at 0).

    Gaps are gamma(shape=burstiness, mean=1/rate), as vLLM: burstiness 1 is a Poisson
    process, below 1 burstier, above 1 more regular. rate inf sends everything at once."""
    if count <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * count
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def build_payload(config: ServeBenchConfig, model: str, prompt: Prompt) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model}
    if config.is_chat:
        payload["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        payload["prompt"] = prompt.prompt
    payload.update(
        max_tokens=prompt.output_len,
        temperature=config.temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    # Only when asked: servers that do not know the field (OpenAI's own) may reject it.
    if config.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def sse_data(line: bytes) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    text = line.decode("utf-8", errors="replace").strip()
    if not text.startswith("data:"):
        return None
    return text[len("data:") :].strip()


def chunk_has_content(chunk: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries output: text, a chat delta's content (or reasoning),
    or token ids; role-only deltas, finish chunks and the usage chunk do not."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if (
            choice.get("text")
            or choice.get("token_ids")
            or delta.get("content")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
        ):
            return True
    return False


class StreamError(ValueError):
    """The server streamed an error event, or something that is not a completion stream."""


async def _read_stream(
    response: aiohttp.ClientResponse, chunk_times: list[float], clock: Callable[[], float]
) -> dict[str, Any] | None:
    """Reads the SSE stream to its end, appending the time of every content chunk; returns
    the last usage the server sent (None if it sent none)."""
    usage = None
    saw_data = False
    async for line in response.content:
        data = sse_data(line)
        if data is None:
            continue
        saw_data = True
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise StreamError(f"chunk is not an object: {data[:_ERROR_TEXT_LIMIT]}")
        if chunk.get("error"):
            raise StreamError(f"server error: {json.dumps(chunk['error'])[:_ERROR_TEXT_LIMIT]}")
        if chunk_has_content(chunk):
            chunk_times.append(clock())
        usage = chunk.get("usage") or usage
    if not saw_data:
        raise StreamError("the response has no SSE data lines (is streaming supported?)")
    return usage


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def send_request(
    session: aiohttp.ClientSession,
    config: ServeBenchConfig,
    payload: dict[str, Any],
    prompt_len: int,
    clock: Callable[[], float],
) -> RequestOutcome:
    """One streaming request; every failure (connection, HTTP status, stream) is returned as
    an outcome with its error text rather than raised, so a run always completes."""
    chunk_times: list[float] = []
    send_time = clock()
    try:
        async with session.post(config.url, json=payload, headers=_headers(config.api_key)) as r:
            if r.status != 200:
                body = (await r.text()).strip()[:_ERROR_TEXT_LIMIT]
                error = f"HTTP {r.status}: {body}"
                return RequestOutcome(send_time, clock(), prompt_tokens=prompt_len, error=error)
            usage = await _read_stream(r, chunk_times, clock)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as error:
        return RequestOutcome(
            send_time, clock(), tuple(chunk_times), prompt_tokens=prompt_len, error=_describe(error)
        )
    end_time = clock()
    return RequestOutcome(
        send_time,
        end_time,
        tuple(chunk_times),
        output_tokens=_usage_count(usage, "completion_tokens", len(chunk_times)),
        prompt_tokens=_usage_count(usage, "prompt_tokens", prompt_len),
    )


def _usage_count(usage: Any, key: str, fallback: int) -> int:
    """A token count from the server's usage when it sent a sensible one, else `fallback`
    (content chunks for output, the dataset's length for the prompt)."""
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and value > 0 else fallback


async def fetch_default_model(session: aiohttp.ClientSession, config: ServeBenchConfig) -> str:
    """The first model id the server lists at GET /v1/models."""
    url = config.base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=_headers(config.api_key)) as response:
            response.raise_for_status()
            listing = await response.json(content_type=None)
        return str(listing["data"][0]["id"])
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, LookupError, TypeError) as e:
        raise ValueError(f"model: none given and GET {url} named none: {_describe(e)}") from e


async def run_requests(
    config: ServeBenchConfig, prompts: Sequence[Prompt], progress: tqdm
) -> tuple[list[RequestOutcome], float, str]:
    """Sends every prompt on its arrival schedule, at most max_concurrency in flight.

    Returns the outcomes in prompt order, the run's duration (s) and the model used."""
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    # No connection cap of aiohttp's own: the semaphore is the only limit, as asked.
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await fetch_default_model(session, config)
        offsets = arrival_offsets(len(prompts), config.request_rate, config.burstiness, config.seed)
        limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        start = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - start

        async def one(prompt: Prompt, offset: float) -> RequestOutcome:
            await asyncio.sleep(max(0.0, offset - clock()))
            async with limit or contextlib.nullcontext():
                payload = build_payload(config, model, prompt)
                outcome = await send_request(session, config, payload, prompt.prompt_len, clock)
            progress.update(1)
            return outcome

        outcomes = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets, strict=True)))
        duration = clock()
    return list(outcomes), duration, model


def run_serve_benchmark(config: ServeBenchConfig, prompts: Sequence[Prompt]) -> dict[str, Any]:
    """Runs the benchmark and returns the full report (metrics and per-request arrays)."""
    with tqdm(total=len(prompts), disable=config.disable_tqdm, desc="requests") as progress:
        outcomes, duration, model = asyncio.run(run_requests(config, prompts, progress))
    metrics = compute_metrics(
        outcomes, duration, config.slos, config.percentile_metrics, config.metric_percentiles
    )
    return {
        "model": model,
        "config": config.public(),
        **metrics,
        "output_throughput_series": token_rate_series(outcomes, duration),
        **per_request_arrays(outcomes),
    }


_METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def format_report(report: dict[str, Any]) -> str:
    """The report as vLLM's `bench serve` prints it, in `format_table`'s layout."""

    def number(value: float | None, digits: int = 2) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    config = report["config"]
    rows: dict[str, Any] = {
        "Model": report["model"],
        "Successful requests": report["completed"],
        "Failed requests": report["failed"],
        "Benchmark duration (s)": number(report["duration"]),
        "Total input tokens": report["total_input_tokens"],
        "Total generated tokens": report["total_output_tokens"],
        "Request rate sent (req/s)": number(report["request_send_rate"]),
        "Request throughput (req/s)": number(report["request_throughput"]),
        "Output token throughput (tok/s)": number(report["output_throughput"]),
        "Total token throughput (tok/s)": number(report["total_token_throughput"]),
    }
    if report["request_goodput"] is not None:
        rows["Request goodput (req/s)"] = number(report["request_goodput"])
    for metric in config["percentile_metrics"]:
        rows[f"--- {_METRIC_TITLES[metric]}"] = ""
        stats = [k[: -len(f"_{metric}_ms")] for k in report if k.endswith(f"_{metric}_ms")]
        for stat in stats:
            label = stat.capitalize() if stat in ("mean", "median", "std") else stat.upper()
            rows[f"{label} {metric.upper()} (ms)"] = number(report[f"{stat}_{metric}_ms"])
    first_error = next((e for e in report["errors"] if e), None)
    if first_error:
        rows["First error"] = first_error
    return format_table("Serving Benchmark Result", rows)
