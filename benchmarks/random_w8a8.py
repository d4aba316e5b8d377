"""Random-weight 8-bit checkpoints (compressed-tensors int8 W8A8 and
FP8 dynamic, `quant_method` fp8 in 128 x 128 blocks) of a Llama shape.

Written as llm-compressor and Fp8Config lay them out for a bf16 Llama (the head unquantized,
tied to a bf16 embedding): random int8 / e4m3 weights and scales, which decode speed does
not depend on. Each is written once under pagedllm's cache root (`w8a8_checkpoint`);
`benchmarks.quantized_real_size` measures it beside the other formats.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.parallel_memory import LlamaShape
from benchmarks.random_gguf import SHAPES
from benchmarks.random_llama import write_random_llama
from pagedllm.utils import cache_root

BLOCK = 128
SCHEMES = ("w8a8-int8", "fp8-dynamic", "fp8-block")


def _group(kind: str) -> dict:
    strategy = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel"}
    activations = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True}
    return {
        "targets": ["Linear"],
        "weights": {**strategy, "dynamic": False},
        "input_activations": {**activations, "strategy": "token"},
    }


def quantization_config(scheme: str) -> dict:
    if scheme == "fp8-block":
        return {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        }  # fmt: skip
    kind = "int" if scheme == "w8a8-int8" else "float"
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if kind == "int" else "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": _group(kind)},
    }


def _layer(scheme: str, inputs: int, outputs: int, generator: torch.Generator) -> dict:
    if scheme == "w8a8-int8":
        values = torch.randint(-127, 128, (outputs, inputs), generator=generator).to(torch.int8)
    else:
        values = torch.randn(outputs, inputs, generator=generator).mul_(64).to(torch.float8_e4m3fn)
    if scheme == "fp8-block":
        blocks = (-(-outputs // BLOCK), -(-inputs // BLOCK))
        return {
            "weight": values,
            "weight_scale_inv": torch.rand(blocks, generator=generator) * 1e-4,
        }
    scales = (torch.rand(outputs, 1, generator=generator) * 1e-4 + 1e-5).to(torch.bfloat16)
    return {"weight": values, "weight_scale": scales}


def write_random_w8a8(directory: Path, shape: LlamaShape, scheme: str, seed: int = 0) -> Path:
    """An 8-bit checkpoint of `shape` in `scheme` (`SCHEMES`) with random weights, the rest
    bf16."""

    def layer(inputs: int, outputs: int, generator: torch.Generator) -> dict:
        return _layer(scheme, inputs, outputs, generator)

    config = quantization_config(scheme)
    return write_random_llama(directory, shape, layer, torch.bfloat16, config, seed)


def w8a8_checkpoint(shape: str, scheme: str) -> Path:
    directory = cache_root() / "models" / f"random-{shape}-{scheme}"
    if not (directory / "config.json").exists():
        write_random_w8a8(directory, SHAPES[shape], scheme)  # config.json last: whole
    return directory
