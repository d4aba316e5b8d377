"""`pagedllm bench throughput` and `pagedllm bench latency`: offline runs of the engine."""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import Any

from pagedllm.entrypoints.bench.datasets import BenchRequest
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def _params(output_len: int) -> SamplingParams:
    # As vLLM's benchmarks: sampled (not greedy) and exactly output_len tokens each.
    return SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True)


def run_throughput(llm: LLM, requests: list[BenchRequest], use_tqdm: bool = True) -> dict:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [_params(r.output_len) for r in requests]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - started
    num_input = sum(len(r.prompt_token_ids) for r in requests)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "elapsed_s": round(elapsed, 3),
        "num_requests": len(requests),
        "num_input_tokens": num_input,
        "num_output_tokens": num_output,
        "requests_per_s": round(len(requests) / elapsed, 3),
        "input_tokens_per_s": round(num_input / elapsed, 1),
        "output_tokens_per_s": round(num_output / elapsed, 1),
        "total_tokens_per_s": round((num_input + num_output) / elapsed, 1),
    }


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of a non-empty list."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def run_latency(
    llm: LLM,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters: int,
    num_warmup: int,
    seed: int = 0,
) -> dict:
    """One batch of `batch_size` prompts run start to finish, `num_iters` times.

    The prefix cache is emptied before each run, so every iteration computes its prompts."""
    rng = random.Random(seed)
    vocab_size = llm.llm_engine.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, vocab_size) for _ in range(input_len)]}
        for _ in range(batch_size)
    ]
    params = _params(output_len)

    def once() -> float:
        llm.reset_prefix_cache()
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    for _ in range(num_warmup):
        once()
    latencies = [once() for _ in range(num_iters)]
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "num_iters": num_iters,
        # Microsecond precision: a tiny model's batch takes a few ms, and rounding to
        # 0.1 ms would move the per-token figures derived from it by several percent.
        "latencies_s": [round(x, 6) for x in latencies],
        "mean_s": round(statistics.mean(latencies), 6),
        "percentiles_s": {str(q): round(percentile(latencies, q), 6) for q in LATENCY_PERCENTILES},
        "per_output_token_ms": {
            str(q): round(1000 * percentile(latencies, q) / output_len, 4)
            for q in LATENCY_PERCENTILES
        },
    }


def format_table(title: str, rows: dict[str, Any]) -> str:
    width = max(len(k) for k in rows)
    lines = [f"{'=' * 10} {title} {'=' * 10}"]
    lines += [f"{key:<{width}}  {value}" for key, value in rows.items()]
    return "\n".join(lines)


def write_json(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
