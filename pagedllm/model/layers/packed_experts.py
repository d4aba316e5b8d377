"""A mixture's experts on a checkpoint's packed integer weights (GPTQ, AWQ, compressed-tensors
pack-quantized), as GPTQModel and llm-compressor write them: each expert's gate, up and
down quantized as a linear layer of its own (Qwen3-MoE
`model.layers.N.mlp.experts.E.gate_proj|up_proj|down_proj`, Mixtral
`model.layers.N.block_sparse_moe.experts.E.w1|w3|w2`), the router (`mlp.gate`,
`block_sparse_moe.gate`) left unquantized.

Owns `PackedGroupedExperts` (a `KernelGroupedExperts`, `kernel_experts.py`) and
`packed_grouped_experts`, which builds it one expert at a time from its unpacked parts:
the expert's gate and up rows in one packed layer (one kernel call when they share input
order, group size and bits, as a dense gate/up does; else one call each) and its down rows
in another, on the tables the dense packed layers use (`GPTQLinear`). No expert is held
dequantized. Under tensor parallelism a rank keeps its `intermediate / tp` rows of every
gate and up and the same slice of every down's inputs (`packed_parallel.take_input_columns`),
as `GroupedExperts` splits fp32 experts; a down whose groups that slice would cut
(act-order, groups wider than the slice) is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from pagedllm.model.layers.fused_moe import GroupedExperts
from pagedllm.model.layers.gguf_linear import BLOCK
from pagedllm.model.layers.gptq_linear import GPTQLinear, merged_gptq_layer
from pagedllm.model.layers.kernel_experts import (
    ExpertPart,
    KernelGroupedExperts,
    check_expert_shape,
    expert_layers,
    rank_gate_and_up,
)
from pagedllm.model.layers.packed_parallel import take_input_columns, take_output_rows
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ

# One part's integers and scales, unpacked when its expert is built.
UnpackPart = Callable[[ExpertPart], UnpackedGPTQ]


class PackedGroupedExperts(KernelGroupedExperts):
    """`KernelGroupedExperts` on packed layers: expert e's gate/up in `gate_up[e]` (a
    `GPTQMergedLinear`, or a `GGUFConcatLinear` of two `GPTQLinear`s) and its down in
    `down[e]` (a `GPTQLinear`)."""


def packed_grouped_experts(
    experts: GroupedExperts, parts: set[ExpertPart], unpack: UnpackPart, where: str
) -> PackedGroupedExperts:
    """`experts` (the block `where` names) on packed layers: `parts` are the (expert, shard)
    pairs the checkpoint quantizes, which must be all of them; `unpack` reads one."""
    gate_up, down = expert_layers(
        experts,
        parts,
        unpack,
        where,
        partial(_gate_up_layer, experts),
        partial(_down_layer, experts),
    )
    return PackedGroupedExperts(experts.spec, gate_up, down, experts.kernels)


def _gate_up_layer(
    experts: GroupedExperts, gate: UnpackedGPTQ, up: UnpackedGPTQ, where: str
) -> nn.Module:
    """This rank's gate rows, then its up rows."""
    mine = rank_gate_and_up(experts, gate, up, where, lambda w: w.q.shape, take_output_rows)
    return merged_gptq_layer(mine, [experts.shard_size] * 2, None)


def _down_layer(experts: GroupedExperts, down: UnpackedGPTQ, where: str) -> GPTQLinear:
    """This rank's slice of down's inputs, every output row."""
    check_expert_shape(
        down.q.shape,
        (experts.spec.hidden_size, experts.spec.intermediate_size),
        f"{where} down",
    )
    return GPTQLinear(down if experts.tp_size == 1 else _rank_inputs(experts, down, where))


def _rank_inputs(experts: GroupedExperts, down: UnpackedGPTQ, where: str) -> UnpackedGPTQ:
    size = experts.shard_size
    try:
        if size % BLOCK:
            raise ValueError(f"{size} inputs are not whole blocks of {BLOCK}")
        return take_input_columns(down, experts.tp_rank * size, size)
    except ValueError as error:
        raise ValueError(
            f"quantized MoE experts over {experts.tp_size} tensor-parallel ranks are served "
            f"when each rank's {size} down inputs are whole groups, in order; {where} down: "
            f"{error}"
        ) from error
