"""`LoRAStep` layouts and `add_lora` against a per-token reference: runs of one adapter,
interleaved adapters (batched over evenly used slots, or gathered by group), and base tokens
left alone. Tensor parallelism in this process: each rank's cut of an adapter, over the real
parallel layers (float and int8), adds up to one rank's projections."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pagedllm.lora.model.layers import LoRAStep, add_lora

CPU = torch.device("cpu")


def test_no_adapter_token_is_no_step():
    assert LoRAStep.build(np.array([-1, -1, -1]), 3, CPU) is None


def test_runs_of_one_adapter_apply_in_place():
    step = LoRAStep.build(np.array([-1, 2, 2, 2, -1, -1, 0, 0]), 3, CPU)
    assert step.runs == [(2, 1, 4), (0, 6, 8)]


def test_interleaved_adapters_of_even_slots_are_batched():
    step = LoRAStep.build(np.array([1, 0, 1, -1, 0, 1]), 2, CPU)
    assert step.runs is None and step.groups is None
    # Slot 0: tokens 1, 4 and a padding row (a real token: its delta is dropped); slot 1:
    # tokens 0, 2, 5.
    assert step.gather.tolist() == [1, 4, 0, 0, 2, 5]
    assert step.rows_per_slot == 3
    assert step.sorted_tokens.tolist() == [1, 4, 0, 2, 5]
    assert step.positions.tolist() == [0, 1, 3, 4, 5]


def test_interleaved_adapters_of_uneven_slots_are_gathered_by_group():
    step = LoRAStep.build(np.array([1, 0, 1, -1, 1, 1, 0, 1, 1]), 4, CPU)
    assert step.runs is None
    assert step.gather.tolist() == [1, 6, 0, 2, 4, 5, 7, 8]
    assert step.groups == [(0, 0, 2), (1, 2, 8)]


def layout(step: LoRAStep) -> str:
    if step.runs is not None:
        return "runs"
    if step.groups is not None:
        return "groups"
    return "batched" if step.positions is not None else "batched-full"


@pytest.mark.parametrize(
    ("token_slots", "expected_layout"),
    [
        ([0, 0, 0, 1, 1, -1, 2], "runs"),
        ([2, 0, 1, 2, -1, 0, 1, 1, 2, -1], "batched"),
        ([0, 1, 2, 0, 1, 2, -1], "batched-full"),
        ([-1, 1, -1, 1, -1, 1], "groups"),
        ([1, 0, 1, -1, 1, 1, 0, 1, 1, -1, 1, 1, 2, 1], "groups"),
    ],
)
def test_add_lora_equals_per_token_reference(token_slots, expected_layout):
    torch.manual_seed(0)
    num_slots, in_features, width, out_features = 3, 12, 8, 10
    x = torch.randn(len(token_slots), in_features)
    lora_a = torch.randn(num_slots, in_features, width)
    # Two shards (a fused projection): B is zero outside each shard's block, as LoRALinear
    # keeps it.
    blocks = [(slice(0, 4), slice(0, 6)), (slice(4, 8), slice(6, 10))]
    lora_b = torch.zeros(num_slots, width, out_features)
    for ranks, columns in blocks:
        lora_b[:, ranks, columns] = torch.randn(num_slots, 4, columns.stop - columns.start)
    base = torch.randn(len(token_slots), out_features)
    step = LoRAStep.build(np.array(token_slots), num_slots, CPU)
    assert layout(step) == expected_layout
    actual = add_lora(base.clone(), x, lora_a, lora_b, step, blocks)
    expected = base.clone()
    for token, slot in enumerate(token_slots):
        if slot >= 0:
            expected[token] += x[token] @ lora_a[slot] @ lora_b[slot]
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize(
    "token_slots",
    [[2, 0, 1, 2, -1, 0, 1, 1, 2, -1], [1, 0, 1, 1, 2, *[1] * 10], [-1, 1, -1, 1, -1, 1]],
    ids=["even", "more-than-a-tile", "one-slot"],
)
@pytest.mark.parametrize("max_rank", [8, 3], ids=["vector-rank", "odd-rank"])
def test_cpu_kernel_equals_per_token_reference(token_slots, max_rank):
    """The fp32 CPU kernel (lora_sgmv) reads only each shard's block of B; the columns and
    ranks no vector width divides take its scalar tails."""
    from pagedllm.ops.extension import load

    torch.manual_seed(1)
    num_slots, in_features, out_features = 3, 12, 30
    columns = [0, 21, out_features]  # 21: one 16-column vector pair and a tail of 5
    blocks = [
        (slice(k * max_rank, (k + 1) * max_rank), slice(columns[k], columns[k + 1]))
        for k in range(2)
    ]
    x = torch.randn(len(token_slots), in_features)
    lora_a = torch.randn(num_slots, in_features, 2 * max_rank)
    # Garbage outside the blocks: the kernel must not read it.
    lora_b = torch.full((num_slots, 2 * max_rank, out_features), float("nan"))
    for ranks, cols in blocks:
        lora_b[:, ranks, cols] = torch.randn(num_slots, max_rank, cols.stop - cols.start)
    base = torch.randn(len(token_slots), out_features)
    step = LoRAStep.build(np.array(token_slots), num_slots, CPU)
    assert step.runs is None
    actual = base.clone()
    load().lora_sgmv(
        actual, x, lora_a, lora_b, step.sorted_tokens, step.group_starts,
        torch.tensor(columns), max_rank,
    )  # fmt: skip
    expected = base.clone()
    for token, slot in enumerate(token_slots):
        if slot >= 0:
            for ranks, cols in blocks:
                expected[token, cols] += (
                    x[token] @ lora_a[slot][:, ranks] @ lora_b[slot][ranks, cols]
                )
    torch.testing.assert_close(actual, expected)


# ---- tensor parallelism: each rank's cut of an adapter ------------------------------------
HIDDEN, HEAD_DIM, NUM_HEADS, INTERMEDIATE, RANK = 16, 4, 4, 24, 3


class OneRankOfTwo:
    """A rank of a tensor-parallel group in this process: its all-reduce leaves the partial
    product as it is, and the test sums the ranks' products as the collective would."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank_in_group, self.world_size = rank, world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def full_weights(num_kv_heads: int) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint projection -> its base weight, bias (q/k/v only, as Qwen2's) and adapter."""
    generator = torch.Generator().manual_seed(num_kv_heads)
    q, kv = NUM_HEADS * HEAD_DIM, num_kv_heads * HEAD_DIM
    shapes = {
        "q": (HIDDEN, q), "k": (HIDDEN, kv), "v": (HIDDEN, kv), "o": (q, HIDDEN),
        "gate": (HIDDEN, INTERMEDIATE), "up": (HIDDEN, INTERMEDIATE),
        "down": (INTERMEDIATE, HIDDEN),
    }  # fmt: skip

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    return {
        name: {
            "weight": randn(out, inp),
            "bias": randn(out) if name in "qkv" else None,
            "lora_a": randn(RANK, inp),
            "lora_b": randn(out, RANK),
        }
        for name, (inp, out) in shapes.items()
    }


def rank_layers(monkeypatch, weights, num_kv_heads, rank, tp, int8=False):
    """One rank's decoder projections, loaded from the full weights and wrapped for LoRA,
    with the adapter in slot 0."""
    from pagedllm.lora.model.layers import LoRAState, wrap_lora_modules
    from pagedllm.model.layers import parallel_linear as pl
    from pagedllm.model.layers.quantization import Int8MergedLinear, Int8RowParallelLinear

    monkeypatch.setattr(pl, "get_tp_group", lambda: OneRankOfTwo(rank, tp))
    f32 = torch.float32
    attention, mlp = nn.Module(), nn.Module()
    attention.qkv_proj = pl.QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, num_kv_heads, True, f32)
    attention.o_proj = pl.RowParallelLinear(NUM_HEADS * HEAD_DIM, HIDDEN, False, f32)
    mlp.gate_up_proj = pl.MergedColumnParallelLinear(
        HIDDEN, [INTERMEDIATE] * 2, ["gate", "up"], False, f32
    )
    mlp.down_proj = pl.RowParallelLinear(INTERMEDIATE, HIDDEN, False, f32)
    for module, shards in (
        (attention.qkv_proj, "qkv"), (attention.o_proj, [None]),
        (mlp.gate_up_proj, ["gate", "up"]), (mlp.down_proj, [None]),
    ):  # fmt: skip
        for shard in shards:
            source = weights[shard or ("o" if module is attention.o_proj else "down")]
            module.weight_loader(module.weight, source["weight"], shard)
            if module.bias is not None:
                module.weight_loader(module.bias, source["bias"], shard)
    if int8:
        attention.qkv_proj = Int8MergedLinear.from_float(attention.qkv_proj)
        attention.o_proj = Int8RowParallelLinear.from_float(attention.o_proj)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].self_attn, model.layers[0].mlp = attention, mlp
    state = LoRAState()
    layers = wrap_lora_modules(model, 1, 4, state, torch.float32, CPU, tp)
    for name, layer in layers.items():
        for shard in layer.slices:
            adapter = weights[shard or name.rsplit(".", 1)[-1].removesuffix("_proj")]
            layer.set_slice(0, shard, adapter["lora_a"], adapter["lora_b"])
    return layers, state


def one_rank_output(weights, name: str, x: torch.Tensor, token_slots) -> torch.Tensor:
    """x W^T + b of the full projection, plus x A^T B^T on the adapter's tokens."""
    w = weights[name]
    out = x @ w["weight"].T + (0 if w["bias"] is None else w["bias"])
    delta = x @ w["lora_a"].T @ w["lora_b"].T
    return torch.where(torch.tensor(token_slots)[:, None] >= 0, out + delta, out)


def rank_columns(rank: int, num_kv_heads: int) -> dict[str, slice]:
    """Rank `rank` of two's output columns of each full column-parallel projection."""
    q, half = NUM_HEADS * HEAD_DIM // 2, INTERMEDIATE // 2
    kv_start, kv = rank * num_kv_heads // 2 * HEAD_DIM, max(1, num_kv_heads // 2) * HEAD_DIM
    kv_columns = slice(kv_start, kv_start + kv)
    mlp_columns = slice(rank * half, (rank + 1) * half)
    return {
        "q": slice(rank * q, (rank + 1) * q), "k": kv_columns, "v": kv_columns,
        "gate": mlp_columns, "up": mlp_columns,
    }  # fmt: skip


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
@pytest.mark.parametrize("token_slots", [[0] * 5, [0, -1, 0, -1, 0]], ids=["runs", "batched"])
def test_rank_cuts_add_up_to_one_ranks_projections(monkeypatch, num_kv_heads, token_slots):
    """Column-parallel ranks give their slices of one rank's output (q heads split, KV heads
    split or replicated, gate and up each split); row-parallel ranks' partial products, each
    with its rank's delta, sum to one rank's output."""
    torch.manual_seed(2)
    weights = full_weights(num_kv_heads)
    inputs = {
        "qkv": torch.randn(len(token_slots), HIDDEN),
        "o": torch.randn(len(token_slots), NUM_HEADS * HEAD_DIM),
        "down": torch.randn(len(token_slots), INTERMEDIATE),
    }
    x = inputs["qkv"]
    full = {name: one_rank_output(weights, name, x, token_slots) for name in "qkv"}
    full |= {name: one_rank_output(weights, name, x, token_slots) for name in ("gate", "up")}
    row_sums = {"o": 0, "down": 0}
    for rank in range(2):
        layers, state = rank_layers(monkeypatch, weights, num_kv_heads, rank, 2)
        state.step = LoRAStep.build(np.array(token_slots), 1, CPU)
        columns = rank_columns(rank, num_kv_heads)
        for module, shards in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ["gate", "up"])):
            expected = torch.cat([full[shard][:, columns[shard]] for shard in shards], dim=1)
            torch.testing.assert_close(layers[f"layers.0.{module}"](x), expected)
        for name, module in (("o", "self_attn.o_proj"), ("down", "mlp.down_proj")):
            width = inputs[name].shape[1] // 2
            rank_input = inputs[name][:, rank * width : (rank + 1) * width]
            row_sums[name] = row_sums[name] + layers[f"layers.0.{module}"](rank_input)
    for name, total in row_sums.items():
        torch.testing.assert_close(total, one_rank_output(weights, name, inputs[name], token_slots))


def test_an_int8_ranks_deltas_are_its_cut_of_the_adapter(monkeypatch):
    """Over int8 q/k/v and o shards too: each rank's delta (its output with the adapter less
    its output without) is its slice of x A^T B^T, and the o deltas sum to the whole one."""
    torch.manual_seed(3)
    weights = full_weights(2)
    x, attn_in = torch.randn(4, HIDDEN), torch.randn(4, NUM_HEADS * HEAD_DIM)
    o_delta = 0
    for rank in range(2):
        layers, state = rank_layers(monkeypatch, weights, 2, rank, 2, int8=True)
        qkv, o = layers["layers.0.self_attn.qkv_proj"], layers["layers.0.self_attn.o_proj"]
        rank_input = attn_in[:, rank * 8 : (rank + 1) * 8]
        base_qkv, base_o = qkv(x), o(rank_input)
        state.step = LoRAStep.build(np.zeros(4, dtype=np.int64), 1, CPU)
        columns = rank_columns(rank, 2)
        expected = torch.cat(
            [(x @ weights[s]["lora_a"].T @ weights[s]["lora_b"].T)[:, columns[s]] for s in "qkv"],
            dim=1,
        )
        torch.testing.assert_close(qkv(x) - base_qkv, expected, atol=1e-4, rtol=1e-4)
        o_delta = o_delta + (o(rank_input) - base_o)
    w = weights["o"]
    torch.testing.assert_close(
        o_delta, attn_in @ w["lora_a"].T @ w["lora_b"].T, atol=1e-4, rtol=1e-4
    )
