"""Single-stream decode against llama.cpp's F32 `tg128`, paired round by round.

This machine's speed drifts by 10-20% from one minute to the next, so two benchmarks run
one after the other can disagree more than the engines do. Here every round runs one
llama-bench `tg128` (one repetition, 2 threads) and then one pagedllm request of 128 tokens
from a 1-token prompt in an engine kept loaded, and the ratio is taken within the round.
Prints each round and the medians; `--output-json` keeps them.

    .venv/bin/python -m benchmarks.single_stream [--rounds 10]
        [--variants fp32,fp32-compile,gguf,gguf-compile] [--output-json out.json]

llama.cpp and its F32 file come from benchmarks.compare's peer cache
(`--install-only` puts them there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams

PEERS = Path(os.environ.get("PAGEDLLM_PEERS_DIR", Path.home() / ".cache/pagedllm-peers"))
LLAMA_BENCH = PEERS / "llama.cpp/build/bin/llama-bench"
F32_MODEL = PEERS / "models/SmolLM2-135M-Instruct-f32.gguf"
TOKENS = 128


def llama_cpp_tokens_per_s() -> float:
    command = [str(LLAMA_BENCH), "-m", str(F32_MODEL), "-p", "0", "-n", str(TOKENS)]
    command += ["-t", "2", "-r", "1", "-o", "json"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(json.loads(result.stdout)[0]["avg_ts"])


def pagedllm_tokens_per_s(llm: LLM) -> float:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1]}], params, use_tqdm=False)
    return TOKENS / (time.perf_counter() - started)


VARIANTS = {  # eager variants say so: the engine's default compiles where it is exact
    "fp32": {"compile": False},
    "fp32-compile": {"compile": True},
    "gguf": {"quantization": "gguf", "compile": False},
    "gguf-compile": {"quantization": "gguf", "compile": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--variants", default="fp32,fp32-compile", help=", ".join(VARIANTS))
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    engines = {
        name: LLM(
            dtype="float32",
            max_num_seqs=1,
            kv_cache_memory="512MiB",
            disable_log_stats=True,
            **VARIANTS[name],
        )
        for name in args.variants.split(",")
    }
    for llm in engines.values():
        pagedllm_tokens_per_s(llm)  # warm-up
    rounds = []
    print(
        "| round | llama.cpp F32 tok/s | " + " | ".join(f"{name} tok/s" for name in engines) + " |"
    )
    print("|---" * (len(engines) + 2) + "|")
    for index in range(args.rounds):
        row = {"llama_cpp": llama_cpp_tokens_per_s()}
        row.update({name: pagedllm_tokens_per_s(llm) for name, llm in engines.items()})
        rounds.append(row)
        print(f"| {index + 1} | " + " | ".join(f"{value:.1f}" for value in row.values()) + " |")
    summary = {}
    for name in engines:
        ratios = [r[name] / r["llama_cpp"] for r in rounds]
        summary[name] = {
            "tokens_per_s": statistics.median(r[name] for r in rounds),
            "ratio": statistics.median(ratios),
            "rounds_ahead": sum(ratio >= 1 for ratio in ratios),
        }
        print(
            f"{name}: {summary[name]['tokens_per_s']:.1f} tokens/s, median ratio to "
            f"llama.cpp {summary[name]['ratio']:.3f}, ahead in "
            f"{summary[name]['rounds_ahead']} of {len(rounds)} rounds"
        )
    summary["llama_cpp"] = statistics.median(r["llama_cpp"] for r in rounds)
    print(f"llama.cpp F32: {summary['llama_cpp']:.1f} tokens/s")
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps({"rounds": rounds, "median": summary}, indent=2)
        )


if __name__ == "__main__":
    main()
