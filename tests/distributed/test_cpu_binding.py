"""cpu_threads_bind resolution on fake topologies (pure), sysfs parsing, and applying a
binding in a child process."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os

import pytest
from process_guard import die_with_parent

from pagedllm.distributed.cpu_binding import (
    HostTopology,
    RankBinding,
    apply_cpu_binding,
    read_numa_nodes,
    resolve_cpu_binding,
)

ONE_NODE_8 = HostTopology(allowed=tuple(range(8)))
TWO_NODES = HostTopology(
    allowed=tuple(range(16)), numa_nodes=(tuple(range(8)), tuple(range(8, 16)))
)


def cores(bindings):
    return [list(b.cores) for b in bindings]


def test_nobind_is_none():
    assert resolve_cpu_binding("nobind", 4, ONE_NODE_8) is None


def test_explicit_lists_one_thread_per_core():
    bindings = resolve_cpu_binding("0-3|4,6", 2, ONE_NODE_8)
    assert bindings == [RankBinding((0, 1, 2, 3), 4), RankBinding((4, 6), 2)]
    with pytest.raises(ValueError, match="2 core set"):
        resolve_cpu_binding("0-3|4-7", 3, ONE_NODE_8)


def test_auto_one_node_splits_allowed_cores_evenly():
    assert cores(resolve_cpu_binding("auto", 2, ONE_NODE_8)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cores(resolve_cpu_binding("auto", 3, ONE_NODE_8)) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # Only the cores this process may use (a cgroup or taskset), in order.
    limited = HostTopology(allowed=(2, 3, 5, 9))
    assert resolve_cpu_binding("auto", 2, limited) == [
        RankBinding((2, 3), 2),
        RankBinding((5, 9), 2),
    ]


def test_auto_more_ranks_than_cores_share_with_one_thread_and_warn(caplog):
    logger = logging.getLogger("pagedllm")  # does not propagate to the root logger
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm"):
            bindings = resolve_cpu_binding("auto", 3, HostTopology(allowed=(0, 1)))
    finally:
        logger.removeHandler(caplog.handler)
    assert bindings == [RankBinding((0,), 1), RankBinding((1,), 1), RankBinding((0,), 1)]
    assert "share cores" in caplog.text


def test_auto_one_rank_per_numa_node():
    assert cores(resolve_cpu_binding("auto", 2, TWO_NODES)) == [
        list(range(8)),
        list(range(8, 16)),
    ]
    # Fewer ranks than nodes: the first nodes.
    assert cores(resolve_cpu_binding("auto", 1, TWO_NODES)) == [list(range(8))]
    # More: each node's cores split between the ranks it gets.
    assert cores(resolve_cpu_binding("auto", 4, TWO_NODES)) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]


def test_auto_numa_nodes_restricted_to_allowed_cores():
    topology = HostTopology(allowed=(0, 1, 8, 9), numa_nodes=TWO_NODES.numa_nodes)
    assert cores(resolve_cpu_binding("auto", 2, topology)) == [[0, 1], [8, 9]]
    # Allowed cores on one node only: treated as one node.
    topology = HostTopology(allowed=(0, 1, 2, 3), numa_nodes=TWO_NODES.numa_nodes)
    assert cores(resolve_cpu_binding("auto", 2, topology)) == [[0, 1], [2, 3]]


def test_read_numa_nodes_from_sysfs(tmp_path):
    for node, text in ((0, "0-3,8-11\n"), (1, "4-7,12-15\n"), (2, "\n")):  # node 2: memory only
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(text)
    (tmp_path / "node10").mkdir()
    (tmp_path / "node10" / "cpulist").write_text("16\n")
    assert read_numa_nodes(str(tmp_path)) == (
        (0, 1, 2, 3, 8, 9, 10, 11),
        (4, 5, 6, 7, 12, 13, 14, 15),
        (16,),
    )
    assert read_numa_nodes(str(tmp_path / "missing")) == ()


def _apply_and_report(core: int, result, parent: int) -> None:
    import torch

    die_with_parent(parent)
    apply_cpu_binding(RankBinding((core,), 1))
    threads = [int(t) for t in os.listdir("/proc/self/task")]
    result.put(
        (
            sorted(os.sched_getaffinity(0)),
            torch.get_num_threads(),
            all(os.sched_getaffinity(t) == {core} for t in threads),
        )
    )


def test_apply_pins_every_thread_and_sets_torch_threads():
    core = min(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    proc = ctx.Process(target=_apply_and_report, args=(core, result, os.getpid()), daemon=True)
    proc.start()
    try:
        affinity, threads, all_threads = result.get(timeout=60)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert affinity == [core]
    assert threads == 1
    assert all_threads
