"""Process groups: one-rank identity groups when nothing is initialized, the TP x PP rank
layout, the collectives' results between spawned gloo ranks, and a timeout instead of a
hang when a peer never arrives."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from tp_harness import run_ranks

from pagedllm.distributed import parallel_state
from pagedllm.distributed.parallel_state import (
    backend_for_device,
    get_pp_group,
    get_tp_group,
    get_world_group,
)


def test_uninitialized_groups_are_identities():
    assert not parallel_state.model_parallel_is_initialized()
    for group in (get_tp_group(), get_pp_group(), get_world_group()):
        assert (group.world_size, group.rank_in_group) == (1, 0)
        assert group.is_first_rank and group.is_last_rank
        x = torch.randn(3, 5)
        assert group.all_reduce(x) is x
        assert group.all_gather(x) is x
        assert group.gather(x) is x
        assert group.broadcast(x) is x
        with pytest.raises(RuntimeError, match="no peer"):
            group.send(x)
        with pytest.raises(RuntimeError, match="no peer"):
            group.recv((3, 5), torch.float32)
    parallel_state.destroy_model_parallel()  # nothing to destroy: no error


def test_backend_follows_the_device():
    assert backend_for_device("cpu") == "gloo"
    assert backend_for_device(torch.device("cuda", 0)) == "nccl"


def _collectives(rank, world_size):
    parallel_state.initialize_model_parallel(2, 2)
    tp, pp = get_tp_group(), get_pp_group()
    x = torch.full((2, 3), float(rank + 1))
    report = {
        "tp_ranks": tp.ranks,
        "pp_ranks": pp.ranks,
        "tp_shm": tp.shm is not None,
        "tp_sum": tp.all_reduce(x.clone()),
        "pp_sum": pp.all_reduce(x.clone()),
        "tp_all_gather": tp.all_gather(x, dim=-1),
        "pp_gather": pp.gather(x, dst=1, dim=0),
    }
    # Pipeline send/recv: stage 0 -> stage 1, same tp_rank.
    if pp.is_first_rank:
        pp.send(torch.arange(6.0).view(2, 3) + 100 * rank)
    else:
        report["received"] = pp.recv((2, 3), torch.float32)
    report["broadcast"] = tp.broadcast(x.clone(), src=1)
    tp.barrier()
    return report


def test_tp2_pp2_layout_and_collectives():
    reports = run_ranks(_collectives, 4)
    for rank, report in enumerate(reports):
        stage, tp_rank = divmod(rank, 2)
        assert report["tp_ranks"] == [2 * stage, 2 * stage + 1]
        assert report["pp_ranks"] == [tp_rank, tp_rank + 2]
        assert report["tp_shm"]  # same host: the TP group all-reduces through shared memory
        tp_peers = report["tp_ranks"]
        assert torch.equal(report["tp_sum"], torch.full((2, 3), float(sum(tp_peers) + 2)))
        assert torch.equal(report["pp_sum"], torch.full((2, 3), float(sum(report["pp_ranks"]) + 2)))
        assert torch.equal(
            report["tp_all_gather"],
            torch.cat([torch.full((2, 3), float(r + 1)) for r in tp_peers], dim=-1),
        )
        if stage == 1:
            expected = torch.cat([torch.full((2, 3), float(r + 1)) for r in report["pp_ranks"]])
            assert torch.equal(report["pp_gather"], expected)
            sender = report["pp_ranks"][0]
            assert torch.equal(report["received"], torch.arange(6.0).view(2, 3) + 100 * sender)
        else:
            assert report["pp_gather"] is None
        assert torch.equal(report["broadcast"], torch.full((2, 3), float(tp_peers[1] + 1)))


def _late_peer(rank, world_size, given_up):
    parallel_state.initialize_model_parallel(2, 1)
    given_up = Path(given_up)
    if rank == 1:
        # Never joins the collective, and stays up (no exit for rank 0 to notice) until rank 0
        # has given up: only rank 0's own timeout can end its wait. If it never does,
        # run_ranks' hang-guard fails the test.
        deadline = time.monotonic() + 600
        while not given_up.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    try:
        get_tp_group().all_reduce(torch.ones(4))
    except Exception as error:  # gloo's or the shared-memory path's timeout
        return type(error).__name__, str(error)[:300]
    finally:
        given_up.touch()
    return None, "no error"


@pytest.mark.parametrize("shm", ["1", "0"])
def test_collective_times_out_instead_of_hanging(shm, tmp_path):
    error, message = run_ranks(
        _late_peer,
        2,
        str(tmp_path / "rank0-gave-up"),
        timeout_s=60,
        collective_timeout_s=3,
        env={"PAGEDLLM_SHM_ALLREDUCE": shm},
    )[0]
    assert error is not None, message
    # Its own timeout ended the wait (rank 1 was still up, so nothing else could).
    if shm == "1":
        assert "rank(s) [1]" in message and "did not arrive within 3 s" in message
    else:
        assert "Timed out" in message  # gloo's
