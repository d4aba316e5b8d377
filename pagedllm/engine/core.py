"""`EngineCore`: the scheduler and the model runner stepping together, with no I/O of its own."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import EngineCoreOutput, Scheduler
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.model.loader import ModelSource
from pagedllm.worker.model_runner import ModelRunner


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.model_runner = ModelRunner(config, source)
        cache_config = config.cache_config
        self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and report the tokens it produced."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)
