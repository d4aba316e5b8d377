"""`Executor`: the engine core's one handle on its workers, whatever runs them.

Every call goes through `collective_rpc`, which runs a `Worker` method on every worker
and returns their results in rank order; the rest of the interface is built on it. The
output rank (the first tensor-parallel rank of the last pipeline stage; rank 0 of one) is
the one that samples, so `execute_model` returns its output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagedllm.runner.model_runner import ModelRunner


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and run `Worker.init_device` on each."""

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run `Worker.<method>(*args, **kwargs)` on every worker; results in rank order."""

    def determine_available_memory(self) -> int:
        """Bytes every worker can give the KV cache (the smallest worker's figure)."""
        return min(self.collective_rpc("determine_available_memory"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def load_model(self) -> None:
        self.collective_rpc("load_model")

    @property
    def in_process_runner(self) -> ModelRunner | None:
        """The output rank's model runner when it runs in this process, else None."""
        return None

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine core may keep in flight: above 1 (pipeline parallel), the
        executor's `execute_model(output, non_block=True)` returns a future (`.result()`)."""
        return 1

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def shutdown(self) -> None:  # noqa: B027 - executors that start processes override it
        """Release the workers (the in-process executor has nothing to stop)."""
