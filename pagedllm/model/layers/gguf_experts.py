"""A mixture's experts on the GGUF file's blocks (`quantization="gguf"`).

Owns `GGUFGroupedExperts`, which stands where `GroupedExperts` stood: one kernel layer per
expert for its fused gate/up rows and one for its down rows, each on that expert's slice
of the file's stacked `ffn_{gate,up,down}_exps` blocks, and `gguf_grouped_experts`, which
builds it from those tensors. Tokens are grouped by expert exactly as `GroupedExperts`
groups them (`run_grouped`): an expert without routed rows costs nothing, and the weights
the kernels read are the file's, so the experts hold about the file's expert bytes instead
of fp32's four bytes a weight. The only approximation is the kernels' activation
quantization, as for every GGUF layer.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.model.layers.fused_moe import GroupedExperts, MoESpec, run_grouped
from pagedllm.model.layers.gguf_linear import (
    GGUFConcatLinear,
    GGUFLinear,
    GGUFMergedLinear,
    as_kernel_type,
    distinct_bytes,
)
from pagedllm.ops import fused
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection

# One stacked part of the file: (type, raw blocks [experts, rows, bytes per row]).
StackedPart = tuple[GGMLQuantizationType, np.ndarray]


class GGUFGroupedExperts(nn.Module):
    """`GroupedExperts` with expert e's gate/up in `gate_up[e]` and down in `down[e]`."""

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
            # One opaque op to the tracer: the grouping's sizes depend on the routing, and
            # the kernel layers are found by this layer's id, not traced.
            return _gguf_grouped_experts_op(x, expert_ids, weights, id(self))
        return self.run(x, expert_ids, weights)

    def run(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The block's output (`GroupedExperts.forward`), eagerly."""
        return run_grouped(x, expert_ids, weights, self.spec.num_experts, self._expert_ffn)

    def _expert_ffn(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        hidden = fused.silu_and_mul(self.gate_up[expert](rows), self.kernels)
        return self.down[expert](hidden)

    def missing_shards(self) -> list[tuple[int, str]]:
        """None: every expert was built from the file's blocks."""
        return []

    def weight_bytes(self) -> int:
        """Bytes of every expert's kernel tables."""
        return distinct_bytes(self.buffers())


# The live layers by id, for the compiled graph's op (weak: a dropped model frees its layers).
_LAYERS: weakref.WeakValueDictionary[int, GGUFGroupedExperts] = weakref.WeakValueDictionary()


@torch.library.custom_op("pagedllm::gguf_grouped_experts", mutates_args=())
def _gguf_grouped_experts_op(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, layer_id: int
) -> torch.Tensor:
    return _LAYERS[layer_id].run(x, expert_ids, weights)


@_gguf_grouped_experts_op.register_fake
def _(x, expert_ids, weights, layer_id):
    return torch.empty_like(x)


def gguf_grouped_experts(
    experts: GroupedExperts, gate_up: tuple[StackedPart, ...], down: tuple[StackedPart, ...]
) -> GGUFGroupedExperts:
    """`experts` on the file's blocks: `gate_up` the (gate, up) stacked parts, `down` the
    one down part. Only for one tensor-parallel rank (each keeps every expert whole)."""
    if experts.tp_size != 1:
        raise ValueError("GGUF experts on their blocks are built for one tensor-parallel rank")
    (gate_type, gate), (up_type, up) = gate_up
    ((down_type, down_raw),) = down
    gate_up_layers = [
        _gate_up_layer(gate_type, gate[e], up_type, up[e]) for e in range(experts.spec.num_experts)
    ]
    down_layers = [
        GGUFLinear(*as_kernel_type(down_raw[e], down_type)) for e in range(experts.spec.num_experts)
    ]
    return GGUFGroupedExperts(experts.spec, gate_up_layers, down_layers, experts.kernels)


def _gate_up_layer(
    gate_type: GGMLQuantizationType, gate: np.ndarray, up_type: GGMLQuantizationType, up: np.ndarray
) -> nn.Module:
    """One expert's gate rows then up rows: one kernel call when their types agree."""
    gate, gate_type = as_kernel_type(gate, gate_type)
    up, up_type = as_kernel_type(up, up_type)
    sizes = [len(gate), len(up)]
    if gate_type == up_type:
        return GGUFMergedLinear([gate, up], gate_type, sizes)
    return GGUFConcatLinear([GGUFLinear(gate, gate_type), GGUFLinear(up, up_type)], sizes)
