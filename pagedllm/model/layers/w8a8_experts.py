"""A mixture's experts on an int8 W8A8 or FP8 checkpoint's 8-bit weights, as llm-compressor
and the FP8 writers store them: each expert's gate, up and down quantized as a linear layer
of its own (Qwen3-MoE `model.layers.N.mlp.experts.E.gate_proj|up_proj|down_proj`, Mixtral
`model.layers.N.block_sparse_moe.experts.E.w1|w3|w2`, each a `weight` with its
`weight_scale`), the router left unquantized.

Owns `W8A8GroupedExperts` (a `KernelGroupedExperts`, `kernel_experts.py`: tokens grouped by
routing as the GGUF and packed experts are) and `w8a8_grouped_experts`, which builds it one
expert at a time on the dense 8-bit layers (`w8a8_linear.py`): the expert's gate and up rows
stacked in one layer (one kernel call, as a dense gate/up; one each where FP8 blocks do not
stack) and its down in another; int8 x int8 on the integer GEMM, FP8 and weight-only int8 a
band of dequantized rows at a time. The weights stay as the checkpoint stores them (int8 or
e4m3 values and their scales); none is held in fp32. Each layer quantizes its input as a
dense 8-bit layer does, over the rows routed to the expert: a per-token, per-group or static
scale is each token's own whatever else is routed with it (a dynamic per-tensor scale spans
the expert's rows).

Tensor parallel: a rank keeps its `intermediate / tp` rows of every expert's gate and up
with their scales (`w8a8_parallel.take_w8a8_rows`), so its silu-and-mul output is its slice
of the intermediate; down gathers that slice from every rank and computes the rank's share
of the hidden rows over the whole intermediate (`w8a8_parallel.expert_down_layer`), so
down's activation scale is taken over the whole intermediate row as on one rank, and the
block's one all-reduce joins the ranks' columns. The cost: an all-gather of
[rows, intermediate / tp] per routed expert.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from pagedllm.model.layers.fused_moe import GroupedExperts
from pagedllm.model.layers.gguf_linear import GGUFConcatLinear
from pagedllm.model.layers.kernel_experts import (
    ExpertPart,
    KernelGroupedExperts,
    check_expert_shape,
    expert_layers,
    rank_gate_and_up,
)
from pagedllm.model.layers.w8a8_linear import w8a8_layer
from pagedllm.model.layers.w8a8_parallel import expert_down_layer, take_w8a8_rows
from pagedllm.model.layers.w8a8_weights import W8A8Weights, can_stack, stack_weights

# One part's 8-bit weights, read when its expert is built.
WeightsOf = Callable[[ExpertPart], W8A8Weights]


class W8A8GroupedExperts(KernelGroupedExperts):
    """`KernelGroupedExperts` on 8-bit layers: expert e's gate/up in `gate_up[e]` (a fused
    8-bit layer, or a `GGUFConcatLinear` of two) and its down in `down[e]`."""

    def weight_bytes(self) -> int:
        """Every expert's weights and scales (fbgemm's prepacked int8 is held outside the
        layers' buffers, so each layer counts its own)."""
        return sum(layer.weight_bytes() for layer in (*self.gate_up, *self.down))


def w8a8_grouped_experts(
    experts: GroupedExperts, parts: set[ExpertPart], weights_of: WeightsOf, where: str
) -> W8A8GroupedExperts:
    """`experts` (the block `where` names) on 8-bit layers: `parts` are the (expert, shard)
    pairs the checkpoint quantizes, which must be all of them; `weights_of` reads one."""
    gate_up, down = expert_layers(
        experts,
        parts,
        weights_of,
        where,
        partial(_gate_up_layer, experts),
        partial(_down_layer, experts),
    )
    return W8A8GroupedExperts(experts.spec, gate_up, down, experts.kernels)


def _gate_up_layer(
    experts: GroupedExperts, gate: W8A8Weights, up: W8A8Weights, where: str
) -> nn.Module:
    """This rank's gate rows, then its up rows."""
    mine = rank_gate_and_up(experts, gate, up, where, lambda w: w.values.shape, take_w8a8_rows)
    sizes = [experts.shard_size] * 2
    if can_stack(mine):
        return w8a8_layer(stack_weights(mine), output_sizes=sizes)
    return GGUFConcatLinear([w8a8_layer(part) for part in mine], sizes)


def _down_layer(experts: GroupedExperts, down: W8A8Weights, where: str) -> nn.Module:
    """Every output row on one rank; this rank's share over the gathered input on several."""
    check_expert_shape(
        down.values.shape,
        (experts.spec.hidden_size, experts.spec.intermediate_size),
        f"{where} down",
    )
    return expert_down_layer(down, experts.tp_group)
