"""The `ray` executor on a real two-node Ray cluster (both nodes on this machine, started
and stopped here): TP=2 with one rank on each node gives one rank's greedy tokens under
chunked prefill and preemption, and a rank actor killed mid-generation makes the offline
API raise naming the death (not at an RPC timeout) and leaves no actor, placement group or
Ray process behind."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import ray  # the `ray` extra, which `make` installs
from parallel_greedy import assert_greedy_equals_one_rank, budget_llm, kill_rank_mid_generation

from pagedllm.executor.multiproc_executor import WorkerError
from pagedllm.executor.ray_executor import ranks_sharing_host
from pagedllm.worker.ray_worker import RankPlacement

# A cluster takes ~10 s to start, each engine ~15 s: the whole module stays well under this.
pytestmark = pytest.mark.timeout(240)
STOP_TIMEOUT_S = 20.0


def _ray_processes() -> list[psutil.Process]:
    """This test process's descendants that belong to Ray (GCS, raylets, workers, agents)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            command = " ".join(process.cmdline())
        except psutil.Error:  # it ended meanwhile
            continue
        if "ray" in process.name() or "/ray/" in command or command.startswith("ray::"):
            found.append(process)
    return found


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes of one CPU each, so a placement group of two CPU bundles spans both.
    Ray chooses the node IP itself: forcing 127.0.0.1 makes it advertise another address
    that the driver then cannot reach."""
    from ray.cluster_utils import Cluster

    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
        )
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        processes = _ray_processes()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        _, alive = psutil.wait_procs(processes, timeout=STOP_TIMEOUT_S)
        for process in alive:  # stopped all the same, then reported
            process.kill()
        assert not alive, f"Ray processes left behind: {alive}"


@pytest.fixture(scope="module")
def ray_llm(ray_cluster, tiny_llama):
    llm = budget_llm(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_tp2_on_two_ray_nodes_equals_one_rank(ray_llm, tiny_llama, report_ties):
    executor = ray_llm.llm_engine.engine_core.model_executor
    nodes = [placement.node_id for placement in executor.placements]
    assert len(set(nodes)) == 2, f"both ranks on one Ray node: {nodes}"
    # Both nodes are this host: the ranks share its cores, unpinned.
    cores = os.sched_getaffinity(0)
    assert executor.threads_per_rank == [max(1, len(cores) // 2)] * 2
    for pid in executor.worker_pids:
        assert set(psutil.Process(pid).cpu_affinity()) == cores
    assert_greedy_equals_one_rank(ray_llm, tiny_llama, report_ties)


def test_a_killed_rank_actor_raises_and_leaves_no_actor(ray_llm):
    engine = ray_llm.llm_engine
    executor = engine.engine_core.model_executor
    actors, pids = list(executor._actors), executor.worker_pids
    group = executor._placement_group
    died = r"worker rank 1 died during execute_model"
    kill_rank_mid_generation(engine, pids[1], died)
    with pytest.raises(WorkerError, match="the executor's workers are gone"):
        executor.collective_rpc("determine_available_memory")
    # Every actor is dead in Ray's view, its process gone, and the placement group removed.
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_ready__.remote(), timeout=STOP_TIMEOUT_S)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if psutil.pid_exists(pid)]
    assert not left, f"rank processes left behind: {left}"
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"


def test_ranks_share_threads_by_host_ip():
    # Ray nodes on one machine share its IP and cores; other hosts count on their own.
    ips = ["10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.1"]
    placements = [RankPlacement(f"node{i}", ip, 100 + i) for i, ip in enumerate(ips)]
    assert ranks_sharing_host(placements) == [3, 1, 3, 3]
