"""`RayWorkerWrapper`: the Ray actor that holds one rank's `Worker` (the `ray` executor).

The actor is created before the world's address is known (rank 0's node and a free port
there) and before the executor knows which ranks share a host, so it builds its `Worker`
only in `init_worker`; after that `execute_method` runs any `Worker` method, as the `mp`
executor's worker processes do. Nothing here imports Ray at module level: the executor
wraps this class with `ray.remote`.

CPU threads: Ray, not pagedllm, decides which host each rank runs on, so core lists
computed on the driver's host (`cpu_threads_bind`) mean nothing here. A rank on the CPU
runs its host's cores divided by the ranks Ray placed on that host, unpinned (the other
ranks there, and Ray's own processes, share the same cores).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from typing import Any

from pagedllm.utils import free_port

logger = logging.getLogger("pagedllm")


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """Where Ray put one rank."""

    node_id: str
    node_ip: str
    pid: int


class RayWorkerWrapper:
    def __init__(self, worker_class: str, config: Any, rank: int) -> None:
        self.worker_class, self.config, self.rank = worker_class, config, rank
        self.worker: Any = None

    def placement(self) -> RankPlacement:
        import ray

        return RankPlacement(
            node_id=ray.get_runtime_context().get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
        )

    def free_port(self) -> int:
        return free_port("")  # on this actor's host, where rank 0 hosts the world

    def init_worker(self, distributed_init_method: str, ranks_on_host: int) -> int | None:
        """Build and start this rank's `Worker`; the threads it runs (None off the CPU)."""
        config = self.config
        num_threads = None
        if str(config.device).startswith("cpu"):
            num_threads = _share_host_threads(self.rank, ranks_on_host)
            # The Worker would otherwise pin threads to driver-host core lists.
            parallel = dataclasses.replace(config.parallel_config, cpu_threads_bind="nobind")
            config = dataclasses.replace(config, parallel_config=parallel)
        module_name, _, class_name = self.worker_class.partition(":")
        worker_class = getattr(importlib.import_module(module_name), class_name)
        self.worker = worker_class(
            config, rank=self.rank, distributed_init_method=distributed_init_method
        )
        self.worker.init_device()
        return num_threads

    def execute_method(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def execute_packed(self, method: str, packed: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        """`execute_method` with (args, kwargs) in one object: the executor puts it in the
        object store once for every actor."""
        args, kwargs = packed
        return self.execute_method(method, args, kwargs)


def _share_host_threads(rank: int, ranks_on_host: int) -> int:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    num_threads = max(1, (cores or 1) // max(1, ranks_on_host))
    # Ray sets OMP_NUM_THREADS to the actor's num_cpus (1); torch's own pool size wins.
    torch.set_num_threads(num_threads)
    logger.info(
        "rank %d: %d thread(s), not pinned (%d core(s) on this host, %d rank(s) placed here)",
        rank,
        num_threads,
        cores,
        ranks_on_host,
    )
    return num_threads
