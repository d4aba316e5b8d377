"""`Worker`: one rank's device, model runner and KV cache, driven by an `Executor`.

An executor calls the same methods on every worker (`collective_rpc`); the engine core
sees only the executor. Start-up runs in this order: `init_device`,
`determine_available_memory`, `initialize_kv_cache`, `load_model`. The pool is allocated
before the weights load so its pages fault in on idle CPU while the model loads
(`kv_prefault.py`); a configured `kv_cache_memory` sizes it, so nothing needs the loaded
model to measure what is left.
"""

from __future__ import annotations

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.model.loader import resolve_model
from pagedllm.worker.cpu_env import tune_malloc
from pagedllm.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        self.device = torch.device(self.config.device)
        if self.device.type == "cpu":
            tune_malloc()
        self.model_runner = ModelRunner(self.config, self.device)

    def determine_available_memory(self) -> int:
        """Bytes this worker can give the KV cache: the configured `kv_cache_memory`."""
        return self.config.cache_config.kv_cache_memory

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._runner.initialize_kv_cache(num_blocks)

    def load_model(self) -> None:
        self._runner.load_model(resolve_model(self.config.model_config.model))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._runner.execute_model(scheduler_output)

    @property
    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("Worker.init_device() has not run")
        return self.model_runner
