"""A mixture's experts each on quantized kernel layers, run grouped by routing.

Owns `KernelGroupedExperts`, which stands where `GroupedExperts` stood: per expert one
layer for its fused gate/up rows and one for its down rows, whatever kernel layers those
are (a GGUF file's blocks, `gguf_experts.py`; a GPTQ / AWQ / compressed-tensors
checkpoint's packed integers, `packed_experts.py`; an int8 W8A8 or FP8 checkpoint's 8-bit
weights, `w8a8_experts.py`). `require_every_part` refuses a checkpoint that quantizes only
some of a block's experts' projections. Tokens are grouped by expert exactly
as `GroupedExperts` groups them (`run_grouped`): an expert without routed rows costs
nothing, and no expert is ever dequantized whole, so the experts hold about the
checkpoint's expert bytes instead of fp32's four bytes a weight.

Under torch.compile the block is one opaque op (`pagedllm::kernel_grouped_experts`), the
layer found by its id: the grouping's sizes depend on the routing, and the kernel layers
are not traced.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.fused_moe import EXPERT_SHARDS, GroupedExperts, MoESpec, run_grouped
from pagedllm.model.layers.gguf_linear import distinct_bytes
from pagedllm.model.layers.gguf_parallel import RowSlice
from pagedllm.ops import fused
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection

ExpertPart = tuple[int, str]  # (expert index, one of EXPERT_SHARDS)


def require_every_part(spec: MoESpec, parts: set[ExpertPart], where: str) -> None:
    """`parts`, the (expert, shard) pairs a checkpoint quantizes in the block `where`
    names, must be all of them: a block's experts run on kernel layers only all together."""
    missing = [
        (e, s) for e in range(spec.num_experts) for s in EXPERT_SHARDS if (e, s) not in parts
    ]
    if missing:
        raise ValueError(
            f"{where}: the checkpoint quantizes some experts' projections but not (expert, "
            f"shard) {missing[:8]}: a mixture's experts are served quantized only all together"
        )


def check_expert_shape(shape: torch.Size, model_shape: tuple[int, int], what: str) -> None:
    """An expert projection's stored [out, in] must be the model's."""
    if tuple(shape) != model_shape:
        raise ValueError(f"{what} is {tuple(shape)}, the model's is {model_shape}")


def expert_layers(
    experts: GroupedExperts,
    parts: set[ExpertPart],
    read: Callable[[ExpertPart], Any],
    where: str,
    gate_up_layer: Callable[[Any, Any, str], nn.Module],
    down_layer: Callable[[Any, str], nn.Module],
) -> tuple[list[nn.Module], list[nn.Module]]:
    """(gate_up, down): each expert's layers, built by a format's `gate_up_layer(gate, up,
    name)` and `down_layer(down, name)` from its parts, one expert's parts read (`read`) at a
    time; `parts`, the (expert, shard) pairs the checkpoint quantizes in the block `where`
    names, must be all of them."""
    require_every_part(experts.spec, parts, where)
    gate_up, down = [], []
    for expert in range(experts.spec.num_experts):
        name = f"{where}.{expert}"
        gate_up.append(gate_up_layer(read((expert, "gate")), read((expert, "up")), name))
        down.append(down_layer(read((expert, "down")), name))
    return gate_up, down


def rank_gate_and_up(
    experts: GroupedExperts,
    gate: Any,
    up: Any,
    where: str,
    shape_of: Callable[[Any], torch.Size],
    take_rows: Callable[[Any, RowSlice], Any],
) -> list:
    """[gate, up]: this rank's rows of each (`take_rows`), each checked against the model's
    [intermediate, hidden] (`shape_of`)."""
    shape = (experts.spec.intermediate_size, experts.spec.hidden_size)
    rows = RowSlice(experts.tp_rank * experts.shard_size, experts.shard_size)
    mine = []
    for name, weights in (("gate", gate), ("up", up)):
        check_expert_shape(shape_of(weights), shape, f"{where} {name}")
        mine.append(weights if experts.tp_size == 1 else take_rows(weights, rows))
    return mine


class KernelGroupedExperts(nn.Module):
    """`GroupedExperts` with expert e's gate/up in `gate_up[e]` (gate rows, then up rows)
    and its down in `down[e]`."""

    def __init__(
        self,
        spec: MoESpec,
        gate_up: list[nn.Module],
        down: list[nn.Module],
        kernels: KernelSelection = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        if not len(gate_up) == len(down) == spec.num_experts:
            raise ValueError(
                f"{spec.num_experts} experts, but {len(gate_up)} gate/up and {len(down)} down "
                "layers"
            )
        self.spec, self.kernels = spec, kernels
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

        _LAYERS[id(self)] = self

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _kernel_grouped_experts_op(x, expert_ids, weights, id(self))
        return self.run(x, expert_ids, weights)

    def run(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The block's output (`GroupedExperts.forward`), eagerly."""
        return run_grouped(x, expert_ids, weights, self.spec.num_experts, self._expert_ffn)

    def _expert_ffn(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        hidden = fused.silu_and_mul(self.gate_up[expert](rows), self.kernels)
        return self.down[expert](hidden)

    def missing_shards(self) -> list[tuple[int, str]]:
        """None: every expert was built whole from the checkpoint's quantized tensors."""
        return []

    def weight_bytes(self) -> int:
        """Bytes of every expert's kernel tables."""
        return distinct_bytes(self.buffers())


# The live layers by id, for the compiled graph's op (weak: a dropped model frees its layers).
_LAYERS: weakref.WeakValueDictionary[int, KernelGroupedExperts] = weakref.WeakValueDictionary()


@torch.library.custom_op("pagedllm::kernel_grouped_experts", mutates_args=())
def _kernel_grouped_experts_op(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, layer_id: int
) -> torch.Tensor:
    return _LAYERS[layer_id].run(x, expert_ids, weights)


@_kernel_grouped_experts_op.register_fake
def _(x, expert_ids, weights, layer_id):
    return torch.empty_like(x)
