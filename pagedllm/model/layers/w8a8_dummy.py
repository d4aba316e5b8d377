"""`load_format="dummy"` for an 8-bit checkpoint (compressed-tensors int8 W8A8 and FP8,
`quant_method` "fp8"): random int8 or float8_e4m3fn weights of the real shapes, read from no
file, so a directory holding only a config.json with such a `quantization_config`
(`loader.write_config_dir`) measures an 8-bit model of any shape in the 8-bit layers' memory
and kernels, as `packed_dummy.py` does for the packed formats.

Every decoder projection the config quantizes (compressed-tensors: a config group targets it
and `ignore` does not name it; fp8: every one but those `modules_to_not_convert` names) gets
seeded random values with scales per output channel, per tensor or per block as the config's
scheme says (and a static input scale where its activations are static), the weights of the
order of the loader's dummy N(0, 0.02). Each layer's tensors are laid out as a checkpoint
stores them and go through the checkpoint's reader and swap (`w8a8_swap.layer_weights`,
`swap_in_w8a8`), so a tensor-parallel rank keeps its rows and a pipeline stage its layers;
a mixture's experts the config quantizes get random parts of the checkpoint's shapes through
the checkpoint's experts swap (`swap_in_w8a8_experts`); the loader's dummy pass then fills
the rest (the routers and the layers left unquantized).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.fused_moe import EXPERT_SHARDS, GroupedExperts
from pagedllm.model.layers.linear import Linear
from pagedllm.model.layers.packed_dummy import (
    QUANTIZED_MODULES,
    WEIGHT_STD,
    checkpoint_layer,
    full_inputs,
    layer_generator,
)
from pagedllm.model.layers.w8a8_swap import (
    checkpoint_scheme,
    layer_weights,
    log_w8a8_layers,
    swap_in_w8a8,
    swap_in_w8a8_experts,
)
from pagedllm.model.layers.w8a8_weights import W8A8Weights
from pagedllm.model.layers.whole_fused import full_rows
from pagedllm.model.quantization import ct_pack_quantized
from pagedllm.model.quantization.w8a8_scheme import FP8, WEIGHT_BLOCK, WEIGHT_TENSOR, W8A8Scheme
from pagedllm.utils import cdiv

INT8_STD = math.sqrt((255**2 - 1) / 12)  # integers uniform in [-127, 127]
FP8_STD = 64.0  # normal values of this std: 448 (e4m3's largest) is 7 of them
FP8_MAX, INT8_MAX = 448.0, 127.0
# A static activation scale covering activations up to this magnitude (RMS-normed hidden
# states of unit scale, a few of them large).
STATIC_ACTIVATION_MAX = 8.0


def is_quantized_projection(method: str, config: dict[str, Any], layer: str) -> bool:
    """Whether a checkpoint of `config` stores `layer` (its checkpoint name) in 8 bits."""
    if method == "fp8":
        # vLLM's fp8 configs name the layers kept unquantized in either key.
        ignored = config.get("ignored_layers") or ()
        if layer in ignored or any(layer.endswith(f".{name}") for name in ignored):
            return False
        return not any(m in layer for m in config.get("modules_to_not_convert") or ())
    return ct_pack_quantized.is_quantized_layer(config, layer)


def random_tensors(
    rows: int, inputs: int, scheme: W8A8Scheme, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """One layer's random tensors as a checkpoint of `scheme` stores them."""
    if scheme.weight_type == FP8:
        normal = torch.randn(rows, inputs, generator=generator) * FP8_STD
        values = normal.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        value_std, value_max = FP8_STD, FP8_MAX
    else:
        values = torch.randint(-127, 128, (rows, inputs), generator=generator, dtype=torch.int8)
        value_std, value_max = INT8_STD, INT8_MAX
    scales_shape: tuple[int, ...] = (rows, 1)
    if scheme.weight_strategy == WEIGHT_TENSOR:
        scales_shape = (1,)
    elif scheme.weight_strategy == WEIGHT_BLOCK and scheme.block is not None:
        scales_shape = (cdiv(rows, scheme.block[0]), cdiv(inputs, scheme.block[1]))
    spread = 0.5 + torch.rand(scales_shape, generator=generator)
    tensors = {"weight": values, "weight_scale": WEIGHT_STD / value_std * spread}
    if scheme.activations is not None and not scheme.activations.dynamic:
        tensors["input_scale"] = torch.tensor([STATIC_ACTIVATION_MAX / value_max])
    return tensors


def keep_dummy_w8a8_weights(
    model: nn.Module, method: str, config: dict[str, Any], seed: int = 0
) -> set[str]:
    """Swap in random 8-bit layers for a `method` checkpoint config (module docstring); no
    checkpoint name is consumed."""
    scheme = checkpoint_scheme(method, config)
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name.rpartition(".")[2] in QUANTIZED_MODULES
    ]
    experts = [name for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    swapped = [name for name in names if _swap_random(model, name, method, config, scheme, seed)]
    settings = (method, config, scheme, seed)
    swapped += [name for name in experts if _swap_random_experts(model, name, *settings)]
    log_w8a8_layers(model, swapped, scheme, "dummy")
    return set()


def _swap_random(
    model: nn.Module,
    name: str,
    method: str,
    config: dict[str, Any],
    scheme: W8A8Scheme,
    seed: int,
) -> bool:
    """Random 8-bit weights for the shards of `name` the config quantizes; False when it
    quantizes none (a fused layer with only some quantized is refused by the swap, as a
    checkpoint's would be)."""
    module = model.get_submodule(name)
    inputs, generator = full_inputs(module), layer_generator(seed, name)
    parts: dict[str | None, W8A8Weights] = {}
    for shard, rows in full_rows(module).items():
        layer = checkpoint_layer(model, name, shard)
        if is_quantized_projection(method, config, layer):
            tensors = random_tensors(rows, inputs, scheme, generator)
            parts[shard] = layer_weights(layer, tensors, scheme)
    if parts:
        swap_in_w8a8(model, name, parts)
    return bool(parts)


def _swap_random_experts(
    model: nn.Module,
    name: str,
    method: str,
    config: dict[str, Any],
    scheme: W8A8Scheme,
    seed: int,
) -> bool:
    """A mixture's experts on random 8-bit parts of the checkpoint's shapes, for the shards
    the config quantizes (a block quantized in part is refused by the swap, as a
    checkpoint's would be); False when it quantizes none."""
    spec, generator = model.get_submodule(name).spec, layer_generator(seed, name)
    hidden, intermediate = spec.hidden_size, spec.intermediate_size
    shapes = {"gate": (intermediate, hidden), "up": (intermediate, hidden)}
    shapes["down"] = (hidden, intermediate)
    parts = {
        (expert, shard)
        for expert in range(spec.num_experts)
        for shard in EXPERT_SHARDS
        if is_quantized_projection(
            method, config, model.checkpoint_expert_layer(name, expert, shard)
        )
    }
    if not parts:
        return False

    def random_part(part: tuple[int, str]) -> W8A8Weights:
        tensors = random_tensors(*shapes[part[1]], scheme, generator)
        return layer_weights(model.checkpoint_expert_layer(name, *part), tensors, scheme)

    swap_in_w8a8_experts(model, name, parts, random_part)
    return True
