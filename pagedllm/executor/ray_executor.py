"""`RayExecutor`: one Ray actor per rank, on any host of a Ray cluster (backend "ray").

Placement, actor lifecycle and failure detection are Ray's: a placement group with one
bundle per rank (PACK: as few hosts as possible, so a tensor-parallel group tends to share
one), one `RayWorkerWrapper` actor per bundle, rank = bundle index. The world's address is
rank 0's node and a free port there. Start a cluster with `ray start --head` on one host and
`ray start --address=HEAD:6379` on the others, then run pagedllm on the head
(`ray.init()` joins the running cluster; `RAY_ADDRESS` names another).

Every `collective_rpc` is one remote call per actor; replies are gathered in rank order
with `ray.wait`, so an actor that dies (`RayActorError`) or raises (`RayTaskError`) is
reported at once with its rank, and one that does not answer within
`PAGEDLLM_RPC_TIMEOUT_S` raises too. After a failure every actor is killed. Actors are not
detached: Ray ends them when this process goes.
"""

from __future__ import annotations

import os
import time
from typing import Any

from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.executor.multiproc_executor import WorkerError, rpc_timeout_s
from pagedllm.worker.ray_worker import RayWorkerWrapper

PLACEMENT_TIMEOUT_S = 120.0


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
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True)
        resource = "GPU" if str(self.config.device).startswith("cuda") else "CPU"
        bundles = [{resource: 1.0} for _ in range(self.world_size)]
        self._placement_group = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self._placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise RuntimeError(
                f"Ray could not place {self.world_size} bundles of {{{resource!r}: 1}} within "
                f"{PLACEMENT_TIMEOUT_S:g} s; cluster resources: {ray.cluster_resources()}"
            ) from None
        actor_class = ray.remote(RayWorkerWrapper)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._placement_group, placement_group_bundle_index=rank
            )
            amount = {"num_cpus": 1.0} if resource == "CPU" else {"num_gpus": 1.0}
            actor = actor_class.options(scheduling_strategy=strategy, **amount)
            self._actors.append(actor.remote(self.worker_class, self.config, rank))
        master_ip = self._gather([self._actors[0].node_ip.remote()], "node_ip")[0]
        port = self._gather([self._actors[0].free_port.remote()], "free_port")[0]
        init_method = f"tcp://{master_ip}:{port}"
        self._gather([a.init_worker.remote(init_method) for a in self._actors], "init_device")

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel_config.pipeline_parallel_size

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

    def _gather(self, refs: list[Any], method: str) -> list[Any]:
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + self.rpc_timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(remaining, 0))
            if not ready:
                missing = sorted(rank_of[ref] for ref in pending)
                self._fail(
                    f"worker rank(s) {missing} did not answer {method} within "
                    f"{self.rpc_timeout_s:g} s (PAGEDLLM_RPC_TIMEOUT_S)"
                )
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as error:
                    self._fail(f"worker rank {rank} died during {method}: {error}")
                except ray.exceptions.RayTaskError as error:
                    self._fail(f"worker rank {rank} raised in {method}: {error}")
        return [results[rank] for rank in range(len(refs))]

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
