"""`LoRALinear`: a projection plus the LoRA deltas of the step's adapters, all in one pass.

Each wrapped projection keeps `max_loras` slots of stacked adapter weights:
`lora_a[slot]` is [in, slices x max_rank] (every slice's A, transposed, side by side) and
`lora_b[slot]` is [slices x max_rank, out], block-structured so each slice's B writes its
own columns of the fused output (q/k/v, gate/up); ranks below `max_rank` are zero-padded,
and the scaling is folded into B. A token's delta is then two small matmuls against its
adapter's slot.

A step's tokens are laid out once (`LoRAStep`, shared by every layer), in the spirit of
punica's kernels: runs of consecutive tokens of one adapter (prefills, or requests of one
adapter side by side) apply in place on slices of the input and output; interleaved tokens
of evenly used slots (decodes of many adapters) are gathered into one [slots, rows, in] block
and go through two batched matmuls for all adapters at once (BGMV); otherwise the tokens are
gathered sorted by slot and each slot's rows run as one matmul pair (SGMV). Tokens without
an adapter are never touched, and a step without any adapter skips the layer's LoRA work.

With tensor parallelism each rank applies its cut of every adapter (`RankCut`), cut as the
base weights are (`model/layers/parallel_linear.py`): a column-parallel projection (q/k/v,
gate/up) keeps each shard's rows of B that its output slice holds (q heads, its KV heads,
replicated ones included) and all of A; a row-parallel one (o, down) keeps A's columns of
its input slice and all of B, and its delta joins the rank's partial product before the
base's all-reduce. A quantized row-parallel projection that keeps output rows over the
gathered input instead (packed and GGUF layers, `model/layers/row_gather.py`) keeps all of
A and B's rows of its output rows: its delta, over the gathered input, joins its own rows
before the outputs are gathered, so each rank computes whole rows of the delta as one rank
does. Adapters arrive whole (the same file on every rank) and are cut as they take a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.ops.extension import load
from pagedllm.ops.kernel_selection import TORCH_KERNELS

# Checkpoint projection -> (the model's module that computes it, the shard of its output).
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", None),
}
WRAPPED_MODULES = frozenset(module for module, _ in FUSED_PROJECTIONS.values())


@dataclass(frozen=True)
class LoRAStep:
    """Where the step's adapter tokens are, in one of three layouts:
    - `runs`: (slot, start, end) over the flattened batch, applied on slices in place;
    - `batched`: the tokens gathered (`gather`) into one [slots, rows, in] block, each slot's
      rows padded to the longest group's, all slots in two batched matmuls, then `positions`
      (each adapter token's row in the block) added back at `sorted_tokens` (without
      padding, `positions` is None and the rows go back at `gather`);
    - `groups`: the tokens gathered sorted by slot (`gather`), (slot, start, end) per group,
      and added back at `gather`.
    """

    runs: list[tuple[int, int, int]] | None = None
    gather: torch.Tensor | None = None
    groups: list[tuple[int, int, int]] | None = None
    rows_per_slot: int = 0
    positions: torch.Tensor | None = None
    # For the CPU kernel (any layout but runs): the adapter tokens by slot, and where each
    # slot's tokens start in them ([slots + 1] offsets).
    sorted_tokens: torch.Tensor | None = None
    group_starts: torch.Tensor | None = None

    @classmethod
    def build(
        cls, token_slots: np.ndarray, num_slots: int, device: torch.device
    ) -> LoRAStep | None:
        """The layout of one step from each token's slot (-1: no adapter); None when no
        token has one. The cheapest layout is chosen: few runs apply in place; many
        interleaved tokens of evenly used slots (decodes of many adapters) go batched; the
        rest are gathered by group."""
        lora_tokens = np.flatnonzero(token_slots >= 0)
        if not len(lora_tokens):
            return None
        bounds = np.flatnonzero(np.diff(token_slots)) + 1
        starts = np.concatenate(([0], bounds))
        ends = np.concatenate((bounds, [len(token_slots)]))
        runs = [
            (int(token_slots[s]), int(s), int(e))
            for s, e in zip(starts, ends, strict=True)
            if token_slots[s] >= 0
        ]
        slots = token_slots[lora_tokens]
        counts = np.bincount(slots, minlength=num_slots)
        num_groups = int(np.count_nonzero(counts))
        # A run costs two small matmuls; gathering costs about three more ops for the step.
        if len(runs) <= num_groups + 1:
            return cls(runs=runs)
        order = np.argsort(slots, kind="stable")
        sorted_tokens = lora_tokens[order]
        group_ends = np.cumsum(counts)
        by_slot = {
            "sorted_tokens": torch.from_numpy(sorted_tokens).to(device),
            "group_starts": torch.from_numpy(np.concatenate(([0], group_ends))).to(device),
        }
        rows_per_slot = int(counts.max())
        if num_slots * rows_per_slot <= 2 * len(lora_tokens):
            return cls._batched(sorted_tokens, counts, rows_per_slot, device, by_slot)
        groups = [
            (slot, int(group_ends[slot] - counts[slot]), int(group_ends[slot]))
            for slot in np.flatnonzero(counts).tolist()
        ]
        return cls(gather=by_slot["sorted_tokens"], groups=groups, **by_slot)

    @classmethod
    def _batched(
        cls, sorted_tokens: np.ndarray, counts: np.ndarray, rows_per_slot: int, device, by_slot
    ) -> LoRAStep:
        num_slots = len(counts)
        first = np.cumsum(counts) - counts  # each slot's first token in sorted_tokens
        row = np.arange(rows_per_slot)
        # Padding rows repeat a real token (any finite row will do: their deltas are dropped).
        source = np.minimum(first[:, None] + row, len(sorted_tokens) - 1)
        gather = sorted_tokens[source].reshape(-1)
        gather = torch.from_numpy(gather).to(device)
        if num_slots * rows_per_slot == len(sorted_tokens):  # every slot's rows are full
            return cls(gather=gather, rows_per_slot=rows_per_slot, **by_slot)
        slot_of = np.repeat(np.arange(num_slots), counts)
        positions = slot_of * rows_per_slot + (np.arange(len(sorted_tokens)) - first[slot_of])
        return cls(
            gather=gather,
            rows_per_slot=rows_per_slot,
            positions=torch.from_numpy(positions).to(device),
            **by_slot,
        )


class LoRAState:
    """The one object every `LoRALinear` of a model reads the current step from."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


@dataclass(frozen=True)
class RankCut:
    """The part of an adapter's full weights this rank's projection applies (with one rank,
    all of them): `b_rows`, per output shard, the first row of the checkpoint's B that its
    output slice starts at; `a_start`, the first of A's columns (input features) it holds;
    `partial`: its base is row-parallel over several ranks, and the delta goes into the
    rank's partial product, before the all-reduce; `gathered`: its base computes its output
    rows over the gathered input (`row_gather.py`), and so does the delta."""

    b_rows: dict[str | None, int]
    a_start: int = 0
    partial: bool = False
    gathered: bool = False


class LoRALinear(nn.Module):
    """`base` (any projection: its output is [tokens, out]) plus the step's LoRA deltas."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        slices: dict[str | None, slice],
        max_loras: int,
        max_rank: int,
        state: LoRAState,
        dtype: torch.dtype,
        device: torch.device,
        cut: RankCut | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.slices = slices  # shard id -> its output columns (None: the whole output)
        self.cut = cut or RankCut(dict.fromkeys(slices, 0))
        self.max_rank = max_rank
        self.state = state
        out_features = max(s.stop for s in slices.values())
        width = len(slices) * max_rank
        # Each shard's (rank rows, output columns) of B: its nonzero block.
        self.blocks = [
            (slice(i * max_rank, (i + 1) * max_rank), columns)
            for i, columns in enumerate(slices.values())
        ]
        self.lora_a = torch.zeros(max_loras, in_features, width, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        # The CPU kernel's shard column offsets (None: the torch path runs).
        self.kernel_columns: torch.Tensor | None = None
        kernels = getattr(base, "kernels", TORCH_KERNELS)
        if kernels.fused_ops and dtype == torch.float32 and device.type == "cpu":
            starts = [columns.start for columns in slices.values()]
            self.kernel_columns = torch.tensor([*starts, out_features], dtype=torch.int64)

    def shard_index(self, shard: str | None) -> int:
        return list(self.slices).index(shard)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def set_slice(self, slot: int, shard: str | None, lora_a: torch.Tensor, lora_b: torch.Tensor):
        """Write this rank's cut of one shard's full A [rank, in] and scaled B [out, rank]
        into `slot`."""
        rank = lora_a.shape[0]
        offset = self.shard_index(shard) * self.max_rank
        columns = self.slices[shard]
        first_row = self.cut.b_rows[shard]
        # A gathered layer's last shares end in padding rows, which B has none of: left 0.
        rows = min(columns.stop - columns.start, lora_b.shape[0] - first_row)
        lora_a = lora_a.narrow(1, self.cut.a_start, self.in_features)
        lora_b = lora_b.narrow(0, first_row, rows)
        self.lora_a[slot, :, offset : offset + rank] = lora_a.T
        self.lora_b[slot, offset : offset + rank, columns.start : columns.start + rows] = lora_b.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.state.step
        if step is None:
            return self.base(x)
        if self.cut.gathered:
            # Whole rows of the delta over the gathered input, into this rank's own rows.
            whole = self.base.gathered_input(x)
            mine = apply_lora(self, self.base.own_rows(whole), whole, step)
            return self.base.joined_output(mine, x.shape[:-1])
        rows = x.reshape(-1, self.in_features)
        if not self.cut.partial:
            return apply_lora(self, self.base(x), rows, step)
        # Row-parallel: x_r A_r^T B^T joins this rank's partial product, and the base's one
        # all-reduce sums the deltas with the products (the delta is linear in x, so the sum
        # over ranks is x A^T B^T). All-reducing the shrunk x A^T instead would cost a
        # collective of its own per layer, dearer on CPU than the small matmuls it saves.
        partial = self.base.partial_forward(x)
        return self.base.reduce_partial(apply_lora(self, partial, rows, step))


def apply_lora(layer: LoRALinear, output: torch.Tensor, x: torch.Tensor, step: LoRAStep):
    """The step's deltas into `output`: the CPU kernel where it runs (fp32; any layout but
    runs, whose long per-adapter matmuls suit torch's GEMM), else the torch path."""
    if (
        layer.kernel_columns is not None
        and step.runs is None
        and x.stride(1) == output.stride(1) == 1
    ):
        load().lora_sgmv(
            output,
            x,
            layer.lora_a,
            layer.lora_b,
            step.sorted_tokens,
            step.group_starts,
            layer.kernel_columns,
            layer.max_rank,
        )
        return output
    return add_lora(output, x, layer.lora_a, layer.lora_b, step, layer.blocks)


def add_lora(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    step: LoRAStep,
    blocks: list[tuple[slice, slice]],
) -> torch.Tensor:
    """output[t] += x[t] A[slot(t)] B[slot(t)] for every adapter token t, in place.
    `blocks`: each shard's nonzero block of B (rank rows, output columns)."""
    if step.runs is not None:
        # Long runs: each shard's block alone (a third of a fused q/k/v B's products).
        for slot, start, end in step.runs:
            shrunk = torch.mm(x[start:end], lora_a[slot])
            for ranks, columns in blocks:
                output[start:end, columns].addmm_(shrunk[:, ranks], lora_b[slot, ranks, columns])
        return output
    assert step.gather is not None
    gathered = x.index_select(0, step.gather)
    if step.groups is None:  # batched
        blocks = gathered.view(lora_a.shape[0], step.rows_per_slot, -1)
        deltas = torch.bmm(torch.bmm(blocks, lora_a), lora_b).view(-1, output.shape[1])
        if step.positions is None:  # no padding rows: every row is one token's
            return output.index_add_(0, step.gather, deltas)
        return output.index_add_(0, step.sorted_tokens, deltas.index_select(0, step.positions))
    deltas = torch.empty(
        (len(step.gather), output.shape[1]), dtype=output.dtype, device=output.device
    )
    for slot, start, end in step.groups:
        torch.mm(torch.mm(gathered[start:end], lora_a[slot]), lora_b[slot], out=deltas[start:end])
    return output.index_add_(0, step.gather, deltas)


def wrap_lora_modules(
    model: nn.Module,
    max_loras: int,
    max_rank: int,
    state: LoRAState,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int = 1,
) -> dict[str, LoRALinear]:
    """Replace each decoder layer's projections with a `LoRALinear` around it; returns them
    by module name (model.layers.3.self_attn.qkv_proj). `tp_size`: the tensor-parallel
    ranks the projections are split over (each wrapper applies its rank's cut)."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in WRAPPED_MODULES and ".layers." in f".{name}"
    ]
    wrapped = {}
    for name, module in targets:
        shape = _projection_shape(module)
        if shape is None:
            continue  # not a dense projection (an MoE's experts, say)
        out_features, in_features = shape
        shard_slices = getattr(module, "shard_slices", None) or {None: slice(0, out_features)}
        parent_name, _, child = name.rpartition(".")
        cut = rank_cut(name, module, list(shard_slices), in_features, tp_size)
        layer = LoRALinear(
            module, in_features, dict(shard_slices), max_loras, max_rank, state, dtype, device, cut
        )
        setattr(model.get_submodule(parent_name), child, layer)
        wrapped[name] = layer
    return wrapped


def rank_cut(
    name: str, module: nn.Module, shards: list[str | None], in_features: int, tp_size: int
) -> RankCut:
    """How this rank cuts adapters for `module`, read from how its base weight was cut: a
    column-parallel layer's `shard_sources` (its rows of each shard in the checkpoint), a
    row-parallel one's rank (its slice of the input features), or a gathered row-parallel
    one's first output row (`row_gather.py`: all of the input features)."""
    sources = getattr(module, "shard_sources", None)
    if sources is not None:
        return RankCut({shard: sources[shard][0] for shard in shards})
    first_row = getattr(module, "first_output_row", None)
    if first_row is not None:
        return RankCut({None: first_row}, gathered=True)
    if getattr(module, "tp_size", 1) > 1 and hasattr(module, "partial_forward"):
        return RankCut({None: 0}, module.tp_rank * in_features, partial=True)
    if tp_size > 1:  # a layer whose split is unknown here: refused, never applied wrong
        raise ValueError(
            f"LoRA cannot cut adapters for {name} ({type(module).__name__}) over "
            f"tensor_parallel_size {tp_size}: it carries no tensor-parallel layout"
        )
    return RankCut(dict.fromkeys(shards, 0))


def _projection_shape(module: nn.Module) -> tuple[int, int] | None:
    """(out, in) of a dense projection: a float weight's shape, or a quantized layer's."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.shape[0], weight.shape[1]
    out_features = getattr(module, "out_features", None)
    in_features = getattr(module, "in_features", None)
    if isinstance(out_features, int) and isinstance(in_features, int):
        return out_features, in_features
    return None


def lora_target(checkpoint_module: str) -> tuple[str, str | None]:
    """(the wrapped module's name, its shard) computing a checkpoint projection."""
    parent, _, projection = checkpoint_module.rpartition(".")
    module, shard = FUSED_PROJECTIONS[projection]
    return f"{parent}.{module}", shard
