"""`UniProcExecutor`: one worker in the engine core's own process."""

from __future__ import annotations

from typing import Any

from pagedllm.executor.abstract import Executor
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.config, rank=0)
        self.driver_worker.init_device()

    @property
    def in_process_runner(self) -> ModelRunner | None:
        return self.driver_worker.model_runner

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
