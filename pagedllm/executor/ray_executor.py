"""`RayExecutor`: one Ray actor per rank, on any host of a Ray cluster (backend "ray").

Placement, actor lifecycle and failure detection are Ray's: a placement group with one
bundle per rank (PACK: as few hosts as possible, so a tensor-parallel group tends to share
one), one `RayWorkerWrapper` actor per bundle, rank = bundle index. The world's address is
rank 0's node and a free port there. Start a cluster with `ray start --head` on one host and
`ray start --address=HEAD:6379` on the others, then run pagedllm on the head
(`ray.init()` joins the running cluster; `RAY_ADDRESS` names another; with no cluster at
all it starts a local one, which `shutdown` stops again).

On the CPU each rank runs its host's cores divided by the ranks placed on that host
(ranks are grouped by node IP), unpinned: `cpu_threads_bind` core lists describe one host
and do not apply to ranks Ray places elsewhere.

Every `collective_rpc` is one remote call per actor; replies are gathered in rank order
with `ray.wait`, so an actor that dies (`RayActorError`) or raises (`RayTaskError`) is
reported at once with its rank, and one that does not answer within
`PAGEDLLM_RPC_TIMEOUT_S` raises too. After a failure every actor is killed and the
placement group removed. Actors are not detached: Ray ends them when this process goes.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import Any

from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.executor.multiproc_executor import WorkerError, rpc_timeout_s
from pagedllm.worker.ray_worker import RankPlacement, RayWorkerWrapper

logger = logging.getLogger("pagedllm")

PLACEMENT_TIMEOUT_S = 120.0
# Starting an actor imports torch; init_device joins the world.
STARTUP_TIMEOUT_S = 300.0
# After one rank fails, how long to look for a peer that died: a killed rank usually
# surfaces first as a failed collective in a live one, and the dead rank is the news.
DEATH_GRACE_S = 2.0


def ranks_sharing_host(placements: list[RankPlacement]) -> list[int]:
    """For each rank, how many ranks (itself included) Ray placed on its host; a host is
    its node IP (two Ray nodes on one machine share its cores)."""
    per_host = Counter(placement.node_ip for placement in placements)
    return [per_host[placement.node_ip] for placement in placements]


class RayFuture:
    """An `execute_model` answered later: the output rank's result."""

    def __init__(self, executor: RayExecutor, refs: list[Any], method: str) -> None:
        self._executor, self._refs, self._method = executor, refs, method

    def result(self) -> Any:
        return self._executor._gather(self._refs, self._method)[self._executor.output_rank]


class RayExecutor(Executor):
    worker_class = "pagedllm.worker.worker:Worker"

    def _init_executor(self) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as error:
            raise ImportError(
                "distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'"
            ) from error
        self._ray = ray
        parallel = self.config.parallel_config
        self.world_size = parallel.world_size
        self.output_rank = (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size
        self.rpc_timeout_s = rpc_timeout_s()
        self._failed: str | None = None
        self._actors: list[Any] = []
        self._placement_group = None
        self.placements: list[RankPlacement] = []
        self.threads_per_rank: list[int | None] = []  # None: not on the CPU
        # A Ray started here (no cluster to join) is ours to stop.
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True)
        try:
            self._start_actors(placement_group, PlacementGroupSchedulingStrategy)
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, placement_group, scheduling_strategy) -> None:
        ray = self._ray
        resource = "GPU" if str(self.config.device).startswith("cuda") else "CPU"
        bundles = [{resource: 1.0} for _ in range(self.world_size)]
        self._placement_group = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self._placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not place {self.world_size} bundles of {{{resource!r}: 1}} within "
                f"{PLACEMENT_TIMEOUT_S:g} s; cluster resources: {ray.cluster_resources()}"
            ) from None
        actor_class = ray.remote(RayWorkerWrapper)
        for rank in range(self.world_size):
            strategy = scheduling_strategy(
                placement_group=self._placement_group, placement_group_bundle_index=rank
            )
            amount = {"num_cpus": 1.0} if resource == "CPU" else {"num_gpus": 1.0}
            actor = actor_class.options(scheduling_strategy=strategy, **amount)
            self._actors.append(actor.remote(self.worker_class, self.config, rank))
        self.placements = self._gather(
            [a.placement.remote() for a in self._actors], "placement", STARTUP_TIMEOUT_S
        )
        port = self._gather([self._actors[0].free_port.remote()], "free_port")[0]
        init_method = f"tcp://{self.placements[0].node_ip}:{port}"
        bind = self.config.parallel_config.cpu_threads_bind
        if resource == "CPU" and bind not in ("auto", "nobind"):
            logger.warning(
                "cpu_threads_bind=%r is ignored with the ray backend: Ray chooses each rank's "
                "host, and a rank runs its host's cores / the ranks placed there, unpinned",
                bind,
            )
        sharing = ranks_sharing_host(self.placements)
        self.threads_per_rank = self._gather(
            [
                actor.init_worker.remote(init_method, sharing[r])
                for r, actor in enumerate(self._actors)
            ],
            "init_device",
            STARTUP_TIMEOUT_S,
        )
        ranks = zip(self.placements, self.threads_per_rank, strict=True)
        for rank, (placement, num_threads) in enumerate(ranks):
            logger.info(
                "ray executor: rank %d on node %s (%s, pid %d)%s",
                rank,
                placement.node_id[:12],
                placement.node_ip,
                placement.pid,
                "" if num_threads is None else f", {num_threads} thread(s)",
            )

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel_config.pipeline_parallel_size

    @property
    def worker_pids(self) -> list[int]:
        return [placement.pid for placement in self.placements]

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return self._gather(self._submit(method, args, kwargs), method)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | RayFuture:
        refs = self._submit("execute_model", (scheduler_output,), None)
        future = RayFuture(self, refs, "execute_model")
        return future if non_block else future.result()

    def _submit(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None):
        if self._failed is not None:
            raise WorkerError(f"the executor's workers are gone: {self._failed}")
        # One put: every actor reads the same object (Ray's broadcast).
        args_ref = self._ray.put((args, kwargs or {}))
        return [actor.execute_packed.remote(method, args_ref) for actor in self._actors]

    def _gather(self, refs: list[Any], method: str, timeout_s: float | None = None) -> list[Any]:
        """Each ref's result, in order; raises (and stops every actor) on a failure."""
        ray = self._ray
        timeout_s = self.rpc_timeout_s if timeout_s is None else timeout_s
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(remaining, 0))
            if not ready:
                missing = sorted(rank_of[ref] for ref in pending)
                self._fail(
                    f"worker rank(s) {missing} did not answer {method} within "
                    f"{timeout_s:g} s (PAGEDLLM_RPC_TIMEOUT_S)"
                )
            for ref in ready:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except ray.exceptions.RayError as error:
                    self._fail(self._describe_failure(rank_of, ref, pending, error, method))
        return [results[rank] for rank in range(len(refs))]

    def _describe_failure(self, rank_of, ref, pending, error, method: str) -> str:
        ray = self._ray
        rank = rank_of[ref]
        if isinstance(error, ray.exceptions.RayActorError):
            return f"worker rank {rank} died during {method}: {error}"
        message = f"worker rank {rank} raised in {method}: {error}"
        if pending:
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
            for other in ready:
                try:
                    ray.get(other)
                except ray.exceptions.RayActorError as death:
                    return f"worker rank {rank_of[other]} died during {method}: {death}\n{message}"
                except ray.exceptions.RayError:
                    pass
        return message

    def _fail(self, message: str) -> None:
        self._failed = message.splitlines()[0]
        self.shutdown()
        raise WorkerError(message)

    def shutdown(self) -> None:
        ray = getattr(self, "_ray", None)
        if ray is None:
            return
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
            self._placement_group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
