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

No line can end the run: the file is read as bytes, one line at a time, and each line is
decoded and parsed on its own within bounds checked before the parser runs (its size, its
nesting, the digits of its numbers), so invalid UTF-8, a line of 100,000 `[` or a 5,000-digit
integer is that line's error record. Records are written in input order as soon as each and
those before it are ready, flushed one by one, so a killed run keeps what it finished; with
`--resume`, the records already in the output file are kept and their lines skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import _validation_message, as_openai_error, error_body
from pagedllm.entrypoints.openai.protocol import (
    MAX_REQUEST_DEPTH,
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
from pagedllm.value_checks import lone_surrogate_at

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
GENERATE_URLS = (CHAT_URL, COMPLETIONS_URL)
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})
# A line longer than this is answered with an error unread (`--max-line-bytes`).
DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024
# The line's own object around a body nested as deep as the server accepts: deeper lines
# never reach the parser, whose recursion they could exhaust.
MAX_LINE_DEPTH = MAX_REQUEST_DEPTH + 1
# Python refuses to parse integers of over 4,300 digits (and converting them is quadratic);
# no field takes more than 20. A float's digits count too: none needs this many.
MAX_NUMBER_DIGITS = 256


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


@dataclass(frozen=True)
class LineTooLong:
    """A line over the size limit, skipped unread: only its size is known."""

    size: int


# ---- bounded reading ---------------------------------------------------------------------------

_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
# The tokens that matter for a line's bounds: strings (keys apart), brackets, digit runs.
_TOKEN = re.compile(
    rf"(?P<key>{_STRING})\s*:|(?P<string>{_STRING})|(?P<open>[\[{{])|(?P<close>[\]}}])"
    r"|(?P<digits>[0-9]+)"
)
_LONG_DIGITS = re.compile(f"[0-9]{{{MAX_NUMBER_DIGITS + 1}}}")


@dataclass
class LineShape:
    """What a scan of a line's tokens found, without parsing it."""

    depth: int  # the deepest nesting of arrays and objects
    digits: int  # the longest run of digits outside strings
    custom_id: str | None  # the top-level custom_id, if it is a string


def read_lines(file: BinaryIO, max_bytes: int) -> Iterator[bytes | LineTooLong]:
    """Each line of `file` (its end of line removed), or `LineTooLong` for one over
    `max_bytes`: memory stays bounded by one line whatever the file holds."""
    while data := file.readline(max_bytes + 1):
        if len(data) > max_bytes and not data.endswith(b"\n"):
            yield LineTooLong(len(data) + _skip_line(file, max_bytes))
            continue
        yield data.rstrip(b"\r\n")


def _skip_line(file: BinaryIO, chunk: int) -> int:
    """Read past the rest of a line; its size."""
    size = 0
    while data := file.readline(chunk):
        size += len(data)
        if data.endswith(b"\n"):
            break
    return size


def line_shape(text: str) -> LineShape:
    """Nesting depth, longest digit run and top-level custom_id of a line, in one pass
    of a regular expression over its tokens (no recursion, whatever the line holds)."""
    depth = deepest = digits = 0
    custom_id, after_id_key = None, False
    for match in _TOKEN.finditer(text):
        kind = match.lastgroup
        if kind == "open":
            depth += 1
            deepest = max(deepest, depth)
        elif kind == "close":
            depth -= 1
        elif kind == "digits":
            digits = max(digits, match.end() - match.start())
        elif kind == "string" and after_id_key:
            custom_id = _json_string(match.group())
        is_id_key = kind == "key" and depth == 1 and custom_id is None
        after_id_key = is_id_key and _json_string(match.group("key")) == "custom_id"
    return LineShape(deepest, digits, custom_id)


def _json_string(token: str) -> str | None:
    """A JSON string token's value (None if its escapes are broken or it is no valid
    Unicode: no record could name it)."""
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, str) and lone_surrogate_at(value) is None else None


def decode_line(data: bytes | str, line: int, max_bytes: int) -> Any:
    """The JSON value of one line; LineError (with the custom_id when one can be read) for
    a line that is not UTF-8, is too large, too deep or has too long a number, or is not
    JSON. Nothing past the checks can raise RecursionError or run for long."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as error:
            # The custom_id may still be readable if its own bytes are valid.
            shape = line_shape(data.decode("utf-8", "surrogateescape"))
            message = f"line {line}: not valid UTF-8 (byte {error.start} of the line)"
            raise LineError("invalid_json", message, shape.custom_id) from None
    if len(data) > max_bytes:  # only a str given directly can get here
        raise LineError("line_too_large", _too_large(line, len(data), max_bytes))
    if data.count("[") + data.count("{") > MAX_LINE_DEPTH or _LONG_DIGITS.search(data):
        _check_shape(line_shape(data), line)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as error:  # the checks above make RecursionError moot
        raise LineError("invalid_json", f"line {line}: not valid JSON: {error}") from None


def _check_shape(shape: LineShape, line: int) -> None:
    if shape.depth > MAX_LINE_DEPTH:
        message = (
            f"line {line}: nested {shape.depth} deep; at most {MAX_LINE_DEPTH} levels (the "
            f"line's object around a body of {MAX_REQUEST_DEPTH}) are accepted"
        )
        raise LineError("invalid_json", message, shape.custom_id)
    if shape.digits > MAX_NUMBER_DIGITS:
        message = (
            f"line {line}: a number of {shape.digits} digits; at most {MAX_NUMBER_DIGITS} "
            "are accepted"
        )
        raise LineError("invalid_json", message, shape.custom_id)


def _too_large(line: int, size: int, max_bytes: int) -> str:
    return f"line {line}: {size} bytes; at most {max_bytes} are accepted (--max-line-bytes)"


def parse_line(
    data: bytes | str | LineTooLong, line: int, max_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> BatchRequest:
    if isinstance(data, LineTooLong):
        raise LineError("line_too_large", _too_large(line, data.size, max_bytes))
    item = decode_line(data, line, max_bytes)
    if not isinstance(item, dict):
        raise LineError("invalid_request", f"line {line}: must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_required_parameter", f"line {line}: custom_id: needs a string")
    position = lone_surrogate_at(custom_id)
    if position is not None:  # no UTF-8 record could hold it: the record names the line
        message = f"line {line}: custom_id: a lone surrogate at index {position} (not Unicode)"
        raise LineError("invalid_request", message)
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
    lines: Iterable[bytes | str | LineTooLong],
    done: DoneSet,
    skipped: list[int] | None = None,
    max_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[BatchRequest | dict]:
    """Each line not done yet: its request, or its record if it is no request. The line
    numbers of those done already go to `skipped`."""
    seen: set[str] = set()
    skipped = [] if skipped is None else skipped
    for number, text in enumerate(lines, start=1):
        if not isinstance(text, LineTooLong) and not text.strip():
            continue
        try:
            request = parse_line(text, number, max_bytes)
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

    def run(self, items: list[BatchRequest | dict], writer: RecordWriter) -> None:
        """One record per item to `writer`, each as soon as it is ready."""
        requests = []
        for index, item in enumerate(items):
            if not isinstance(item, BatchRequest):
                writer.put(index, item)
            elif (item.url == EMBEDDINGS_URL) != self.pooling:
                writer.put(index, line_error_record(runner_error(item, self.pooling), item.line))
            else:
                requests.append((index, item))
        accepted = []
        for index, outcome in asyncio.run(self._prepare_all(requests)):
            if isinstance(outcome, Accepted):
                accepted.append((index, outcome))
            else:
                writer.put(index, outcome)
        self._execute(accepted, writer)

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
    def _execute(self, accepted: list[tuple[int, Accepted]], writer: RecordWriter) -> None:
        """Run every accepted request in one engine call; each request's record goes to
        `writer` as its last prompt finishes, not when the whole call returns."""
        if not accepted:
            return
        collector = _Finals(
            accepted, lambda index, a, finals: writer.put(index, self._record(a, finals))
        )
        prompts = [p for _, a in accepted for p in a.prompts]
        loras = [a.prepared.lora_request for _, a in accepted for _ in a.prompts]
        if self.pooling:
            pooling = [a.prepared.pooling_params for _, a in accepted for _ in a.prompts]
            self.llm.embed(
                prompts, pooling, self.use_tqdm, lora_request=loras, on_finished=collector.add
            )
        else:
            params = [p for _, a in accepted for p in a.params]
            priorities = [a.parsed.priority for _, a in accepted for _ in a.prompts]
            self.llm.generate(
                prompts,
                params,
                self.use_tqdm,
                lora_request=loras,
                priority=priorities,
                on_finished=collector.add,
            )

    def _record(self, accepted: Accepted, finals: list[Any]) -> dict:
        """The record for these outputs; a body that cannot be built is that record's 500
        (the run goes on)."""
        try:
            return self._answer(accepted, finals)
        except Exception as error:
            mapped = as_openai_error(error)
            body = error_body(mapped.status, mapped.message, mapped.param)
            request = accepted.request
            return response_record(request.custom_id, mapped.status, accepted.request_id, body)

    def _answer(self, accepted: Accepted, finals: list[Any]) -> dict:
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


class _Finals:
    """Gathers the engine's outputs of each accepted request (one per prompt, by position in
    the engine call) and hands over a request's outputs once all have arrived."""

    def __init__(
        self, accepted: list[tuple[int, Accepted]], done: Callable[[int, Accepted, list], None]
    ) -> None:
        self.accepted = accepted
        self.done = done  # told (item index, the request, its outputs)
        self.owner = [
            (slot, k) for slot, (_, a) in enumerate(accepted) for k in range(len(a.prompts))
        ]
        self.finals: list[list[Any]] = [[None] * len(a.prompts) for _, a in accepted]
        self.missing = [len(a.prompts) for _, a in accepted]

    def add(self, position: int, output: Any) -> None:
        slot, k = self.owner[position]
        self.finals[slot][k] = output
        self.missing[slot] -= 1
        if self.missing[slot] == 0:
            index, accepted = self.accepted[slot]
            finals, self.finals[slot] = self.finals[slot], []  # its memory goes with its record
            self.done(index, accepted, finals)


class RecordWriter:
    """Appends records to the output file in input order, each as soon as it and every
    record before it are ready, flushed one by one: a run killed at any point leaves whole
    records (and at most one cut short, which `read_done` drops) for `--resume`."""

    def __init__(self, file: BinaryIO, lines: list[int]) -> None:
        self.file = file
        self.lines = lines  # each item's line number, for a record that cannot be written
        self.ready: dict[int, dict] = {}
        self.next = 0
        self.num_written = 0
        self.num_answered = 0  # records with a 200 response

    def put(self, index: int, record: dict) -> None:
        self.ready[index] = record
        while self.next in self.ready:
            record = self.ready.pop(self.next)
            self._write(record_bytes(record, self.lines[self.next]))
            self.num_written += 1
            response = record.get("response")
            if response and response.get("status_code") == 200:
                self.num_answered += 1
            self.next += 1

    def _write(self, data: bytes) -> None:
        self.file.write(data)
        self.file.flush()


def record_bytes(record: dict, line: int) -> bytes:
    """One output line: compact JSON in UTF-8. The checks upstream refuse what JSON or
    UTF-8 cannot hold (NaN, lone surrogates); should anything slip through, the line is
    answered with an error record instead of ending the run mid-file."""
    try:
        text = json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return (text + "\n").encode("utf-8")
    except (ValueError, TypeError, RecursionError) as error:
        custom_id = record.get("custom_id")
        if not isinstance(custom_id, str) or lone_surrogate_at(custom_id) is not None:
            custom_id = None
        message = f"line {line}: its record cannot be written as JSON: {type(error).__name__}"
        fallback = new_record(
            custom_id, None, {"code": "invalid_output", "message": message, "line": line}
        )
        return (json.dumps(fallback, separators=(",", ":")) + "\n").encode("utf-8")


def item_line(item: BatchRequest | dict) -> int:
    """The input line an item (a request, or a line's error record) came from."""
    return item.line if isinstance(item, BatchRequest) else item["error"]["line"]
