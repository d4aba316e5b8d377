"""Random-weight checkpoints stored packed (GPTQ 4-bit, AWQ 4-bit, compressed-tensors W4A16;
group 128), written as the formats' tools write a Llama shape.

Each packed checkpoint (group 128, symmetric where the format has the choice, no
act-order, the head unquantized and tied to an fp16 embedding, as the tools write
Llama-3.2-1B) holds random packed integers and scales: decode speed does not depend on the
values. It is written once under pagedllm's cache root (`packed_checkpoint`).
`benchmarks.quantized_real_size` measures it beside the other formats.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.parallel_memory import LlamaShape
from benchmarks.random_gguf import SHAPES
from benchmarks.random_llama import write_random_llama
from pagedllm.utils import cache_root

GROUP_SIZE = 128


def _random_words(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (rows, cols), generator=generator).to(torch.int32)


def _scales(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(rows, cols, generator=generator) * 2e-3 + 1e-3


def _gptq_layer(inputs: int, outputs: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    groups = inputs // GROUP_SIZE
    return {
        "qweight": _random_words(inputs // 8, outputs, generator),
        "qzeros": torch.full((groups, outputs // 8), 0x77777777, dtype=torch.int32),
        "scales": _scales(groups, outputs, generator).half(),
        "g_idx": (torch.arange(inputs) // GROUP_SIZE).to(torch.int32),
    }


def _awq_layer(inputs: int, outputs: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    groups = inputs // GROUP_SIZE
    return {
        "qweight": _random_words(inputs, outputs // 8, generator),
        "qzeros": torch.full((groups, outputs // 8), 0x88888888 - 2**32, dtype=torch.int32),
        "scales": _scales(groups, outputs, generator).half(),
    }


def _w4a16_layer(inputs: int, outputs: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "weight_packed": _random_words(outputs, inputs // 8, generator),
        "weight_scale": _scales(outputs, inputs // GROUP_SIZE, generator).bfloat16(),
        "weight_shape": torch.tensor([outputs, inputs]),
    }


W4A16_WEIGHTS = {
    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
    "group_size": GROUP_SIZE, "dynamic": False, "actorder": None,
}  # fmt: skip
# name -> (one projection's packed tensors, the checkpoint's quantization_config)
FORMATS: dict[str, tuple[Callable[..., dict[str, torch.Tensor]], dict]] = {
    "gptq-4bit-g128": (
        _gptq_layer,
        {
            "quant_method": "gptq", "bits": 4, "group_size": GROUP_SIZE, "desc_act": False,
            "sym": True, "checkpoint_format": "gptq",
        },
    ),
    "awq-4bit-g128": (
        _awq_layer,
        {
            "quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True,
            "version": "gemm",
        },
    ),
    "w4a16-g128": (
        _w4a16_layer,
        {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": W4A16_WEIGHTS}},
            "ignore": ["lm_head"],
        },
    ),
}  # fmt: skip


def write_random_packed(directory: Path, shape: LlamaShape, fmt: str, seed: int = 0) -> Path:
    """A checkpoint of `shape` in `fmt` (a FORMATS name) with random packed weights, one file a
    layer, the rest fp16."""
    packed_layer, quantization_config = FORMATS[fmt]
    return write_random_llama(
        directory, shape, packed_layer, torch.float16, quantization_config, seed
    )


def packed_checkpoint(shape: str, fmt: str) -> Path:
    directory = cache_root() / "models" / f"random-{shape}-{fmt}"
    if not (directory / "config.json").exists():
        write_random_packed(directory, SHAPES[shape], fmt)  # config.json last: a whole checkpoint
    return directory
