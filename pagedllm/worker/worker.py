"""`Worker`: one rank's device, model runner and KV cache, driven by an `Executor`.

An executor calls the same methods on every worker (`collective_rpc`); the engine core
sees only the executor. Start-up runs in this order: `init_device`,
`determine_available_memory`, `initialize_kv_cache`, `load_model`. The pool is a lazily
mapped anonymous mapping, so allocating it costs nothing, and its first pages are faulted
in on idle CPU once the model is loaded (`kv_prefault.py`); `kv_cache_memory` (or its
default from the engine configuration) sizes it, so nothing needs the loaded model to
measure what is left.

With several ranks (the `mp` and `ray` executors) a worker is built with its global `rank`
and the world's `distributed_init_method`; `init_device` then binds the rank's threads to
its cores and joins the tensor- and pipeline-parallel groups before anything is allocated.
Only the output rank (the first tensor-parallel rank of the last pipeline stage) samples
and returns a `ModelRunnerOutput`; the others return None.
"""

from __future__ import annotations

import os

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.model.loader import resolve_model
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.worker.cpu_env import tune_malloc

# How long a collective waits for its peers (a dead or hung rank then raises in the others).
COLLECTIVE_TIMEOUT_ENV = "PAGEDLLM_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        parallel = config.parallel_config
        self.is_output_rank = rank == (parallel.pipeline_parallel_size - 1) * (
            parallel.tensor_parallel_size
        )

    def init_device(self) -> None:
        self.device = torch.device(self.config.device)
        if self.distributed_init_method is not None:
            self._init_distributed()
        if self.device.type == "cpu":
            tune_malloc()
        self.model_runner = ModelRunner(self.config, self.device)

    def _init_distributed(self) -> None:
        # Imported here: the one-rank path never touches torch.distributed.
        from pagedllm.distributed.cpu_binding import (
            apply_cpu_binding,
            host_topology,
            resolve_cpu_binding,
        )
        from pagedllm.distributed.parallel_state import (
            backend_for_device,
            init_distributed_environment,
            initialize_model_parallel,
        )

        parallel = self.config.parallel_config
        assert self.device is not None
        if self.device.type == "cpu":  # before any thread pool starts
            bindings = resolve_cpu_binding(
                parallel.cpu_threads_bind, parallel.world_size, host_topology()
            )
            apply_cpu_binding(None if bindings is None else bindings[self.rank])
        init_distributed_environment(
            parallel.world_size,
            self.rank,
            self.distributed_init_method,
            backend_for_device(self.device),
            timeout_s=float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S)),
            device=self.device,
        )
        initialize_model_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)

    def shutdown(self) -> None:
        """Finish the KV tiers' disk writes and close their links; leave the process groups
        (a worker process's last call)."""
        if self.model_runner is not None and self.model_runner.kv_tiers is not None:
            self.model_runner.kv_tiers.shutdown()
        if self.distributed_init_method is not None:
            from pagedllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()

    def determine_available_memory(self) -> int:
        """Bytes this worker can give the KV cache: the configured `kv_cache_memory`."""
        return self.config.cache_config.kv_cache_memory

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._runner.initialize_kv_cache(num_blocks)

    def load_model(self) -> None:
        self._runner.load_model(resolve_model(self.config.model_config.model))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = self._runner.execute_model(scheduler_output)
        return output if self.is_output_rank else None

    def take_received_kv(self) -> list[tuple[str, tuple[int, ...]]]:
        """KV blocks a producer sent since the last call: (key, token ids)."""
        tiers = self._runner.kv_tiers
        return [] if tiers is None else tiers.take_received()

    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank holds: its weights (each parameter once) and its KV cache."""
        runner = self._runner
        weights = {p.data_ptr(): p.numel() * p.element_size() for p in runner.model.parameters()}
        kv_cache = sum(t.numel() * t.element_size() for pair in runner.kv_cache_pool for t in pair)
        return {
            "rank": self.rank,
            "weight_bytes": sum(weights.values()),
            "kv_cache_bytes": kv_cache,
        }

    @property
    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("Worker.init_device() has not run")
        return self.model_runner
