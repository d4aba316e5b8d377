"""A mixture's experts on the GGUF file's blocks (`quantization="gguf"`).

Owns `GGUFGroupedExperts` (a `KernelGroupedExperts`, `kernel_experts.py`): one kernel
layer per expert for its fused gate/up rows and one for its down rows, each on that
expert's slice of the file's stacked `ffn_{gate,up,down}_exps` blocks, and
`gguf_grouped_experts`, which builds it from those tensors. Tokens are grouped by expert
exactly as `GroupedExperts` groups them (`run_grouped`): an expert without routed rows
costs nothing, and the weights the kernels read are the file's, so the experts hold about
the file's expert bytes instead of fp32's four bytes a weight. The only approximation is
the kernels' activation quantization, as for every GGUF layer.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.model.layers.fused_moe import GroupedExperts
from pagedllm.model.layers.gguf_linear import (
    GGUFConcatLinear,
    GGUFLinear,
    GGUFMergedLinear,
    kernel_runs,
)
from pagedllm.model.layers.kernel_experts import KernelGroupedExperts

# One stacked part of the file: (type, raw blocks [experts, rows, bytes per row]).
StackedPart = tuple[GGMLQuantizationType, np.ndarray]


class GGUFGroupedExperts(KernelGroupedExperts):
    """`KernelGroupedExperts` on the file's blocks: expert e's gate/up in `gate_up[e]` and
    down in `down[e]`, each a GGUF kernel layer."""


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
    down_layers = [GGUFLinear(down_raw[e], down_type) for e in range(experts.spec.num_experts)]
    return GGUFGroupedExperts(experts.spec, gate_up_layers, down_layers, experts.kernels)


def _gate_up_layer(
    gate_type: GGMLQuantizationType, gate: np.ndarray, up_type: GGMLQuantizationType, up: np.ndarray
) -> nn.Module:
    """One expert's gate rows then up rows: one kernel call when their types share one
    (`kernel_runs`)."""
    sizes = [len(gate), len(up)]
    runs = kernel_runs([(gate_type, [gate]), (up_type, [up])])
    if len(runs) == 1:
        return GGUFMergedLinear(runs[0][1], runs[0][0], sizes)
    return GGUFConcatLinear([GGUFLinear(raws, run_type) for run_type, raws in runs], sizes)
