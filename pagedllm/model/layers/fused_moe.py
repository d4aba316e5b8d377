"""A mixture-of-experts feed-forward block: the router and the experts, run grouped.

Owns `MoESpec` (what a model's MoE layer is), `select_experts` (softmax over the router
logits, top-k, the model's normalization), `TopKRouter`, `GroupedExperts` (every expert's
gate/up and down weights stacked in two 3-D parameters, filled one expert's slice at a time
or whole) and `FusedMoE`, the layer a decoder's `make_mlp` returns.

The router follows Transformers (5.x) bit for bit: logits in the hidden dtype, softmax in
fp32, top-k of the probabilities, renormalized in fp32 where the model does so; Qwen3-MoE
then casts the weights back to the hidden dtype, Mixtral keeps them in fp32. The experts'
weighted outputs are summed per token in that weight dtype and cast to the hidden dtype
once, as Transformers' default ("grouped_mm") experts do.

Grouped: the token x top-k assignments are sorted by expert, and each expert that got rows
runs one gate/up matmul, silu-and-mul and one down matmul on all of them; experts without
rows cost nothing. The loop is over experts, never over tokens.

Tensor parallel: each expert's intermediate dimension is split over the TP ranks (gate/up
column-parallel, down row-parallel), so every rank runs every routed expert on its slice
and one all-reduce sums the block's output. The router is replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model.layers.linear import default_weight_loader, set_weight_loader
from pagedllm.model.layers.parallel_linear import divide, load_shard, mark_narrowing
from pagedllm.ops import fused
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection

# Per-expert checkpoint tensors: a shard id is (expert index, one of these).
EXPERT_SHARDS = ("gate", "up", "down")
# One expert's FFN on the rows routed to it: (expert index, rows [n, hidden]) -> [n, hidden].
ExpertFFN = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int  # experts per token
    hidden_size: int
    intermediate_size: int  # each expert's, before tensor-parallel sharding
    renormalize: bool  # divide the top-k weights by their sum
    # Cast the top-k weights to the hidden dtype before they scale the experts' outputs
    # (Qwen3-MoE); else they stay fp32 (Mixtral).
    weights_in_hidden_dtype: bool

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"an MoE layer needs at least one expert, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"experts per token must be between 1 and the {self.num_experts} experts, "
                f"got {self.top_k}"
            )


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in `weights_dtype`, expert ids [T, top_k]) of each token."""
    if torch.compiler.is_compiling():
        # One opaque op in a graph: Inductor's own softmax differs from ATen's in the last
        # bits, and a routing weight must be the eager step's.
        return _select_experts_op(router_logits, top_k, renormalize, weights_dtype)
    return _select_experts(router_logits, top_k, renormalize, weights_dtype)


def _select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), expert_ids


@torch.library.custom_op("pagedllm::select_experts", mutates_args=())
def _select_experts_op(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return _select_experts(router_logits, top_k, renormalize, weights_dtype)


@_select_experts_op.register_fake
def _(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (router_logits.shape[0], top_k)
    weights = router_logits.new_empty(shape, dtype=weights_dtype)
    return weights, router_logits.new_empty(shape, dtype=torch.int64)


class TopKRouter(nn.Module):
    """Router logits x W^T (W [num_experts, hidden], replicated on every rank), then
    `select_experts`."""

    def __init__(self, spec: MoESpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.weight = set_weight_loader(
            nn.Parameter(
                torch.empty(spec.num_experts, spec.hidden_size, dtype=dtype), requires_grad=False
            ),
            default_weight_loader,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # F.linear, as Transformers: a routing decision must not hinge on a kernel's rounding.
        logits = F.linear(x, self.weight)
        weights_dtype = x.dtype if self.spec.weights_in_hidden_dtype else torch.float32
        return select_experts(logits, self.spec.top_k, self.spec.renormalize, weights_dtype)


class GroupedExperts(nn.Module):
    """`gate_up_proj` [experts, 2 * intermediate, hidden] (each expert's gate rows, then its
    up rows) and `down_proj` [experts, hidden, intermediate]: Transformers' stacked layout,
    with this rank's `intermediate_size / tp` slice of each expert."""

    def __init__(
        self, spec: MoESpec, dtype: torch.dtype, kernels: KernelSelection = TORCH_KERNELS
    ) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_group = group  # the quantized experts that replace these gather over it
        self.tp_rank, self.tp_size = group.rank_in_group, group.world_size
        self.spec, self.kernels = spec, kernels
        self.shard_size = divide(spec.intermediate_size, self.tp_size, "MoE intermediate size")
        experts, hidden = spec.num_experts, spec.hidden_size
        self.gate_up_proj = self._parameter(experts, 2 * self.shard_size, hidden, dtype=dtype)
        self.down_proj = self._parameter(experts, hidden, self.shard_size, dtype=dtype)
        self._filled: set[tuple[int, str]] = set()  # (expert, shard) pairs loaded so far

    def _parameter(self, *shape: int, dtype: torch.dtype) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        mark_narrowing(param)  # tensor-parallel ranks read only their slice
        return set_weight_loader(param, self.weight_loader)

    # ---- loading ------------------------------------------------------------------------------
    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """`shard_id` None: the whole stacked tensor (Transformers' `experts.gate_up_proj`
        [E, 2I, H] or `experts.down_proj` [E, H, I]); (expert, "gate" | "up" | "down"): one
        expert's checkpoint matrix ([I, H] for gate and up, [H, I] for down)."""
        if shard_id is None:
            self._load_stacked(param, loaded)
            return
        expert, shard = shard_id
        if shard not in EXPERT_SHARDS or not 0 <= expert < self.spec.num_experts:
            raise ValueError(f"no expert shard {shard_id!r} in {self.spec.num_experts} experts")
        if (shard == "down") != (param is self.down_proj):
            raise ValueError(f"expert shard {shard!r} does not belong in this parameter")
        size, full = self.shard_size, self.spec.intermediate_size
        start = self.tp_rank * size
        if shard == "down":
            load_shard(param.data[expert], loaded, 1, start, (self.spec.hidden_size, full))
        else:
            rows = param.data[expert, self._gate_up_rows(shard)]
            load_shard(rows, loaded, 0, start, (full, self.spec.hidden_size))
        self._filled.add((expert, shard))

    def _gate_up_rows(self, shard: str) -> slice:
        offset = 0 if shard == "gate" else self.shard_size
        return slice(offset, offset + self.shard_size)

    def _load_stacked(self, param: nn.Parameter, loaded: Any) -> None:
        experts, hidden = self.spec.num_experts, self.spec.hidden_size
        full = self.spec.intermediate_size
        start = self.tp_rank * self.shard_size
        if param is self.down_proj:
            load_shard(param.data, loaded, 2, start, (experts, hidden, full))
            shards = ["down"]
        else:
            for shard, offset in (("gate", 0), ("up", full)):
                rows = param.data[:, self._gate_up_rows(shard)]
                load_shard(rows, loaded, 1, offset + start, (experts, 2 * full, hidden))
            shards = ["gate", "up"]
        self._filled.update((e, s) for e in range(experts) for s in shards)

    def missing_shards(self) -> list[tuple[int, str]]:
        """(expert, shard) pairs no checkpoint tensor has filled yet."""
        return [
            (e, s)
            for e in range(self.spec.num_experts)
            for s in EXPERT_SHARDS
            if (e, s) not in self._filled
        ]

    # ---- forward ------------------------------------------------------------------------------
    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t (this rank's
        partial sum under tensor parallelism), in the hidden dtype."""
        args = (x, expert_ids, weights, self.gate_up_proj, self.down_proj)
        if torch.compiler.is_compiling():
            # One opaque op to the tracer: the grouping's sizes depend on the routing.
            return _grouped_experts_op(*args, self.kernels.fused_ops)
        return grouped_experts(*args, self.kernels)


def grouped_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    kernels: KernelSelection = TORCH_KERNELS,
) -> torch.Tensor:
    """`GroupedExperts.forward` on the stacked weights."""

    def expert_ffn(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = fused.linear(rows, gate_up_proj[expert], None, kernels)
        return fused.linear(fused.silu_and_mul(gate_up, kernels), down_proj[expert], None, kernels)

    return run_grouped(x, expert_ids, weights, gate_up_proj.shape[0], expert_ffn)


def run_grouped(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    expert_ffn: ExpertFFN,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_ffn(ids[t, k], x[t]) for every token t, in x's dtype,
    each expert that has rows called once on all of them (the experts' weights may be
    stacked tensors or quantized layers: `expert_ffn` holds them)."""
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    # Assignment i (token i // top_k, choice i % top_k) in expert order.
    order = torch.argsort(flat_ids, stable=True)
    rows = x.index_select(0, order // top_k)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    grouped = rows.new_empty(rows.shape)  # an expert's output has the hidden width
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        grouped[start:end] = expert_ffn(expert, rows[start:end])
        start = end
    weighted = grouped * weights.reshape(-1)[order, None]
    # Back to (token, choice) order: each token's choices are summed in the weights' dtype,
    # then cast once, as Transformers' default experts do.
    per_choice = torch.empty_like(weighted).index_copy_(0, order, weighted)
    return per_choice.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


@torch.library.custom_op("pagedllm::grouped_experts", mutates_args=())
def _grouped_experts_op(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    fused_ops: bool,
) -> torch.Tensor:
    kernels = dataclasses.replace(TORCH_KERNELS, fused_ops=fused_ops)
    return grouped_experts(x, expert_ids, weights, gate_up_proj, down_proj, kernels)


@_grouped_experts_op.register_fake
def _(x, expert_ids, weights, gate_up_proj, down_proj, fused_ops):
    return torch.empty_like(x)


class FusedMoE(nn.Module):
    """The MoE feed-forward block: `gate` (the router) picks each token's experts and their
    weights, `experts` runs them grouped; one all-reduce under tensor parallelism."""

    def __init__(
        self, spec: MoESpec, dtype: torch.dtype, kernels: KernelSelection = TORCH_KERNELS
    ) -> None:
        super().__init__()
        self.tp_group = get_tp_group()
        self.gate = TopKRouter(spec, dtype)
        self.experts = GroupedExperts(spec, dtype, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        out = self.experts(x, expert_ids, weights)
        if self.tp_group.world_size > 1:
            out = self.tp_group.all_reduce(out)
        return out
