"""Shared-memory all-reduce: bitwise the same result on every rank, equal to the left-to-right
sum in rank order, for tensors smaller and larger than a slot (chunked), fp32 and bf16;
a missing peer raises a TimeoutError naming it; nothing is left in /dev/shm."""

from __future__ import annotations

import os

import pytest
import torch
from tp_harness import run_ranks

from pagedllm.distributed.shm_allreduce import ShmAllReduce

# (shape, dtype): a decode step's 64 x hidden, a shape over several 64 KiB slots with a
# remainder, a bf16 one and a non-contiguous one.
SHAPES = [((64, 576), torch.float32), ((100, 333), torch.float32), ((64, 96), torch.bfloat16)]
SLOT_BYTES = 64 * 1024


def _tensor(rank: int, shape, dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    # Mixed magnitudes, so the order of the adds shows in the low bits.
    scale = torch.logspace(-3, 3, shape[-1])
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def _reduce_on_ranks(rank, world_size, name_holder):
    from pagedllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    shm = ShmAllReduce.create(world_size, slot_bytes=SLOT_BYTES) if rank == 0 else None
    name = [shm.name if shm else None]
    torch.distributed.broadcast_object_list(name, src=0)
    if shm is None:
        shm = ShmAllReduce.attach(name[0], world_size, rank, slot_bytes=SLOT_BYTES)
    group.barrier()
    if rank == 0:
        shm.unlink()
    results = []
    for repeat in range(3):  # the banks alternate; several rounds reuse both
        for seed, (shape, dtype) in enumerate(SHAPES):
            results.append(shm.all_reduce(_tensor(rank, shape, dtype, seed + 10 * repeat)))
        strided = _tensor(rank, (32, 64), torch.float32, 99 + repeat).t()
        results.append(shm.all_reduce(strided))
    shm.close()
    return results, name[0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_gets_the_same_bits_and_the_ordered_sum(world_size):
    per_rank = run_ranks(_reduce_on_ranks, world_size, None)
    outputs = [results for results, _ in per_rank]
    for results in outputs[1:]:
        for got, first in zip(results, outputs[0], strict=True):
            assert got.dtype == first.dtype and torch.equal(got.view(-1), first.view(-1))
    index = 0
    for repeat in range(3):
        for seed, (shape, dtype) in enumerate(SHAPES):
            parts = [_tensor(r, shape, dtype, seed + 10 * repeat) for r in range(world_size)]
            expected = parts[0] + parts[1]
            for part in parts[2:]:
                expected = expected + part
            assert torch.equal(outputs[0][index], expected)
            index += 1
        parts = [_tensor(r, (32, 64), torch.float32, 99 + repeat).t() for r in range(world_size)]
        expected = parts[0] + parts[1]
        for part in parts[2:]:
            expected = expected + part
        assert torch.equal(outputs[0][index], expected)
        index += 1
    name = per_rank[0][1].lstrip("/")
    assert not os.path.exists(f"/dev/shm/{name}")


def test_missing_peer_times_out_naming_it():
    shm = ShmAllReduce.create(2, slot_bytes=4096, timeout_s=0.3)
    try:
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):
            shm.all_reduce(torch.ones(8))
    finally:
        shm.unlink()
        shm.close()


def test_one_rank_is_a_copy():
    shm = ShmAllReduce.create(1, slot_bytes=4096)
    try:
        x = torch.randn(3000)  # three chunks
        assert torch.equal(shm.all_reduce(x.clone()), x)
    finally:
        shm.unlink()
        shm.close()
