"""`pagedllm run-batch` (vLLM's `vllm run-batch`): an OpenAI batch file run through the offline
engine.

Input: one request a line in OpenAI's batch format, `{"custom_id", "method": "POST", "url",
"body"}`, url /v1/chat/completions, /v1/completions or /v1/embeddings. Output: one record a
line in OpenAI's batch output format, `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`, in input order.

Every body goes through the server's own checks and conversion (its pydantic request models,
`prepare_chat` / `prepare_completion` / `prepare_embedding`, the engine's input processor),
so a body the server refuses gets the server's status and error body, and a good one the
body the server would answer. All good requests then run in one `LLM.generate` (or
`LLM.embed`) call, for the engine's full throughput. A line that is no request (not JSON, no
custom_id, an unknown url, a url this engine's runner does not serve) gets a record with
`error` set instead.

Records already in the output file are kept and their custom_ids skipped: re-running after
an interruption appends only what is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import _validation_message, as_openai_error, error_body
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import (
    OpenAIServingEmbedding,
    embedding_response_body,
)
from pagedllm.errors import InvalidRequestError, RequestFailedError
from pagedllm.pooling_params import POOLING_SAMPLING_PARAMS
from pagedllm.sampling_params import SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
GENERATE_URLS = (CHAT_URL, COMPLETIONS_URL)
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


# ---- the batch file ---------------------------------------------------------------------------


@dataclass
class BatchRequest:
    line: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: Any


class LineError(Exception):
    """A line that is no batch request; its record has `error` set (OpenAI's error codes)."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.custom_id = custom_id


def parse_line(text: str, line: int) -> BatchRequest:
    try:
        item = json.loads(text)
    except json.JSONDecodeError as error:
        raise LineError("invalid_json", f"line {line}: not valid JSON: {error}") from None
    if not isinstance(item, dict):
        raise LineError("invalid_request", f"line {line}: must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_required_parameter", f"line {line}: custom_id: needs a string")
    unknown = sorted(set(item) - LINE_KEYS)
    if unknown:
        message = f"line {line}: unknown field(s): {', '.join(unknown)}"
        raise LineError("invalid_request", message, custom_id)
    if item.get("method") != "POST":
        message = f"line {line}: method: must be POST, got {item.get('method')!r}"
        raise LineError("invalid_request", message, custom_id)
    url = item.get("url")
    if url not in (*GENERATE_URLS, EMBEDDINGS_URL):
        supported = ", ".join((*GENERATE_URLS, EMBEDDINGS_URL))
        message = f"line {line}: url: {url!r} is not a batch url; supported: {supported}"
        raise LineError("invalid_url", message, custom_id)
    if "body" not in item:
        raise LineError("missing_required_parameter", f"line {line}: body: missing", custom_id)
    return BatchRequest(line, custom_id, url, item["body"])


def new_record(custom_id: str | None, response: dict | None, error: dict | None) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def response_record(custom_id: str, status: int, request_id: str | None, body: dict) -> dict:
    response = {"status_code": status, "request_id": request_id, "body": body}
    return new_record(custom_id, response, None)


def line_error_record(error: LineError, line: int) -> dict:
    return new_record(
        error.custom_id, None, {"code": error.code, "message": error.message, "line": line}
    )


@dataclass
class DoneSet:
    """What an earlier run already wrote: custom_ids, and the lines that had none."""

    custom_ids: set[str] = field(default_factory=set)
    lines_without_id: set[int] = field(default_factory=set)

    def has(self, custom_id: str | None, line: int) -> bool:
        if custom_id is None:
            return line in self.lines_without_id
        return custom_id in self.custom_ids


def read_done(path: str) -> DoneSet:
    """The records in an existing output file. A last line cut short (the run was killed while
    writing it) is dropped from the file, so the records appended after it stay whole."""
    done = DoneSet()
    if not os.path.exists(path):
        return done
    with open(path, "rb+") as file:
        data = file.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            file.truncate(end)
    for text in data[:end].decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        custom_id = record.get("custom_id")
        if isinstance(custom_id, str):
            done.custom_ids.add(custom_id)
        elif isinstance(record.get("error"), dict) and isinstance(record["error"].get("line"), int):
            done.lines_without_id.add(record["error"]["line"])
    return done


def read_requests(
    lines: Iterable[str], done: DoneSet, skipped: list[int] | None = None
) -> Iterator[BatchRequest | dict]:
    """Each line not done yet: its request, or its record if it is no request. The line
    numbers of those done already go to `skipped`."""
    seen: set[str] = set()
    skipped = [] if skipped is None else skipped
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            request = parse_line(text, number)
        except LineError as error:
            if done.has(error.custom_id, number):
                skipped.append(number)
            else:
                yield line_error_record(error, number)
            continue
        if done.has(request.custom_id, number):
            skipped.append(number)
            continue
        if request.custom_id in seen:
            message = f"line {number}: custom_id {request.custom_id!r} is used by an earlier line"
            yield line_error_record(LineError("duplicate_custom_id", message), number)
            continue
        seen.add(request.custom_id)
        yield request


# ---- the engine ------------------------------------------------------------------------------


class OfflineEngineView:
    """What the server's request handling (`OpenAIServing`) reads from its engine, over the
    offline engine: checks and conversion only; the `LLM` runs the requests. Nothing queues
    here, so the server's queue limits never refuse."""

    is_dead = False

    def __init__(self, llm_engine: Any) -> None:
        from pagedllm.frontend.admission import AdmissionQueue

        self.tokenizer = llm_engine.tokenizer
        self.model_config = llm_engine.model_config
        self.config = llm_engine.config
        self.input_processor = llm_engine.input_processor
        self.process_inputs = llm_engine.process_inputs
        self.admission = AdmissionQueue()


@dataclass
class Accepted:
    """One request the server's checks let through: its engine prompts, in batch order."""

    request: BatchRequest
    parsed: Any  # ChatCompletionRequest | CompletionRequest | EmbeddingRequest
    prepared: Any  # PreparedChat | PreparedCompletion | PreparedEmbedding
    request_id: str
    prompts: list[dict]
    params: list[SamplingParams]


class BatchRunner:
    """Checks every request as the server does, runs the accepted ones in one engine call
    (`LLM.generate`, or `LLM.embed` on a pooling engine), and builds every record."""

    def __init__(self, llm: Any, config: ServerConfig, use_tqdm: bool = True) -> None:
        self.llm = llm
        self.use_tqdm = use_tqdm
        self.engine = OfflineEngineView(llm.llm_engine)
        # The engine either generates or embeds; lines for the other kind are refused.
        self.pooling = self.engine.config.pooler_config is not None
        self.chat = OpenAIServingChat(self.engine, config)  # type: ignore[arg-type]
        self.completion = OpenAIServingCompletion(self.engine, config)  # type: ignore[arg-type]
        self.embedding = OpenAIServingEmbedding(self.engine, config)  # type: ignore[arg-type]

    def run(self, items: list[BatchRequest | dict]) -> list[dict]:
        """One record per item, in order."""
        records: list[dict | None] = [i if isinstance(i, dict) else None for i in items]
        requests = []
        for index, item in enumerate(items):
            if not isinstance(item, BatchRequest):
                continue
            if (item.url == EMBEDDINGS_URL) != self.pooling:
                records[index] = line_error_record(runner_error(item, self.pooling), item.line)
            else:
                requests.append((index, item))
        accepted = []
        for index, outcome in asyncio.run(self._prepare_all(requests)):
            if isinstance(outcome, Accepted):
                accepted.append((index, outcome))
            else:
                records[index] = outcome
        for index, record in self._execute(accepted):
            records[index] = record
        assert all(record is not None for record in records)
        return records  # type: ignore[return-value]

    # ---- checks and conversion: the server's --------------------------------------------------
    async def _prepare_all(
        self, requests: list[tuple[int, BatchRequest]]
    ) -> list[tuple[int, Accepted | dict]]:
        return [(index, await self._prepare(request)) for index, request in requests]

    async def _prepare(self, request: BatchRequest) -> Accepted | dict:
        """The request accepted, or its record with the error the server would answer."""
        try:
            return await self._prepare_or_raise(request)
        except ValidationError as error:
            message, param = validation_message(error)
            return response_record(request.custom_id, 400, None, error_body(400, message, param))
        except Exception as error:
            mapped = as_openai_error(error)
            body = error_body(mapped.status, mapped.message, mapped.param)
            return response_record(request.custom_id, mapped.status, None, body)

    async def _prepare_or_raise(self, request: BatchRequest) -> Accepted:
        pooling_params = None
        if request.url == CHAT_URL:
            parsed = ChatCompletionRequest.model_validate(request.body)
            prepared = await self.chat.prepare_chat(parsed)
            prompts, params, prefix = [prepared.prompt], [prepared.params], "chatcmpl"
        elif request.url == COMPLETIONS_URL:
            parsed = CompletionRequest.model_validate(request.body)
            prepared = await self.completion.prepare_completion(parsed)
            prompts, params, prefix = prepared.prompts, prepared.params, "cmpl"
        else:
            parsed = EmbeddingRequest.model_validate(request.body)
            prepared = await self.embedding.prepare_embedding(parsed)
            prompts, prefix = prepared.prompts, "embd"
            params = [POOLING_SAMPLING_PARAMS] * len(prompts)
            pooling_params = prepared.pooling_params
        if getattr(parsed, "stream", False):
            raise InvalidRequestError("stream: a batch request cannot stream", "stream")
        request_id = parsed.request_id or f"{prefix}-{uuid.uuid4().hex}"
        salt = {} if parsed.cache_salt is None else {"cache_salt": parsed.cache_salt}
        engine_prompts = [
            {"prompt_token_ids": prompt.token_ids, "prompt": prompt.text, **salt}
            for prompt in prompts
        ]
        # The engine's own checks, as the server's `generations` runs them before starting.
        for i, (prompt, prompt_params) in enumerate(zip(engine_prompts, params, strict=True)):
            self.engine.process_inputs(
                request_id if len(prompts) == 1 else f"{request_id}-{i}",
                prompt,
                prompt_params,
                parsed.priority,
                lora_request=prepared.lora_request,
                pooling_params=pooling_params,
            )
        return Accepted(request, parsed, prepared, request_id, engine_prompts, params)

    # ---- one engine call for the whole batch ---------------------------------------------------
    def _execute(self, accepted: list[tuple[int, Accepted]]) -> list[tuple[int, dict]]:
        if not accepted:
            return []
        prompts = [p for _, a in accepted for p in a.prompts]
        loras = [a.prepared.lora_request for _, a in accepted for _ in a.prompts]
        if self.pooling:
            pooling = [a.prepared.pooling_params for _, a in accepted for _ in a.prompts]
            outputs = self.llm.embed(prompts, pooling, self.use_tqdm, lora_request=loras)
        else:
            params = [p for _, a in accepted for p in a.params]
            priorities = [a.parsed.priority for _, a in accepted for _ in a.prompts]
            outputs = self.llm.generate(
                prompts, params, self.use_tqdm, lora_request=loras, priority=priorities
            )
        records = []
        start = 0
        for index, request in accepted:
            finals = outputs[start : start + len(request.prompts)]
            start += len(request.prompts)
            records.append((index, self._record(request, finals)))
        return records

    def _record(self, accepted: Accepted, finals: list[Any]) -> dict:
        """The body the server answers for these outputs (a 500 if one failed in the engine,
        as the server's)."""
        custom_id, request_id = accepted.request.custom_id, accepted.request_id
        failed = next((output for output in finals if output.error is not None), None)
        if failed is not None:
            mapped = as_openai_error(RequestFailedError(request_id, failed.error))
            body = error_body(mapped.status, mapped.message, mapped.param)
            return response_record(custom_id, mapped.status, request_id, body)
        parsed, prepared = accepted.parsed, accepted.prepared
        if accepted.request.url == CHAT_URL:
            body = self.chat._response(
                request_id, parsed, prepared.prompt, finals[0], prepared.plan, prepared.model_name
            )
        elif accepted.request.url == COMPLETIONS_URL:
            body = self.completion._response(
                request_id, parsed, prepared.prompts, dict(enumerate(finals)), prepared.model_name
            )
        else:
            body = embedding_response_body(
                request_id, prepared.model_name, finals, parsed.encoding_format
            )
        return response_record(custom_id, 200, request_id, body)


def runner_error(request: BatchRequest, pooling: bool) -> LineError:
    if pooling:
        message = (
            f"line {request.line}: url: {request.url} needs an engine that generates "
            "(--runner generate); this one embeds (--runner pooling)"
        )
    else:
        message = (
            f"line {request.line}: url: {request.url} needs an engine started with "
            "--runner pooling; this one generates (--runner generate)"
        )
    return LineError("unsupported_url", message, request.custom_id)


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """The server's 400 message and `param` for a body its request model refused (FastAPI's
    RequestValidationError carries the same pydantic error list)."""
    return _validation_message(error)  # type: ignore[arg-type]


def write_records(path: str, records: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
