"""How the model is split over ranks: `ParallelConfig` and the layout checks against a model.

Names and semantics follow vLLM: `tensor_parallel_size` ranks split every layer (heads,
MLP columns, vocabulary), `pipeline_parallel_size` stages split the layers, and
`data_parallel_size` engine cores each hold a whole copy. One engine core drives
`world_size = tp * pp` workers through its executor (`distributed_executor_backend`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

# How the engine core runs its workers (`pagedllm.executor.registry` maps each name to its
# executor): "uni" is one worker in the core's own process, "mp" one process per rank on
# this host, "ray" Ray actors placed on any host of a Ray cluster.
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    # OpenMP thread binding per rank on the CPU: "auto" (one rank per NUMA node when there are
    # several, else the host's cores split evenly), "nobind", or explicit core lists, one per
    # rank: "0-7|8-15" (vLLM's VLLM_CPU_OMP_THREADS_BIND).
    cpu_threads_bind: str = "auto"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {list(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size"
                f" * pipeline_parallel_size = {self.world_size}; use 'mp' (one host) or 'ray'"
            )
        if self.cpu_threads_bind not in ("auto", "nobind"):
            ranks = parse_cpu_threads_bind(self.cpu_threads_bind)
            if len(ranks) != self.world_size:
                raise ValueError(
                    f"cpu_threads_bind lists {len(ranks)} core set(s) for {self.world_size} "
                    f"rank(s): give one per rank, separated by '|'"
                )

    @property
    def world_size(self) -> int:
        """Workers one engine core drives (data-parallel cores each drive their own)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def default_executor_backend(world_size: int) -> str:
    """vLLM's default: one worker in process, several as processes on this host."""
    return "uni" if world_size == 1 else "mp"


def parse_cpu_threads_bind(value: str) -> list[list[int]]:
    """`"0-3,8|4-7"` -> [[0, 1, 2, 3, 8], [4, 5, 6, 7]]: one core list per rank."""
    ranks = []
    for rank_spec in value.split("|"):
        cores: list[int] = []
        for part in rank_spec.split(","):
            bounds = part.strip().split("-")
            if not part.strip() or len(bounds) > 2 or not all(b.isdigit() for b in bounds):
                raise ValueError(
                    f"cpu_threads_bind: cannot parse {value!r}; use core lists such as "
                    "'0-7|8-15' (one per rank), 'auto' or 'nobind'"
                )
            low, high = int(bounds[0]), int(bounds[-1])
            if high < low:
                raise ValueError(f"cpu_threads_bind: empty core range {part.strip()!r}")
            cores.extend(range(low, high + 1))
        if len(set(cores)) != len(cores):
            raise ValueError(f"cpu_threads_bind: a core is listed twice in {rank_spec!r}")
        ranks.append(cores)
    return ranks


def _valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    return [
        tp
        for tp in range(1, num_heads + 1)
        if num_heads % tp == 0
        and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0)
        and intermediate_size % tp == 0
    ]


def verify_parallel_layout(hf_config: Any, parallel_config: ParallelConfig) -> None:
    """Refuse, at start-up, a layout the model does not divide into (naming what works)."""
    tp, pp = parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    intermediate_size = hf_config.intermediate_size
    valid = _valid_tp_sizes(num_heads, num_kv_heads, intermediate_size)
    if tp not in valid:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide this model: it has {num_heads} "
            f"attention heads, {num_kv_heads} KV heads and intermediate_size "
            f"{intermediate_size}; tensor_parallel_size must divide the attention heads and "
            f"the intermediate size, and divide or be a multiple of the KV heads. "
            f"Sizes that work: {', '.join(map(str, valid))}"
        )
    moe_intermediate_size = getattr(hf_config, "moe_intermediate_size", None)
    if moe_intermediate_size and moe_intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide this model's experts: "
            f"moe_intermediate_size {moe_intermediate_size} must divide by it"
        )
    num_layers = hf_config.num_hidden_layers
    if pp > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} is more stages than the model's {num_layers} layers"
        )


def verify_cpu_binding(parallel_config: ParallelConfig) -> None:
    """Explicit core lists must name cores this process may run on."""
    if parallel_config.cpu_threads_bind in ("auto", "nobind"):
        return
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if allowed is None:
        return
    for rank, cores in enumerate(parse_cpu_threads_bind(parallel_config.cpu_threads_bind)):
        missing = sorted(set(cores) - allowed)
        if missing:
            raise ValueError(
                f"cpu_threads_bind: rank {rank} names core(s) {missing} this host does not "
                f"offer (available: {_ranges(sorted(allowed))})"
            )


def _ranges(cores: list[int]) -> str:
    spans, start = [], None
    for i, core in enumerate(cores):
        start = core if start is None else start
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            spans.append(f"{start}-{core}" if core != start else str(core))
            start = None
    return ",".join(spans)


def pipeline_stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The layers stage `pp_rank` runs: contiguous, the first stages one larger when uneven."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 64) -> int:
    """Vocabulary padded so each tensor-parallel rank holds an equal, aligned shard."""
    step = multiple * tp_size
    return math.ceil(vocab_size / step) * step


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one tensor-parallel rank holds: a share, or one replicated head when
    there are more ranks than KV heads."""
    return max(1, num_kv_heads // tp_size)
