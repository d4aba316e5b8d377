"""Offline throughput of Hugging Face Transformers `generate`; run by our `.venv`'s Python.

The classic baseline: the workload file's prompts in padded static batches (left padding),
each batch running to its longest output with EOS suppressed (`min_new_tokens`), sampled
as `pagedllm bench throughput` samples (temperature 1, no top-k/top-p). Only the requested
tokens count as output. Writes the same JSON keys as `pagedllm bench throughput`.

    .venv/bin/python -P run_hf_generate.py --model HF_DIR --workload W.jsonl \
        --num-prompts N --batch-size 64 --output-json OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--pad-token-id", type=int, default=2)
    parser.add_argument("--output-json", required=True)
    return parser.parse_args()


def read_workload(path: str, limit: int | None) -> list[tuple[list[int], int]]:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [(r["prompt_token_ids"], int(r["output_len"])) for r in records[:limit]]


def run_batch(model, batch: list[tuple[list[int], int]], pad_token_id: int) -> None:
    longest = max(len(p) for p, _ in batch)
    output_len = max(n for _, n in batch)
    input_ids = torch.tensor([[pad_token_id] * (longest - len(p)) + p for p, _ in batch])
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad_token_id,
        )
    if out.shape[1] - longest != output_len:
        raise RuntimeError(f"generate made {out.shape[1] - longest} tokens, not {output_len}")


def main() -> None:
    args = parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    workload = read_workload(args.workload, args.num_prompts)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    startup_s = time.perf_counter() - started
    started = time.perf_counter()
    for start in range(0, len(workload), args.batch_size):
        run_batch(model, workload[start : start + args.batch_size], args.pad_token_id)
        print(f"batch at {start}: {time.perf_counter() - started:.1f} s", flush=True)
    elapsed = time.perf_counter() - started
    num_input = sum(len(p) for p, _ in workload)
    num_output = sum(n for _, n in workload)
    report = {
        "elapsed_s": round(elapsed, 3),
        "startup_s": round(startup_s, 1),
        "batch_size": args.batch_size,
        "torch_threads": torch.get_num_threads(),
        "num_requests": len(workload),
        "num_input_tokens": num_input,
        "num_output_tokens": num_output,
        "requests_per_s": round(len(workload) / elapsed, 3),
        "output_tokens_per_s": round(num_output / elapsed, 1),
        "total_tokens_per_s": round((num_input + num_output) / elapsed, 1),
    }
    with open(args.output_json, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
