"""`load_format="dummy"` for a packed checkpoint (GPTQ, AWQ, compressed-tensors
pack-quantized W4A16 / W8A16): random packed weights of the real shapes, read from no file,
so a directory holding only a config.json with such a `quantization_config`
(`loader.write_config_dir`) measures a quantized model of any shape (the Llama-3.2-1B
shape's benchmarks) in the packed layers' memory and kernels.

Every decoder projection the config quantizes (q/k/v, o, gate/up, down, and a mixture's
experts' gate, up and down, less those it leaves unquantized: `quantization/packed_schemes.py`)
gets seeded random integers, fp16-representable scales and, unless symmetric, zero points
near the midpoint, in groups as its scheme says, with a random input order under act-order;
the weights are of the order of the loader's dummy N(0, 0.02). They go through the same
swap as a checkpoint's (`packed_swap.swap_in`, `swap_in_experts`), so a tensor-parallel rank
keeps its rows and a pipeline stage its layers; the loader's dummy pass then fills the rest
(the routers and the layers left unquantized).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.fused_moe import EXPERT_SHARDS, GroupedExperts
from pagedllm.model.layers.linear import Linear
from pagedllm.model.layers.packed_swap import (
    log_swapped,
    require_kernels,
    swap_in,
    swap_in_experts,
)
from pagedllm.model.layers.parallel_linear import RowParallelLinear
from pagedllm.model.layers.whole_fused import full_rows
from pagedllm.model.quantization.gptq import PER_CHANNEL
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ
from pagedllm.model.quantization.packed_schemes import (
    LayerSchemes,
    PackedLayerScheme,
    layer_schemes,
)

# (fused module, shard) -> the checkpoint projection a packed checkpoint stores it as.
CHECKPOINT_PROJECTIONS = {
    ("qkv_proj", "q"): "q_proj",
    ("qkv_proj", "k"): "k_proj",
    ("qkv_proj", "v"): "v_proj",
    ("o_proj", None): "o_proj",
    ("gate_up_proj", "gate"): "gate_proj",
    ("gate_up_proj", "up"): "up_proj",
    ("down_proj", None): "down_proj",
}
QUANTIZED_MODULES = frozenset(module for module, _ in CHECKPOINT_PROJECTIONS)
WEIGHT_STD = 0.02  # the loader's dummy weights'


def full_inputs(module: Linear) -> int:
    inputs = module.weight.shape[1]
    return inputs * module.tp_size if isinstance(module, RowParallelLinear) else inputs


def mean_scale(bits: int) -> float:
    """The scale giving weights of std ~WEIGHT_STD: q uniform below 2^bits less the midpoint
    has variance (4^bits - 1) / 12 + 1/4 (4.6^2 for 4 bits, 74^2 for 8)."""
    return WEIGHT_STD / math.sqrt((4**bits - 1) / 12 + 0.25)


def random_weights(
    rows: int, inputs: int, scheme: PackedLayerScheme, generator: torch.Generator
) -> UnpackedGPTQ:
    """One layer's random integers, scales and zero points (module docstring)."""
    group_size = inputs if scheme.group_size == PER_CHANNEL else scheme.group_size
    groups, midpoint = inputs // group_size, 2 ** (scheme.bits - 1)
    q = torch.randint(0, 2**scheme.bits, (rows, inputs), generator=generator, dtype=torch.uint8)
    scales = mean_scale(scheme.bits) * (0.5 + torch.rand(rows, groups, generator=generator))
    zeros = torch.full((rows, groups), float(midpoint))
    if not scheme.sym:
        zeros += torch.randint(-2, 3, (rows, groups), generator=generator).float()
    order = torch.randperm(inputs, generator=generator) if scheme.desc_act else None
    return UnpackedGPTQ(q, scales.half().float(), zeros, order, group_size, scheme.bits)


def layer_generator(seed: int, name: str) -> torch.Generator:
    """A generator of its own for each layer: a layer's random weights depend on the seed and
    its name only, whichever rank or stage builds it."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def checkpoint_layer(model: nn.Module, module_name: str, shard: str | None) -> str:
    """The checkpoint name (without `.weight`) of a fused module's shard, checked against
    the model's own mapping from checkpoint names."""
    parent, _, module = module_name.rpartition(".")
    name = f"{parent}.{CHECKPOINT_PROJECTIONS[module, shard]}"
    target = model.checkpoint_target(f"{name}.weight")
    if target != (f"{module_name}.weight", shard):
        raise ValueError(f"{module_name!r} ({shard}) loads no checkpoint layer {name!r}")
    return name


def keep_dummy_packed_weights(
    model: nn.Module, method: str, config: dict[str, Any], seed: int = 0
) -> set[str]:
    """Swap in random packed layers for a `method` checkpoint config (module docstring); no
    checkpoint name is consumed."""
    schemes = layer_schemes(method, config)
    described = f"{method} (dummy weights)"
    require_kernels(described)
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name.rpartition(".")[2] in QUANTIZED_MODULES
    ]
    experts = [name for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    swapped = [name for name in names if _swap_random(model, name, schemes, described, seed)]
    swapped += [name for name in experts if _swap_random_experts(model, name, schemes, seed)]
    log_swapped(model, swapped, described)
    return set()


def _swap_random(
    model: nn.Module, name: str, schemes: LayerSchemes, described: str, seed: int
) -> bool:
    """Random packed weights for the shards of `name` the config quantizes; False when it
    quantizes none (a fused layer with only some of them quantized is refused by the swap,
    as a checkpoint's would be)."""
    module = model.get_submodule(name)
    inputs, generator = full_inputs(module), layer_generator(seed, name)
    parts = {}
    for shard, rows in full_rows(module).items():
        scheme = schemes(checkpoint_layer(model, name, shard))
        if scheme is not None:
            parts[shard] = random_weights(rows, inputs, scheme, generator)
    if parts:
        swap_in(model, name, parts, described)
    return bool(parts)


def _swap_random_experts(model: nn.Module, name: str, schemes: LayerSchemes, seed: int) -> bool:
    """A mixture's experts on random packed parts, each the checkpoint's whole shape, each
    shard in the scheme its checkpoint name gets (the first expert's: the formats quantize
    a block's experts alike); False when the config leaves them unquantized."""
    by_shard = {
        shard: schemes(model.checkpoint_expert_layer(name, 0, shard)) for shard in EXPERT_SHARDS
    }
    quantized = [shard for shard, scheme in by_shard.items() if scheme is not None]
    if not quantized:
        return False
    if len(quantized) < len(by_shard):
        raise ValueError(
            f"the quantization config quantizes {quantized} of {name!r}'s experts' "
            f"{list(by_shard)}: experts quantized in part are not served"
        )
    spec, generator = model.get_submodule(name).spec, layer_generator(seed, name)
    hidden, intermediate = spec.hidden_size, spec.intermediate_size
    shapes = {"gate": (intermediate, hidden), "up": (intermediate, hidden)}
    shapes["down"] = (hidden, intermediate)
    parts = {(e, shard) for e in range(spec.num_experts) for shard in EXPERT_SHARDS}

    def random_part(part: tuple[int, str]) -> UnpackedGPTQ:
        return random_weights(*shapes[part[1]], by_shard[part[1]], generator)

    swap_in_experts(model, name, parts, random_part)
    return True
