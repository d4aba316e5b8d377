"""The periodic stats log line: throughput since the last line, load, KV usage, cache hits."""

from __future__ import annotations

import logging
import time

from pagedllm.core.messages import EngineCoreOutputs
from pagedllm.spec_decode.metrics import SpecDecodeCounts

logger = logging.getLogger("pagedllm")

LOG_INTERVAL_S = 10.0


class StatLogger:
    """Logs one line every `interval_s` seconds of engine activity (never when idle);
    `engine_index` names the data-parallel core the line is about (None: the only one)."""

    def __init__(self, engine_index: int | None = None, interval_s: float = LOG_INTERVAL_S) -> None:
        self.prefix = "" if engine_index is None else f"Engine {engine_index:03d}: "
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._num_generation_tokens = 0
        self._last_prompt_tokens_total = 0
        self._last_spec_decode: SpecDecodeCounts | None = None

    def record(self, outputs: EngineCoreOutputs) -> None:
        """Count one step's tokens; when the interval has passed, log the step's stats."""
        num_generated_tokens = sum(len(output.new_token_ids) for output in outputs.outputs)
        self._num_generation_tokens += num_generated_tokens
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return
        stats = outputs.stats
        prompt_tokens = stats.num_computed_prompt_tokens - self._last_prompt_tokens_total
        logger.info(
            "%sAvg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%, Preemptions: %d",
            self.prefix,
            prompt_tokens / elapsed,
            self._num_generation_tokens / elapsed,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            100 * stats.kv_cache_usage,
            100 * stats.prefix_cache_hit_rate,
            stats.num_preemptions,
        )
        if stats.spec_decode is not None:
            self._log_spec_decode(stats.spec_decode)
        self._last_time = now
        self._last_prompt_tokens_total = stats.num_computed_prompt_tokens
        self._num_generation_tokens = 0

    def _log_spec_decode(self, counts: SpecDecodeCounts) -> None:
        """vLLM's speculative decoding line, over the interval since the last one."""
        counts, self._last_spec_decode = counts.since(self._last_spec_decode), counts
        if not counts.num_drafts:
            return
        per_position = ", ".join(
            f"{count / counts.num_drafts:.3f}" for count in counts.num_accepted_tokens_per_pos
        )
        logger.info(
            "%sSpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
            "Drafted: %d tokens, Draft acceptance rate: %.1f%%, Per-position acceptance "
            "rate: %s",
            self.prefix,
            counts.mean_acceptance_length,
            counts.num_accepted_tokens,
            counts.num_draft_tokens,
            100 * counts.acceptance_rate,
            per_position,
        )
