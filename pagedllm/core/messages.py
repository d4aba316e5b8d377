"""What crosses into and out of the engine core: the one request type, the one output type.

`EngineCoreRequest` is the only thing that enters the core and `EngineCoreOutputs` the only
thing that leaves it, whether the core runs in this process (`InprocClient`) or in its own
(`MPClient`). They are msgspec structs so the multiprocess client sends them as MessagePack;
tagged unions let each side decode whatever arrives with one decoder.
"""

from __future__ import annotations

import msgspec

from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import EngineStats
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

# The tenant of a request whose `tenant` is None (a server without API keys runs every
# request as this one); the metrics' `tenant` label for it.
DEFAULT_TENANT = "default"
# (logprob, rank, top-k token ids, top-k logprobs) of one chosen token: what the runner
# samples (`core.scheduler_output.ModelRunnerOutput`) and what leaves the core.
TokenLogprob = tuple[float, int, list[int], list[float]]


class EngineCoreRequest(msgspec.Struct, tag=True, omit_defaults=True):
    """A tokenized request that passed every check at the edge; built by `InputProcessor`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Who the request runs for (the server: the API key's tenant); the "fair" scheduling
    # policy shares the engine between tenants. None: the one default tenant.
    tenant: str | None = None
    # The LoRA adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # runner="pooling": an embedding request (its prompt's hidden states pooled, no tokens).
    pooling_params: PoolingParams | None = None


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | None = None
    new_logprobs: list[TokenLogprob] | None = None
    new_prompt_logprobs: dict[int, TokenLogprob] | None = None
    # When the request was first scheduled (time.monotonic): its queue time for metrics.
    first_scheduled_time: float | None = None
    # finish_reason "error": what failed for this request alone, in one line.
    error: str | None = None
    # A pooling request's vector (it finishes in the step that computes its last token).
    pooling_output: list[float] | None = None


class EngineCoreOutputs(msgspec.Struct, tag=True):
    """One step's outputs, and the engine's counters after it."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


class EngineReady(msgspec.Struct, tag=True):
    pid: int


EngineCoreInput = EngineCoreRequest | AbortRequests | Shutdown
EngineCoreEvent = EngineCoreOutputs | EngineReady

input_encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineCoreInput)
event_encoder = msgspec.msgpack.Encoder()
event_decoder = msgspec.msgpack.Decoder(EngineCoreEvent)
