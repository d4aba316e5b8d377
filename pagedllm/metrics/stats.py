"""Engine-wide counters for logs and metrics: scheduler load, KV usage, prefix-cache hits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running_reqs: int
    num_waiting_reqs: int
    num_preemptions: int
    # Prompt tokens run through the model; prefix-cache hits are not counted.
    num_computed_prompt_tokens: int
    kv_cache_usage: float  # fraction of usable blocks held by requests
    num_used_blocks: int
    num_cached_blocks: int  # blocks holding reusable prefix KV (held or free)
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # of those, tokens served from the cache

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )
