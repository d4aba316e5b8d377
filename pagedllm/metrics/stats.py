"""Engine-wide counters for logs and metrics: scheduler load, KV usage, prefix-cache hits
(one core's, or the sum over data-parallel cores)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.spec_decode.metrics import SpecDecodeCounts


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
    # Speculative decoding's totals (None: the engine does not speculate).
    spec_decode: SpecDecodeCounts | None = None
    # LoRA (enable_lora): adapter name -> its running / waiting requests (None: LoRA off).
    running_lora_adapters: dict[str, int] | None = None
    waiting_lora_adapters: dict[str, int] | None = None
    max_loras: int | None = None
    # KV tiers' counters since start-up (`KVTierStats`; None: no tier).
    kv_tiers: dict[str, float] | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


def sum_engine_stats(stats: list[EngineStats]) -> EngineStats:
    """The engine-wide view of several data-parallel cores: counts and counters add up; KV
    usage is the mean (every core's pool has the same size, from the same arguments)."""
    if len(stats) == 1:
        return stats[0]
    return EngineStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_computed_prompt_tokens=sum(s.num_computed_prompt_tokens for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        num_used_blocks=sum(s.num_used_blocks for s in stats),
        num_cached_blocks=sum(s.num_cached_blocks for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        spec_decode=SpecDecodeCounts.sum([s.spec_decode for s in stats]),
        running_lora_adapters=_sum_counts([s.running_lora_adapters for s in stats]),
        waiting_lora_adapters=_sum_counts([s.waiting_lora_adapters for s in stats]),
        max_loras=stats[0].max_loras,
        kv_tiers=_sum_counts([s.kv_tiers for s in stats]),
    )


def _sum_counts(counts: list[dict[str, float] | None]) -> dict[str, float] | None:
    if counts[0] is None:
        return None
    total: dict[str, float] = {}
    for one in counts:
        for name, count in (one or {}).items():
            total[name] = total.get(name, 0) + count
    return total
