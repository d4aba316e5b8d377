"""Pooling (embeddings): the engine's `PoolerConfig` (`--runner pooling --pooler-config`)
and a request's `PoolingParams`, vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.value_checks import check_known_keys, json_object

RUNNERS = ("generate", "pooling")
# What a pooling request carries through the core's token machinery: it is admitted and
# prefilled like any prompt and ends there, so it samples nothing and decodes no text.
POOLING_SAMPLING_PARAMS = SamplingParams(
    max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
)
# last: the last prompt token's final hidden state (Qwen3-Embedding, decoder embedders);
# mean: the average over every prompt token; cls: the first token's.
POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling engine turns a prompt's final hidden states into one vector.

    `pooling_type`: last, mean or cls (vLLM's upper-case LAST/MEAN/CLS are taken too);
    `normalize`: L2-normalize the vector (a request may override it).
    """

    pooling_type: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, str) or self.pooling_type.lower() not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config.pooling_type must be one of {list(POOLING_TYPES)}, "
                f"got {self.pooling_type!r}"
            )
        object.__setattr__(self, "pooling_type", self.pooling_type.lower())
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be a bool, got {self.normalize!r}")

    @classmethod
    def parse(cls, value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig:
        """From `LLM(pooler_config={...})` or `--pooler-config '{json}'`; None is the default
        (last-token pooling, normalized). Unknown keys are an error naming them."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        value = json_object("pooler_config", value)
        check_known_keys("pooler_config key", value, {f.name for f in fields(cls)})
        return cls(**value)


@dataclass(frozen=True)
class PoolingParams:
    """One embedding request's options. `normalize`: None takes the engine's
    `PoolerConfig.normalize`; `dimensions`: the vector's length, which must be the model's
    hidden size (no model here is trained to be truncated, so a shorter one is refused)."""

    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
        ):
            raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")
