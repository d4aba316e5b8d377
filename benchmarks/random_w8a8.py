"""Random-weight 8-bit checkpoints (compressed-tensors int8 W8A8 and
FP8 dynamic, `quant_method` fp8 in 128 x 128 blocks) of a Llama shape.

Written as llm-compressor and Fp8Config lay them out for a bf16 Llama (the head unquantized,
tied to a bf16 embedding): random int8 / e4m3 weights and scales, which decode speed does
not depend on. Each is written once under pagedllm's cache root (`w8a8_checkpoint`);
`benchmarks.quantized_real_size` measures it beside the other formats.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.parallel_memory import LlamaShape
from benchmarks.random_gguf import SHAPES
from benchmarks.random_gptq import PROJECTIONS
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
    """An 8-bit checkpoint of `shape` in `scheme` (`SCHEMES`) with random weights."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    hidden = shape.hidden_size
    embedding = torch.randn(shape.vocab_size, hidden, generator=generator) * 0.02
    rest = {
        "model.embed_tokens.weight": embedding.to(torch.bfloat16),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    if not shape.tie_word_embeddings:  # the head is never quantized (ignored)
        head = torch.randn(shape.vocab_size, hidden, generator=generator) * 0.02
        rest["lm_head.weight"] = head.to(torch.bfloat16)
    save_file(rest, directory / "model-rest.safetensors")
    for layer in range(shape.num_layers):
        tensors = {
            f"model.layers.{layer}.{norm}.weight": torch.ones(hidden, dtype=torch.bfloat16)
            for norm in ("input_layernorm", "post_attention_layernorm")
        }
        for name, size in PROJECTIONS.items():
            for leaf, tensor in _layer(scheme, *size(shape), generator).items():
                tensors[f"model.layers.{layer}.{name}.{leaf}"] = tensor
        save_file(tensors, directory / f"model-layer-{layer:03d}.safetensors")
    config = {
        **shape.hf_config(),
        "torch_dtype": "bfloat16",
        "quantization_config": quantization_config(scheme),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def w8a8_checkpoint(shape: str, scheme: str) -> Path:
    directory = cache_root() / "models" / f"random-{shape}-{scheme}"
    if not (directory / "config.json").exists():
        write_random_w8a8(directory, SHAPES[shape], scheme)  # config.json last: whole
    return directory
