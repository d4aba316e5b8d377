"""What crosses the boundary between the API process and the engine-core process.

Every message is a msgspec struct encoded as MessagePack: requests and aborts flow in,
per-step outputs (with an engine stats snapshot) flow out. Tagged unions let each side
decode whatever arrives with one decoder.
"""

from __future__ import annotations

import msgspec

from pagedllm.core.scheduler import EngineCoreOutput
from pagedllm.engine.request import Request
from pagedllm.metrics.stats import EngineStats
from pagedllm.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, tag=True, omit_defaults=True):
    """A tokenized, validated request; the core turns it into a scheduler `Request`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def to_request(self) -> Request:
        return Request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            frozenset(self.eos_token_ids),
            arrival_time=self.arrival_time,
            priority=self.priority,
            cache_salt=self.cache_salt,
            bad_words_token_ids=self.bad_words_token_ids,
        )


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True):
    """Ask the core to run one of its maintenance methods (e.g. reset_prefix_cache)."""

    call_id: int
    method: str


class Shutdown(msgspec.Struct, tag=True):
    pass


EngineCoreInput = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown


class EngineCoreOutputs(msgspec.Struct, tag=True):
    """One step's outputs, and the engine's counters after it."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats


class EngineReady(msgspec.Struct, tag=True):
    pid: int


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: bool | None = None


EngineCoreEvent = EngineCoreOutputs | EngineReady | UtilityResult

input_encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineCoreInput)
event_encoder = msgspec.msgpack.Encoder()
event_decoder = msgspec.msgpack.Decoder(EngineCoreEvent)
