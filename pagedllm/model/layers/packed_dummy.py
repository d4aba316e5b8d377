"""`load_format="dummy"` for a GPTQ model: random packed weights of the real shapes, read
from no file, so a directory holding only a config.json with a GPTQ `quantization_config`
(`loader.write_config_dir`) measures a quantized model of any shape (the Llama-3.2-1B
shape's benchmarks) in the packed layers' memory and kernels.

Every decoder projection a GPTQ checkpoint quantizes (q/k/v, o, gate/up, down, and a
mixture's experts' gate, up and down) gets seeded random integers, fp16-representable
scales and, unless symmetric, zero points near the midpoint, in groups as the config says,
with a random input order under act-order; the weights are of the order of the loader's
dummy N(0, 0.02). They go through the same swap as a checkpoint's (`packed_swap.swap_in`,
`swap_in_experts`), so a tensor-parallel rank keeps its rows and a pipeline stage its
layers; the loader's dummy pass then fills the rest (the routers among it).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.fused_moe import EXPERT_SHARDS, GroupedExperts
from pagedllm.model.layers.linear import Linear, MergedLinear
from pagedllm.model.layers.packed_swap import (
    log_swapped,
    require_kernels,
    swap_in,
    swap_in_experts,
)
from pagedllm.model.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model.quantization.gptq import PER_CHANNEL, GPTQConfig
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ

# The fused projections a GPTQ checkpoint's q/k/v, o, gate/up and down load into.
QUANTIZED_MODULES = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})
# |q - midpoint| averages ~4.6 for 4-bit q: this scale gives weights of std ~0.02.
SCALE = 0.0043


def full_rows(module: Linear) -> dict[str | None, int]:
    """Each shard's output rows in a checkpoint (before any rank takes its share)."""
    if isinstance(module, MergedLinear):
        sources = getattr(module, "shard_sources", None)
        return {
            shard: sources[shard][1] if sources else piece.stop - piece.start
            for shard, piece in module.shard_slices.items()
        }
    rows = module.weight.shape[0]
    return {None: rows * module.tp_size if isinstance(module, ColumnParallelLinear) else rows}


def full_inputs(module: Linear) -> int:
    inputs = module.weight.shape[1]
    return inputs * module.tp_size if isinstance(module, RowParallelLinear) else inputs


def random_weights(
    rows: int, inputs: int, gptq: GPTQConfig, generator: torch.Generator
) -> UnpackedGPTQ:
    """One layer's random integers, scales and zero points (module docstring)."""
    group_size = inputs if gptq.group_size == PER_CHANNEL else gptq.group_size
    groups, midpoint = inputs // group_size, 2 ** (gptq.bits - 1)
    q = torch.randint(0, 2**gptq.bits, (rows, inputs), generator=generator, dtype=torch.uint8)
    scales = SCALE * (0.5 + torch.rand(rows, groups, generator=generator))
    zeros = torch.full((rows, groups), float(midpoint))
    if not gptq.sym:
        zeros += torch.randint(-2, 3, (rows, groups), generator=generator).float()
    order = torch.randperm(inputs, generator=generator) if gptq.desc_act else None
    return UnpackedGPTQ(q, scales.half().float(), zeros, order, group_size, gptq.bits)


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def keep_dummy_gptq_weights(model: nn.Module, config: dict[str, Any], seed: int = 0) -> set[str]:
    """Swap in random GPTQ layers (module docstring); no checkpoint name is consumed."""
    gptq = GPTQConfig.from_dict(config)
    method = f"gptq ({gptq.describe()}, dummy weights)"
    require_kernels(method)
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name.rpartition(".")[2] in QUANTIZED_MODULES
    ]
    for name in names:
        module = model.get_submodule(name)
        inputs, generator = full_inputs(module), _generator(seed, name)
        parts = {
            shard: random_weights(rows, inputs, gptq, generator)
            for shard, rows in full_rows(module).items()
        }
        swap_in(model, name, parts, method)
    experts = [name for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    for name in experts:
        _swap_in_random_experts(model, name, gptq, _generator(seed, name))
    log_swapped(model, [*names, *experts], method)
    return set()


def _swap_in_random_experts(
    model: nn.Module, name: str, gptq: GPTQConfig, generator: torch.Generator
) -> None:
    """A mixture's experts on random packed parts, each the checkpoint's whole shape."""
    spec = model.get_submodule(name).spec
    hidden, intermediate = spec.hidden_size, spec.intermediate_size
    shapes = {"gate": (intermediate, hidden), "up": (intermediate, hidden)}
    shapes["down"] = (hidden, intermediate)
    parts = {(e, shard) for e in range(spec.num_experts) for shard in EXPERT_SHARDS}
    swap_in_experts(
        model, name, parts, lambda part: random_weights(*shapes[part[1]], gptq, generator)
    )
