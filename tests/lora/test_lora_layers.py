"""`LoRAStep` layouts and `add_lora` against a per-token reference: runs of one adapter,
interleaved adapters (batched over evenly used slots, or gathered by group), and base tokens
left alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
