"""What completions and chat completions share: request checks (the `model` field: the base
model or a LoRA adapter), prompt tokenization with length limits, request ids, fan-in of
several generations, SSE framing and usage counts."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from pagedllm.core.messages import EngineCoreRequest
from pagedllm.entrypoints.openai.audit_log import audit_record, audited_outputs
from pagedllm.entrypoints.openai.errors import OpenAIError, as_openai_error, error_body
from pagedllm.entrypoints.openai.lora_registry import LoRARegistry
from pagedllm.entrypoints.openai.protocol import (
    EmbeddingRequest,
    OpenAIModel,
    SamplingRequest,
    unknown_field_notes,
)
from pagedllm.entrypoints.openai.request_ids import client_error, engine_request_id
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.tenant_limits import TenantLimiter
from pagedllm.entrypoints.openai.tenants import current_tenant
from pagedllm.errors import InvalidRequestError, RequestFailedError
from pagedllm.frontend.admission import Cost, QueueFullError, QueueLimits, Reservation
from pagedllm.frontend.async_llm import AsyncLLM
from pagedllm.frontend.processor import check_token_ids
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PositionLogprobs, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("pagedllm")

# JSON has no -inf or NaN; clients get a very unlikely logprob instead (as vLLM does for
# -inf). NaN (logits a broken model or adapter made NaN) would otherwise fail the whole
# reply with "Out of range float values are not JSON compliant".
MIN_LOGPROB = -9999.0


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


def clamp_logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # NaN compares false


def prompt_logprobs_json(positions: list[PositionLogprobs | None] | None) -> list | None:
    """`prompt_logprobs` as vLLM answers it: per prompt token (None for the first), the
    token ids asked for (the prompt's own and the top alternatives) with their logprob,
    rank and text."""
    if positions is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): {
                "logprob": clamp_logprob(logprob.logprob),
                "rank": logprob.rank,
                "decoded_token": logprob.decoded_token,
            }
            for token_id, logprob in entry.items()
        }
        for entry in positions
    ]


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


class OpenAIServing:
    def __init__(
        self, engine: AsyncLLM, config: ServerConfig, loras: LoRARegistry | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.loras = loras  # None: the engine runs without LoRA
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len
        self.model_name = config.served_model_names[0]
        # No token spans more characters than the longest vocabulary entry, so a text longer
        # than this cannot fit the context: refuse it before spending time tokenizing it.
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = self.max_model_len * max(longest, 1)
        self.queue_limits = QueueLimits(
            config.max_num_queued_requests, config.max_num_queued_tokens
        )

    # ---- checks ---------------------------------------------------------------------------
    def check_request(self, request: SamplingRequest, refused: list[str]) -> LoRARequest | None:
        """The request's adapter (None: the base model), once its fields are checked."""
        lora_request = self.resolve_model(request.model)
        self.check_unknown(request)
        if refused:
            raise OpenAIError(400, f"{refused[0]}: not supported by this server", refused[0])
        request.check_stream_options()
        self.check_capacity()
        return lora_request

    def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, None for the base model (or no model); 404 otherwise."""
        if self.loras is not None:
            return self.loras.resolve(model)
        if model is not None and model not in self.config.served_model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
        return None

    def response_model(self, lora_request: LoRARequest | None) -> str:
        """The `model` a response names: the adapter's name, else the first served name."""
        return self.model_name if lora_request is None else lora_request.lora_name

    def check_unknown(self, request: OpenAIModel) -> None:
        """Unknown fields, at any depth: logged and ignored (vLLM's behaviour), or a 400
        naming the first one's path under --strict-request-fields."""
        unknown = request.unknown_fields()
        if not unknown:
            return
        notes = "".join(f"; {note}" for note in unknown_field_notes(unknown))
        if not self.config.allow_unknown_fields:
            raise OpenAIError(
                400,
                f"unknown field(s): {', '.join(unknown)} (this server runs with "
                f"--strict-request-fields){notes}",
                unknown[0],
            )
        logger.warning("Ignoring unknown request field(s): %s%s", ", ".join(unknown), notes)

    def check_capacity(self) -> None:
        """Refuse early, before tokenizing, when not even the cheapest request (one prompt of
        one token) would be admitted; `admit` checks the request's real cost."""
        if self.engine.is_dead:  # why, as /health says it: stalled, restarting or gone
            raise OpenAIError(503, self.engine.unavailable_reason or "the engine is not running")
        try:
            self.engine.admission.check(Cost(1, 1), self.queue_limits)
        except QueueFullError as error:
            raise busy_error(error) from None

    def admit(self, processed: list[tuple[str | None, EngineCoreRequest]]) -> Reservation:
        """Reserve queue room for all of one HTTP request's engine requests, or refuse it
        whole with a 503; nothing is sent to the engine before this."""
        try:
            return self.engine.admit([request for _, request in processed], self.queue_limits)
        except QueueFullError as error:
            raise busy_error(error) from None

    def with_structured_output(
        self,
        params: SamplingParams,
        request: SamplingRequest,
        extra: list[tuple[str, StructuredOutputsParams]],
    ) -> SamplingParams:
        """`params` constrained by the one structured-output field the request used (vLLM's
        `structured_outputs`, a `guided_*` field, `response_format`, or a tool choice)."""
        sources = request.structured_output_sources() + extra
        if not sources:
            return params
        if len(sources) > 1:
            first, second = sources[0][0], sources[1][0]
            raise InvalidRequestError(
                f"{second}: cannot be combined with {first}; give one output constraint", second
            )
        field_name, spec = sources[0]
        params = dataclasses.replace(params, structured_outputs=spec)
        self.engine.input_processor.check_structured_outputs(params, field_name)
        return params

    def max_tokens(self, requested: int | None, num_prompt_tokens: int, default: int | None):
        """The request's max_tokens, checked against what the context window leaves."""
        room = self.max_model_len - num_prompt_tokens
        if requested is not None and requested > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in "
                f"the prompt, {requested} in the completion). Reduce the prompt or max_tokens.",
                "max_tokens",
            )
        if requested is not None:
            return requested
        if room < 1:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens and the "
                f"prompt has {num_prompt_tokens} input tokens: no room to generate",
                "input_tokens",
            )
        return room if default is None else min(default, room)

    # ---- prompts --------------------------------------------------------------------------
    async def tokenize(
        self, text: str, add_special_tokens: bool, check_length: bool = True
    ) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"prompt: {len(text)} characters cannot fit the model's context window of "
                f"{self.max_model_len} tokens",
                "input_tokens",
            )
        # Long prompts take a while to tokenize; do it off the event loop.
        token_ids = await asyncio.to_thread(
            self.tokenizer.encode, text, add_special_tokens=add_special_tokens
        )
        return self.check_prompt(token_ids) if check_length else token_ids

    async def read_prompts(
        self, value: str | list, add_special_tokens: bool, param: str
    ) -> list[Prompt]:
        """A body's prompts (`prompt`, `input`): a string, strings, token ids or lists of
        them, each tokenized or checked against the vocabulary and the context window."""
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        if not value:
            raise InvalidRequestError(f"{param}: must not be empty", param)
        prompts = []
        for item in value:
            if not item:
                raise InvalidRequestError(f"{param}: empty prompt", param)
            if isinstance(item, str):
                prompts.append(Prompt(item, await self.tokenize(item, add_special_tokens)))
            else:
                vocab_size = self.engine.model_config.vocab_size
                token_ids = check_token_ids(item, vocab_size, param)
                prompts.append(Prompt(None, self.check_prompt(token_ids)))
        return prompts

    def check_prompt(self, token_ids: list[int]) -> list[int]:
        processor = self.engine.input_processor
        return processor.process_prompt({"prompt_token_ids": token_ids})[1]

    def request_id(self, raw: Request, request: SamplingRequest, prefix: str) -> str:
        return (
            request.request_id or raw.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
        )

    def log_request(self, request_id: str, prompts: list[Prompt], params: SamplingParams):
        if self.config.enable_log_requests:
            logger.info(
                "Received request %s: prompt tokens %s, params %s",
                request_id,
                [len(p.token_ids) for p in prompts],
                params,
            )

    # ---- generation -----------------------------------------------------------------------
    def generations(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: list[SamplingParams],
        request: SamplingRequest | EmbeddingRequest,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every prompt's engine request is built and checked before any is started, so a bad
        one refuses the whole HTTP request before anything streams. The requests run as the
        tenant the API key named (its cache salt, its token budget), with `lora_request`'s
        adapter if one is given; with `pooling_params`, as embedding requests."""
        tenant = current_tenant.get()
        salt = request.cache_salt if tenant is None else tenant.cache_salt(request.cache_salt)
        # The engine's id is scoped to the tenant; errors and bodies name the client's id.
        engine_id = engine_request_id(None if tenant is None else tenant.name, request_id)
        processed = [
            self.engine.process_inputs(
                engine_id if len(prompts) == 1 else f"{engine_id}-{i}",
                {
                    "prompt_token_ids": prompt.token_ids,
                    "prompt": prompt.text,
                    **({} if salt is None else {"cache_salt": salt}),
                },
                prompt_params,
                request.priority,
                tenant=None if tenant is None else tenant.name,
                lora_request=lora_request,
                pooling_params=pooling_params,
            )
            for i, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True))
        ]
        try:
            reservation = self.admit(processed)
        except InvalidRequestError as error:  # an id already running: this tenant's own
            raise client_error(error, engine_id, request_id) from None
        note_request(request_id, request.model, prompts)
        streams = [self.engine.generate(*each) for each in processed]
        if engine_id != request_id:
            streams = [with_client_id(stream, engine_id, request_id) for stream in streams]
        merged = audited_outputs(merge_streams(streams, reservation))
        if tenant is None:
            return merged
        tenant.limiter.charge_tokens(sum(len(r.prompt_token_ids) for _, r in processed))
        if pooling_params is not None:  # an embedding generates no tokens to charge
            return merged
        return charge_generated_tokens(merged, tenant.limiter, params)


def note_request(request_id: str, model: str | None, prompts: list[Prompt]) -> None:
    """What the audit log's line for this HTTP request names (nothing without one)."""
    record = audit_record()
    if record is None:
        return
    record.request_id = request_id
    record.model = model
    if record.prompts is not None:
        record.prompts.extend(prompt.text or "" for prompt in prompts)


async def with_client_id(
    outputs: AsyncGenerator[RequestOutput, None], engine_id: str, request_id: str
) -> AsyncIterator[RequestOutput]:
    """`outputs`, with errors that name the tenant-scoped `engine_id` renamed to the client's
    `request_id`. Closing this closes `outputs` at once (which aborts the request)."""
    async with contextlib.aclosing(outputs):
        try:
            async for output in outputs:
                yield output
        except (RequestFailedError, InvalidRequestError) as error:
            raise client_error(error, engine_id, request_id) from None


def busy_error(error: QueueFullError) -> OpenAIError:
    headers = {} if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    return OpenAIError(503, error.message, error.param, headers)


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]], reservation: Reservation | None = None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several generations as their outputs arrive, tagged with their index.

    Closing the merged stream (a client disconnect) cancels every generation, which aborts
    each request in the engine; its end releases what is left of its queue `reservation`.
    """
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            if reservation is not None:
                reservation.release()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as error:
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if reservation is not None:
            reservation.release()


async def charge_generated_tokens(
    results: AsyncGenerator[tuple[int, RequestOutput], None],
    limiter: TenantLimiter,
    params: list[SamplingParams],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`results`, charging the tenant each generated token as it arrives. Samples the client
    cut short are charged their whole `max_tokens`: leaving early must not dodge the limit.

    Closing this closes `results` at once (which aborts its requests), not when collected.
    """
    seen: dict[tuple[int, int], int] = {}  # (prompt index, sample index) -> tokens charged
    finished: set[tuple[int, int]] = set()
    async with contextlib.aclosing(results):
        try:
            async for index, output in results:
                delta = params[index].output_kind == RequestOutputKind.DELTA
                for completion in output.outputs:
                    sample = (index, completion.index)
                    new = len(completion.token_ids) - (0 if delta else seen.get(sample, 0))
                    seen[sample] = seen.get(sample, 0) + new
                    limiter.charge_tokens(new)
                    if completion.finish_reason is not None:
                        finished.add(sample)
                yield index, output
        except (asyncio.CancelledError, GeneratorExit):
            for index, prompt_params in enumerate(params):
                for sample in ((index, i) for i in range(prompt_params.n)):
                    if sample not in finished:
                        unused = (prompt_params.max_tokens or 0) - seen.get(sample, 0)
                        limiter.charge_tokens(unused)
            raise


async def stream_with_errors(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """SSE body: the chunks, then `[DONE]`; an error mid-stream is sent as an error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as error:
        mapped = as_openai_error(error)
        yield sse(error_body(mapped.status, mapped.message, mapped.param))
    yield SSE_DONE


def now_s() -> int:
    return int(time.time())
