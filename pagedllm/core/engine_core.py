"""`EngineCore`: the scheduler and the executor stepping together, with no I/O of its own.

`EngineCoreRequest`s go in (`add_request`), `EngineCoreOutputs` come out (`step`); the
in-process client and the engine-core process both drive this one class.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.messages import EngineCoreOutputs, EngineCoreRequest
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import KVTableCheck, ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.executor.registry import executor_class
from pagedllm.kv_transfer import disk_layout
from pagedllm.kv_transfer.core.tier_manager import KVTierManager
from pagedllm.metrics.stats import EngineStats
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("pagedllm")

# A step with nothing to run (every waiting request's grammar still compiles) sleeps this long.
IDLE_STEP_S = 0.001


def debug_checks_enabled() -> bool:
    """PAGEDLLM_DEBUG=1 checks the KV cache's integrity after every step, the scheduler's and
    every rank's (tests set it)."""
    return os.environ.get("PAGEDLLM_DEBUG", "0") not in ("", "0")


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any = None,
        executor: type[Executor] | None = None,
    ) -> None:
        self.config = config
        executor = executor or executor_class(config.distributed_executor_backend)
        self.model_executor = executor(config)
        try:
            num_blocks = self._initialize_kv_cache()
            self.model_executor.load_model()
        except BaseException:  # worker processes must not outlive a failed start
            self.model_executor.shutdown()
            raise
        cache_config = config.cache_config
        groups = cache_config.kv_groups
        tiers = config.kv_tier_config
        self.kv_tiers = self._kv_tier_manager() if tiers is not None and tiers.enabled else None
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            groups.windows if groups is not None else (None,),
            stable_hashes=self.kv_tiers is not None,
        )
        model_config = config.model_config
        self.structured_output = StructuredOutputManager(
            tokenizer, model_config.vocab_size, sorted(model_config.eos_token_ids)
        )
        scheduler_config = config.scheduler_config
        if config.parallel_config.world_size > 1:
            # The ranks that do not sample learn each step's tokens from the scheduler.
            scheduler_config = dataclasses.replace(
                scheduler_config,
                send_token_ids=True,
                max_batches_in_flight=self._batch_queue_size(),
            )
        self.scheduler = Scheduler(
            scheduler_config,
            self.kv_cache_manager,
            self.structured_output,
            config.speculative_config,
            self.kv_tiers,
        )
        # Pipeline parallel: (reply, scheduler output) of the batches in flight, oldest first.
        self.batch_queue: deque[tuple[Any, SchedulerOutput]] | None = None
        if scheduler_config.max_batches_in_flight > 1:
            self.batch_queue = deque()
        self.debug_checks = debug_checks_enabled()

    def _batch_queue_size(self) -> int:
        """vLLM V1's batch queue: with pp stages, pp batches in flight so the stages overlap
        (the executor must answer `execute_model(..., non_block=True)`)."""
        return self.model_executor.max_concurrent_batches

    def _kv_tier_manager(self) -> KVTierManager:
        """The scheduler's side of the KV tiers; the disk tier's index is its folder's."""
        tiers = self.config.kv_tier_config
        assert tiers is not None
        groups = self.config.cache_config.kv_groups
        disk_keys: set[str] = set()
        if tiers.disk_dir is not None:
            disk_keys = disk_layout.scan_all_ranks(
                tiers.disk_dir, tiers.identity, self.config.parallel_config.world_size
            )
            logger.info("KV disk tier: %d blocks on disk", len(disk_keys))
        return KVTierManager(
            tiers,
            self.config.cache_config.block_size,
            groups.num_groups if groups is not None else 1,
            disk_keys,
        )

    def _initialize_kv_cache(self) -> int:
        """Size the pool from what every worker can give it; the pool is built before the
        weights load (see worker.py). Returns the number of blocks."""
        cache_config = self.config.cache_config
        available = self.model_executor.determine_available_memory()
        if available < cache_config.kv_cache_memory:
            raise ValueError(
                f"kv_cache_memory={cache_config.kv_cache_memory} bytes, but the workers can "
                f"give the KV cache only {available} bytes; lower kv_cache_memory"
            )
        self.model_executor.initialize_kv_cache(cache_config.num_blocks)
        return cache_config.num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model once, and report the tokens it produced.

        Fault isolation: a request whose own stage raises (its logits processors, grammar,
        parallel-sample fork) is ended alone with finish_reason "error" and its blocks freed
        (the runner and the scheduler find it), and the rest of the batch samples what it
        would have. Any error not attributable to one request raises out of here and ends
        the core (the engine-core process exits non-zero)."""
        if self.batch_queue is not None:
            return self._step_with_batch_queue(self.batch_queue)
        scheduler_output = self._schedule()
        if not scheduler_output.num_scheduled_tokens:
            time.sleep(IDLE_STEP_S)  # only grammars compiling: do not spin
        runner_output = self.model_executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.debug_checks:
            self.check_integrity()
        return EngineCoreOutputs(outputs, self.get_stats())

    def _step_with_batch_queue(
        self, queue: deque[tuple[Any, SchedulerOutput]]
    ) -> EngineCoreOutputs:
        """Pipeline parallel: schedule a new batch while the queue has room (its requests are
        not in flight); when none was scheduled, or the queue is full, wait for the oldest
        batch and report its tokens. A step that only scheduled reports nothing."""
        if len(queue) < self.config.scheduler_config.max_batches_in_flight:
            scheduler_output = self._schedule()
            # An output with no tokens still tells the runners which requests ended.
            if scheduler_output.num_scheduled_tokens or scheduler_output.finished_req_ids:
                reply = self.model_executor.execute_model(scheduler_output, non_block=True)
                queue.append((reply, scheduler_output))
                return EngineCoreOutputs([], self.get_stats())
        if queue:
            reply, scheduler_output = queue.popleft()
            runner_output = reply.result()
        else:  # only grammars compiling: report what the scheduler decided, do not spin
            time.sleep(IDLE_STEP_S)
            scheduler_output, runner_output = SchedulerOutput(), ModelRunnerOutput()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.debug_checks:
            self.check_integrity()
        return EngineCoreOutputs(outputs, self.get_stats())

    def _schedule(self) -> SchedulerOutput:
        if self.kv_tiers is not None and self.kv_tiers.receives:  # before the scheduling
            (received,) = self.model_executor.collective_rpc("take_received_kv")
            self.kv_tiers.on_received(received)
        scheduler_output = self.scheduler.schedule()
        if self.debug_checks:
            scheduler_output.kv_check = self._kv_table_check()
        return scheduler_output

    def _kv_table_check(self) -> KVTableCheck:
        """Every rank's KV integrity, checked in the step itself: the runners compare their
        tables with these once they have applied the step's updates (before the forward, so
        a wrong table is caught before it writes anywhere). It rides on the step's own
        message, so no rank waits for an extra round trip and pipelined batches still
        overlap. Every running request has been sent to the runners by the time
        `schedule()` returns (forked samples with their parent's batch), so its table is
        the one they must hold; preempted and finished requests are not running."""
        kv = self.kv_cache_manager
        return KVTableCheck(
            num_blocks=kv.block_pool.num_blocks,
            null_block_id=kv.block_pool.null_block.block_id,
            block_tables={
                request.request_id: kv.get_block_ids(request.request_id)
                for request in self.scheduler.running
            },
        )

    def check_integrity(self) -> None:
        """Every block is free, held or cached-free, ref counts match; and when idle, all free.
        (Every rank's own tables are checked within the step: `_kv_table_check`.)"""
        kv = self.kv_cache_manager
        kv.check_integrity()
        if self.kv_tiers is not None:
            self.kv_tiers.check_integrity()
        if not self.has_unfinished_requests():
            assert kv.num_free_blocks == kv.block_pool.num_usable_blocks, "idle engine holds blocks"

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes; refused (False) while any request is unfinished."""
        if self.has_unfinished_requests() or not self.kv_cache_manager.reset_prefix_cache():
            logger.warning("reset_prefix_cache refused: requests are still running")
            return False
        if self.kv_tiers is not None:
            self.kv_tiers.reset()
        return True

    def get_stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.kv_cache_manager
        pool = kv.block_pool
        return EngineStats(
            num_running_reqs=len(scheduler.running),
            num_waiting_reqs=len(scheduler.waiting),
            num_preemptions=scheduler.num_preemptions,
            num_computed_prompt_tokens=scheduler.num_computed_prompt_tokens,
            kv_cache_usage=pool.usage,
            num_used_blocks=pool.num_usable_blocks - pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            spec_decode=scheduler.drafts.stats.snapshot(),
            running_lora_adapters=scheduler.lora.counts(scheduler.running),
            waiting_lora_adapters=scheduler.lora.counts(scheduler.waiting),
            max_loras=scheduler.config.max_loras,
            kv_tiers=self.kv_tiers.stats.snapshot() if self.kv_tiers is not None else None,
        )

    def shutdown(self) -> None:
        self.model_executor.shutdown()
