"""Where one engine step's time goes, at the shapes the CPU performance targets name.

Runs the default model (`--dtype`, fp32 by default) on `--batch` random prompts of
`--input-len` tokens with `--max-num-batched-tokens` (2048) per step, so the prompts are
prefilled in 2,048-token chunks and then `--batch` sequences decode together. For each kind
of step (full prefill chunk; decode with every sequence running) it reports the median
step time split into scheduling, model forward, logits, sampling and the rest (output
handling), the model FLOP/s against this machine's matmul ceiling (in the model's dtype) at
the same number of rows, and the engine overhead (everything but forward and logits) as a
share of the step.

    .venv/bin/python -m benchmarks.step_breakdown [--batch 256] [--decode-steps 16]
        [--profile decode_profile.txt] [--output-json out.json]

`--profile FILE` records one decode step with torch.profiler and writes its op table;
`--profile-prefill FILE` does the same for the second step (a 2,048-token chunk of prompt
tokens beside the few decodes of the first chunk's prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.ceiling import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    LAYERS,
    NON_EMBEDDING_PARAMS,
    VOCAB,
    matmul_gflops,
)
from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench.datasets import DatasetConfig, random_dataset
from pagedllm.runner.huge_pages import madvise
from pagedllm.runner.kv_prefault import MADV_POPULATE_WRITE
from pagedllm.runner.model_runner import ForwardStep
from pagedllm.utils import round_up

PHASES = ("schedule", "forward", "logits", "sample", "update")


class StepTimer:
    """Wraps the engine's parts so every step records how long each took (seconds)."""

    def __init__(self, llm: LLM) -> None:
        core = llm.llm_engine.engine_core
        runner = llm.model_runner
        self.current: dict[str, float] = defaultdict(float)
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.scheduler, "update_from_output", "update")
        runner.add_forward_observer(self._count_forward)
        self._wrap(runner.model, "compute_logits", "logits")
        self._wrap(runner, "sampler", "sample")

    def _count_forward(self, step: ForwardStep) -> None:
        self.current["forward"] += step.seconds

    def _wrap(self, owner, attribute: str, phase: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - started

        setattr(owner, attribute, timed)

    def take(self) -> dict[str, float]:
        taken, self.current = dict(self.current), defaultdict(float)
        return taken


def step_flops(num_tokens: int, context_sum: int, num_sampled: int) -> float:
    """Model FLOPs of one step: linear layers, attention (q.k and p.v) and the logits."""
    return (
        2 * NON_EMBEDDING_PARAMS * num_tokens
        + 4 * LAYERS * HEADS * HEAD_DIM * context_sum
        + 2 * HIDDEN * VOCAB * num_sampled
    )


def ceilings(args: argparse.Namespace) -> dict[int, float]:
    """The matmul ceiling at each step kind's row count."""
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    return {rows: matmul_gflops(rows, dtype) for rows in (args.max_num_batched_tokens, args.batch)}


def run(args: argparse.Namespace) -> dict:
    # The ceiling is measured before and after the engine runs and the higher figure kept:
    # on a shared machine one measurement can come out 10-20% low.
    ceiling_before = ceilings(args)
    llm = LLM(
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        disable_log_stats=True,
        quantization=args.quantization,
        compile=args.compile,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
    )
    if args.populate_kv_cache:
        populate_kv_cache(llm)
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    config = DatasetConfig(
        name="random", num_prompts=args.batch, input_len=args.input_len, output_len=10**6
    )
    requests = random_dataset(config, engine.model_config.vocab_size, tokenizer)
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.input_len + args.decode_steps + 8,
        ignore_eos=True,
    )
    for i, request in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": request.prompt_token_ids}, params)
    timer = StepTimer(llm)
    steps: dict[str, list[dict]] = {"prefill": [], "decode": []}
    scheduler = engine.engine_core.scheduler
    profile_done = args.profile is None
    step_index = 0
    while len(steps["decode"]) < args.decode_steps:
        step_index += 1
        before = {r.request_id: r.num_computed_tokens for r in scheduler.running}
        started = time.perf_counter()
        if not profile_done and len(steps["decode"]) == args.decode_steps // 2:
            profile_step(engine, args.profile)
            profile_done = True
            timer.take()
            continue
        if args.profile_prefill and step_index == 2:
            profile_step(engine, args.profile_prefill)
            timer.take()
            continue
        engine.step()
        total = time.perf_counter() - started
        phases = timer.take()
        kind, shape = classify(scheduler, before, args)
        if kind is not None:
            steps[kind].append({"total": total, **phases, **shape})
    ceiling_after = ceilings(args)
    best = {rows: max(ceiling_before[rows], ceiling_after[rows]) for rows in ceiling_before}
    return summarize(steps, args, best)


def populate_kv_cache(llm: LLM) -> None:
    """Fault every page of the KV pool in (MADV_POPULATE_WRITE, Linux 5.14+; the contents are
    left alone), as in a server that has used its whole pool once. On a fresh pool the first
    write to each block's pages happens inside a step, and on this VM that first touch of
    guest memory costs ~1-2 s per GB (docs/performance.md)."""
    page = os.sysconf("SC_PAGE_SIZE")
    started = time.perf_counter()
    total = 0
    for cache in llm.model_runner.kv_caches:
        for tensor in cache:
            begin = round_up(tensor.data_ptr(), page)
            end = (tensor.data_ptr() + tensor.nbytes) // page * page
            error = madvise(begin, end - begin, MADV_POPULATE_WRITE)
            if error:
                raise OSError(error, "madvise(MADV_POPULATE_WRITE) failed")
            total += end - begin
    seconds = time.perf_counter() - started
    print(f"KV pool populated: {total / 1e9:.2f} GB in {seconds:.1f} s")


def classify(scheduler, before: dict[str, int], args) -> tuple[str | None, dict]:
    """A step is "prefill" if it ran a full budget of which at least 90% were prompt tokens
    (after the first chunk, every step carries the decodes of the prompts already done),
    "decode" if every one of `--batch` sequences ran one token; other steps are left out."""
    tokens, prompt_tokens, context_sum, sampled = 0, 0, 0, 0
    for request in scheduler.running:
        start = before.get(request.request_id, 0)
        count = request.num_computed_tokens - start
        tokens += count
        prompt_tokens += max(0, min(request.num_computed_tokens, request.num_prompt_tokens) - start)
        # Token at position p attends to p + 1 keys.
        context_sum += sum(range(start + 1, start + count + 1))
        sampled += int(request.num_computed_tokens >= request.num_prompt_tokens)
    shape = {"tokens": tokens, "context_sum": context_sum, "sampled": sampled}
    all_decoding = len(before) == args.batch and all(
        count >= args.input_len for count in before.values()
    )
    if all_decoding and tokens == args.batch:
        return "decode", shape
    if tokens == args.max_num_batched_tokens and prompt_tokens >= 0.9 * tokens:
        return "prefill", shape
    return None, shape


def summarize(steps: dict[str, list[dict]], args, ceiling_by_rows: dict[int, float]) -> dict:
    report: dict = {
        "batch": args.batch,
        "input_len": args.input_len,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "populated_kv_cache": args.populate_kv_cache,
    }
    for kind, rows in (("prefill", args.max_num_batched_tokens), ("decode", args.batch)):
        records = steps[kind]
        if not records:
            continue
        median = {key: statistics.median(r[key] for r in records) for key in ("total", *PHASES)}
        flops = statistics.median(
            step_flops(r["tokens"], r["context_sum"], r["sampled"]) for r in records
        )
        ceiling = ceiling_by_rows[rows]
        model_s = median["forward"] + median["logits"]
        report[kind] = {
            "steps": len(records),
            "ms": {key: round(1000 * value, 2) for key, value in median.items()},
            "tokens_per_s": round(records[0]["tokens"] / median["total"], 1),
            "gflops_step": round(flops / median["total"] / 1e9, 1),
            "gflops_model": round(flops / model_s / 1e9, 1),
            "ceiling_gflops": round(ceiling, 1),
            "fraction_of_ceiling": round(flops / median["total"] / 1e9 / ceiling, 3),
            "overhead_fraction": round(1 - model_s / median["total"], 3),
        }
    return report


def profile_step(engine, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    Path(path).write_text(table)
    print(table)


def print_report(report: dict) -> None:
    print(
        f"batch {report['batch']}, {report['input_len']}-token prompts, {report['threads']} threads"
    )
    print(
        "| step | ms | schedule | forward | logits | sample | update | tok/s | model GFLOP/s "
        "| ceiling | fraction | overhead |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in ("prefill", "decode"):
        if kind not in report:
            continue
        r = report[kind]
        ms = r["ms"]
        print(
            f"| {kind} | {ms['total']} | {ms['schedule']} | {ms['forward']} | {ms['logits']} "
            f"| {ms['sample']} | {ms['update']} | {r['tokens_per_s']} | {r['gflops_step']} "
            f"| {r['ceiling_gflops']} | {100 * r['fraction_of_ceiling']:.0f}% "
            f"| {100 * r['overhead_fraction']:.1f}% |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--profile-prefill", default=None)
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--quantization",
        default=None,
        help="int8 or gguf (model FLOP/s are then fp32-equivalent, against the fp32 ceiling)",
    )
    parser.add_argument("--compile", action="store_true", help="decode steps through torch.compile")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, float16 or bfloat16")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="the model's dtype, float32 or bfloat16 (the ceiling is measured in the same)",
    )
    parser.add_argument(
        "--populate-kv-cache",
        action="store_true",
        help="fault the KV pool's pages in before the steps (the steady state of a server "
        "that has used its pool once) instead of in the steps that first write them",
    )
    args = parser.parse_args()
    report = run(args)
    print_report(report)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
