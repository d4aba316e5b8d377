"""Benchmark workloads: each is a list of `BenchRequest` (prompt token ids, output length).

`random`: uniform random token ids, lengths drawn from [len*(1-r), len*(1+r)].
`sharegpt-like`: conversation-like lengths (log-normal prompts and answers) from a seed,
no download. `shared-prefix`: N system prompts × M questions. `file`: a JSONL file with
`prompt` (text) or `prompt_token_ids`, and optionally `output_len`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

# Token ids below this are left out of random prompts: special tokens live there.
FIRST_PLAIN_TOKEN_ID = 100


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 512
    path: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset {self.name!r} is unknown; choose one of {sorted(DATASETS)}")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.name == "file" and not self.path:
            raise ValueError("the file dataset needs a path (--dataset-path)")


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(low, max(low, high)))


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab_size) for _ in range(count)]


def random_dataset(config: DatasetConfig, vocab_size: int, tokenizer: Any) -> list[BenchRequest]:
    rng = random.Random(config.seed)
    return [
        BenchRequest(
            _tokens(rng, _length(rng, config.input_len, config.range_ratio), vocab_size),
            _length(rng, config.output_len, config.range_ratio),
        )
        for _ in range(config.num_prompts)
    ]


def sharegpt_like_dataset(
    config: DatasetConfig, vocab_size: int, tokenizer: Any
) -> list[BenchRequest]:
    """Log-normal lengths with medians input_len / output_len, clipped to [4, 8 × median]:
    the long tail of real conversations without shipping or fetching them."""
    rng = random.Random(config.seed)

    def lognormal(median: int) -> int:
        return int(min(8 * median, max(4, rng.lognormvariate(0, 0.8) * median)))

    return [
        BenchRequest(
            _tokens(rng, lognormal(config.input_len), vocab_size), lognormal(config.output_len)
        )
        for _ in range(config.num_prompts)
    ]


def shared_prefix_dataset(
    config: DatasetConfig, vocab_size: int, tokenizer: Any
) -> list[BenchRequest]:
    """`num_prefixes` system prompts of `prefix_len` tokens, each before an equal share of
    `num_prompts` different questions of about `input_len` tokens, in interleaved order."""
    rng = random.Random(config.seed)
    prefixes = [_tokens(rng, config.prefix_len, vocab_size) for _ in range(config.num_prefixes)]
    return [
        BenchRequest(
            prefixes[index % config.num_prefixes]
            + _tokens(rng, _length(rng, config.input_len, config.range_ratio), vocab_size),
            _length(rng, config.output_len, config.range_ratio),
        )
        for index in range(config.num_prompts)
    ]


def file_dataset(config: DatasetConfig, vocab_size: int, tokenizer: Any) -> list[BenchRequest]:
    requests = []
    with open(config.path) as f:  # type: ignore[arg-type]
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if "prompt_token_ids" in record:
                    token_ids = [int(t) for t in record["prompt_token_ids"]]
                else:
                    token_ids = tokenizer.encode(record["prompt"])
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{config.path}:{line_number}: bad record: {error}") from error
            requests.append(
                BenchRequest(token_ids, int(record.get("output_len", config.output_len)))
            )
            if len(requests) == config.num_prompts:
                break
    if not requests:
        raise ValueError(f"{config.path}: no prompts")
    return requests


DATASETS = {
    "random": random_dataset,
    "sharegpt-like": sharegpt_like_dataset,
    "shared-prefix": shared_prefix_dataset,
    "file": file_dataset,
}


def load_dataset(config: DatasetConfig, vocab_size: int, tokenizer: Any) -> list[BenchRequest]:
    return DATASETS[config.name](config, vocab_size, tokenizer)
