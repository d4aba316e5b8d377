"""Offline throughput: pagedllm vs Hugging Face Transformers `generate`, side by side in one run.

Workload W1 by default: 64 random prompts of 256 tokens, 128 output tokens each, EOS
ignored, on the default model (SmolLM2-135M-Instruct, fp32). Transformers runs the same
prompts as padded batches (`--hf-batch-size`, default all at once). Engines alternate when
`--rounds` > 1 so machine noise falls on both.

    .venv/bin/python -m benchmarks.throughput_vs_hf [--num-prompts 64 --input-len 256
        --output-len 128 --range-ratio 0 --hf-batch-size 64 --rounds 1 --output-json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly from [len*(1-r), len*(1+r)]",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hf-batch-size", type=int, default=None)
    parser.add_argument("--engines", default="pagedllm,transformers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args()


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; lengths vary by --range-ratio."""
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        low, high = int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio))
        return max(1, rng.randint(low, high))

    # Prompt ids skip the low ids, where the special tokens live.
    return [
        (
            [rng.randrange(100, vocab_size) for _ in range(length(args.input_len))],
            length(args.output_len),
        )
        for _ in range(args.num_prompts)
    ]


def run_pagedllm(llm, workload: list[tuple[list[int], int]]) -> tuple[float, int]:
    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def load_transformers_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


def run_transformers(
    model, workload: list[tuple[list[int], int]], batch_size: int, pad_token_id: int
) -> tuple[float, int]:
    """Padded static batches: each batch runs to its longest output; only the requested
    tokens count as output (what a user of `generate` would keep)."""
    started = time.perf_counter()
    num_output_tokens = 0
    for start in range(0, len(workload), batch_size):
        batch = workload[start : start + batch_size]
        longest = max(len(p) for p, _ in batch)
        output_len = max(n for _, n in batch)
        # Left padding, as decoder-only generation needs.
        input_ids = torch.tensor([[pad_token_id] * (longest - len(p)) + p for p, _ in batch])
        attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad_token_id,
            )
        assert out.shape[1] - longest == output_len
        num_output_tokens += sum(n for _, n in batch)
    return time.perf_counter() - started, num_output_tokens


def summarize(name: str, runs: list[tuple[float, int]], workload) -> dict:
    seconds = statistics.median(r[0] for r in runs)
    output_tokens = runs[0][1]
    num_prompts = len(workload)
    prompt_tokens = sum(len(p) for p, _ in workload)
    return {
        "engine": name,
        "seconds_median": round(seconds, 2),
        "seconds_all": [round(r[0], 2) for r in runs],
        "requests_per_s": round(num_prompts / seconds, 3),
        "output_tokens_per_s": round(output_tokens / seconds, 1),
        "total_tokens_per_s": round((output_tokens + prompt_tokens) / seconds, 1),
    }


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    from pagedllm import LLM
    from pagedllm.model.loader import default_model_path

    engines = args.engines.split(",")
    llm = LLM(dtype="float32") if "pagedllm" in engines else None
    hf_model = load_transformers_model(default_model_path()) if "transformers" in engines else None
    vocab_size = llm.llm_engine.model_config.vocab_size if llm else hf_model.config.vocab_size
    workload = make_workload(args, vocab_size)
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
    for round_index in range(args.rounds):
        for name in engines:
            if name == "pagedllm":
                result = run_pagedllm(llm, workload)
            else:
                batch_size = args.hf_batch_size or len(workload)
                result = run_transformers(hf_model, workload, batch_size, pad_token_id=2)
            runs[name].append(result)
            print(
                f"round {round_index + 1} {name}: {result[0]:.1f} s, {result[1]} output tokens",
                flush=True,
            )
    report = {
        "workload": vars(args),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "results": [summarize(n, runs[n], workload) for n in engines],
    }
    print_table(report["results"])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


def print_table(results: list[dict]) -> None:
    print("| engine | requests/s | output tok/s | total tok/s | seconds (median) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['engine']} | {r['requests_per_s']} | {r['output_tokens_per_s']} | "
            f"{r['total_tokens_per_s']} | {r['seconds_median']} |"
        )
    if len(results) == 2:
        ratio = results[0]["requests_per_s"] / results[1]["requests_per_s"]
        print(f"\n{results[0]['engine']} / {results[1]['engine']}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
