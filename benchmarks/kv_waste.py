"""KV memory waste on a workload: slots allocated to requests but holding no token, at peak.

Steps the engine through W1 (64 random prompts x 256 tokens, 128 output tokens, EOS
ignored) by default and, after every step, counts the blocks the pool has handed out
(x block_size = slots allocated) and the tokens whose K/V sit in them (each request's
computed tokens). Waste at the step with the most blocks in use is the figure reported:
that is when memory decides how many requests fit.

    .venv/bin/python -m benchmarks.kv_waste [--num-prompts 64] [--input-len 256]
        [--output-len 128] [--block-size 16] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench.datasets import DatasetConfig, random_dataset


def measure(args: argparse.Namespace) -> dict:
    llm = LLM(block_size=args.block_size, max_num_seqs=args.num_prompts, disable_log_stats=True)
    engine = llm.llm_engine
    config = DatasetConfig(
        name="random",
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
    )
    requests = random_dataset(config, engine.model_config.vocab_size, llm.get_tokenizer())
    for i, request in enumerate(requests):
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=1.0)
        engine.add_request(str(i), {"prompt_token_ids": request.prompt_token_ids}, params)
    core = engine.engine_core
    pool = core.kv_cache_manager.block_pool
    peak = {"blocks": -1}
    while engine.has_unfinished_requests():
        engine.step()
        blocks = pool.num_usable_blocks - pool.num_free_blocks
        if blocks > peak["blocks"]:
            tokens = sum(r.num_computed_tokens for r in core.scheduler.running)
            peak = {"blocks": blocks, "tokens": tokens, "running": len(core.scheduler.running)}
    slots = peak["blocks"] * args.block_size
    return {
        "workload": f"{args.num_prompts} x {args.input_len} in / {args.output_len} out",
        "block_size": args.block_size,
        "peak_blocks": peak["blocks"],
        "peak_slots": slots,
        "peak_tokens": peak["tokens"],
        "running_at_peak": peak["running"],
        "waste_fraction": round(1 - peak["tokens"] / slots, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    report = measure(args)
    print(json.dumps(report, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
