"""The quantized KV cache on the default model: capacity, accuracy against the fp32 cache, and
decode speed, for each `kv_cache_dtype` (`--dtypes`, default auto (fp32), float16, int8,
fp8 (e4m3), fp8_e5m2).

- Capacity: the blocks one `--kv-cache-memory` (256 MiB) holds and the max concurrency at
  `--max-model-len` (2048): the engine's own sizing, the start-up log line's figure.
- Accuracy: `--num-prompts` (8) chat prompts x `--output-len` (64) greedy tokens, against the
  fp32 cache's: the largest |logprob difference| of fp32's token over each sequence's common
  prefix (the first divergence included), free-running greedy agreement (equal tokens at
  equal positions), and teacher-forced agreement: fp32's completions fed back as prompts,
  the share of positions where the quantized cache's most likely token is fp32's (rank 1),
  with the largest logprob difference there (every position, same context).
- Decode speed: `--batch` (32) random prompts of `--context` (512) tokens, each decoding
  `--decode-len` (64) tokens (EOS ignored); output tokens/s of the decode steps only (the
  prompts prefilled once into the prefix cache, the time of a 1-token run subtracted),
  median of `--rounds` (3) rounds interleaved over the engines so the machine's drift hits
  all alike.

    .venv/bin/python -m benchmarks.kv_quant [--dtypes auto,float16,int8,fp8,fp8_e5m2]
        [--rounds 3] [--batch 32] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np

from pagedllm import LLM, SamplingParams
from pagedllm.utils import cdiv

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "List three uses of a paper clip.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I boil an egg?",
    "Give me a short motivational quote.",
    "What is the difference between a list and a tuple in Python?",
]


def chat_prompts(llm: LLM, count: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        for i in range(count)
    ]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    batch = [{"prompt_token_ids": p} for p in prompts]
    return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]


def prompt_logprobs(llm: LLM, sequences: list[list[int]], skip: list[int]) -> list[list]:
    """Each sequence's logprob (with rank) of its own tokens after the first `skip[i]`."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    batch = [{"prompt_token_ids": s} for s in sequences]
    outputs = llm.generate(batch, params, use_tqdm=False)
    return [
        [o.prompt_logprobs[p][s[p]] for p in range(n, len(s))]
        for o, s, n in zip(outputs, sequences, skip, strict=True)
    ]


def free_running(reference: list, actual: list) -> tuple[float, float]:
    """(agreement, largest |logprob difference| over the common prefixes)."""
    agree = total = 0
    largest = 0.0
    for want, got in zip(reference, actual, strict=True):
        total += len(want.token_ids)
        agree += sum(a == b for a, b in zip(want.token_ids, got.token_ids, strict=True))
        for position, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True)):
            lp = got.logprobs[position].get(a)
            if lp is not None:
                largest = max(largest, abs(lp.logprob - want.logprobs[position][a].logprob))
            if a != b:
                break
    return agree / total, largest


def teacher_forced(reference: list[list], actual: list[list]) -> tuple[float, float]:
    """(share of positions where fp32's token is rank 1, largest |logprob difference|)."""
    pairs = [
        pair
        for want, got in zip(reference, actual, strict=True)
        for pair in zip(want, got, strict=True)
    ]
    agree = sum(g.rank == 1 for _, g in pairs) / len(pairs)
    return agree, max(abs(w.logprob - g.logprob) for w, g in pairs)


def decode_rate(llm: LLM, prompts: list[list[int]], decode_len: int) -> float:
    """Output tokens/s of the decode steps: a full run less a 1-token run. The prompts'
    blocks are in the prefix cache (a warm-up ran them), so neither recomputes them."""
    batch = [{"prompt_token_ids": p} for p in prompts]

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - started

    prefill = run(1)
    full = run(decode_len + 1)
    return len(prompts) * decode_len / (full - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="auto,float16,int8,fp8,fp8_e5m2")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--decode-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    results: dict[str, dict] = {}

    # Capacity and accuracy: one engine at a time.
    reference = forced_reference = prompts = sequences = skip = None
    for dtype in dtypes:
        llm = LLM(
            max_model_len=args.max_model_len,
            kv_cache_memory=args.kv_cache_memory,
            kv_cache_dtype=dtype,
        )
        cache = llm.llm_engine.config.cache_config
        per_request = cdiv(args.max_model_len, cache.block_size)
        row = results[dtype] = {
            "blocks": cache.num_blocks - 1,
            "max_concurrency": (cache.num_blocks - 1) / per_request,
        }
        if prompts is None:
            prompts = chat_prompts(llm, args.num_prompts)
        outputs = greedy(llm, prompts, args.output_len)
        if reference is None:  # the first dtype is the reference (auto: fp32)
            reference = outputs
            sequences = [p + list(o.token_ids) for p, o in zip(prompts, outputs, strict=True)]
            skip = [len(p) for p in prompts]
        forced = prompt_logprobs(llm, sequences, skip)
        forced_reference = forced_reference or forced
        row["agreement"], row["logprob_diff"] = free_running(reference, outputs)
        row["forced_agreement"], row["forced_logprob_diff"] = teacher_forced(
            forced_reference, forced
        )
        print(dtype, json.dumps(row), flush=True)
        del llm
        gc.collect()

    # Decode speed: all engines at once, rounds interleaved.
    rng = np.random.default_rng(0)
    batch = [rng.integers(100, 20000, args.context).tolist() for _ in range(args.batch)]
    # fp32 holds the batch whole (46,080 bytes a token), with 10% to spare.
    memory = int(args.batch * (args.context + args.decode_len + 16) * 46080 * 1.1)
    engines = {
        dtype: LLM(
            max_model_len=args.context + args.decode_len + 8,
            kv_cache_memory=memory,
            kv_cache_dtype=dtype,
            max_num_seqs=args.batch,
        )
        for dtype in dtypes
    }
    for llm in engines.values():  # warm-up: the prompts into the prefix cache
        llm.generate(
            [{"prompt_token_ids": p} for p in batch],
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )
    rates: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    for _ in range(args.rounds):
        for dtype, llm in engines.items():
            rates[dtype].append(decode_rate(llm, batch, args.decode_len))
            print(dtype, f"{rates[dtype][-1]:.1f} tok/s", flush=True)
    for dtype in dtypes:
        results[dtype]["decode_tok_s"] = statistics.median(rates[dtype])
        results[dtype]["decode_tok_s_rounds"] = rates[dtype]

    print(
        f"\nkv_cache_memory={args.kv_cache_memory}, max_model_len={args.max_model_len}; "
        f"accuracy {args.num_prompts} prompts x {args.output_len} tokens; decode batch "
        f"{args.batch} x {args.context}-token contexts, {args.decode_len} tokens"
    )
    print(
        f"{'dtype':10} {'blocks':>7} {'max conc.':>9} {'lp diff':>8} {'agree':>6} "
        f"{'forced':>7} {'forced lp':>9} {'decode tok/s':>12}"
    )
    for dtype, r in results.items():
        print(
            f"{dtype:10} {r['blocks']:7d} {r['max_concurrency']:8.2f}x {r['logprob_diff']:8.3f} "
            f"{r['agreement']:6.1%} {r['forced_agreement']:7.1%} "
            f"{r['forced_logprob_diff']:9.3f} {r['decode_tok_s']:12.1f}"
        )
    if args.output_json:
        args.output_json.write_text(json.dumps(vars(args) | {"results": results}, default=str))


if __name__ == "__main__":
    main()
