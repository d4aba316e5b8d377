"""pagedllm: fast, memory-efficient LLM inference (paged KV cache, continuous batching)."""

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.llm import LLM
from pagedllm.frontend.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.logger import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import (
    CompletionOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"

init_logger()
