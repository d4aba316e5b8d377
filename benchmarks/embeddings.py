"""`/v1/embeddings` throughput on a `--runner pooling` server (default model), at batch 1
(one input per request, one request at a time) and batch 64 (64 inputs per request), with
the offline `LLM.embed` on the same inputs beside it.

    .venv/bin/python -m benchmarks.embeddings [--num-inputs 256 --input-len 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import httpx2 as httpx

from benchmarks.serve_vs_offline import start_server, stop_server
from pagedllm.utils import free_port

OUT = Path(__file__).parent / "out"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-inputs", type=int, default=256, help="inputs per measurement")
    parser.add_argument("--input-len", type=int, default=128, help="tokens per input")
    parser.add_argument("--batch-sizes", default="1,64", help="inputs per request, a list")
    parser.add_argument("--output-json", default=None, help="write the figures here")
    return parser.parse_args()


def make_inputs(num_inputs: int, input_len: int, vocab_size: int) -> list[list[int]]:
    """Random token-id inputs (no special tokens), seeded: the same inputs on every run."""
    rng = random.Random(0)
    return [[rng.randrange(100, vocab_size) for _ in range(input_len)] for _ in range(num_inputs)]


def measure_server(base_url: str, inputs: list[list[int]], batch_size: int) -> dict:
    """Requests of `batch_size` inputs each, one at a time (so batch 1 is one input per
    step's batch and batch 64 lets the engine batch 64 prompts)."""
    with httpx.Client(base_url=base_url, timeout=600) as client:
        client.post("/v1/embeddings", json={"input": inputs[:batch_size]})  # warm-up
        started = time.perf_counter()
        num_tokens = 0
        for start in range(0, len(inputs), batch_size):
            batch = inputs[start : start + batch_size]
            response = client.post("/v1/embeddings", json={"input": batch})
            response.raise_for_status()
            num_tokens += response.json()["usage"]["prompt_tokens"]
        elapsed = time.perf_counter() - started
    return {
        "batch_size": batch_size,
        "seconds": round(elapsed, 3),
        "inputs_per_s": round(len(inputs) / elapsed, 2),
        "tokens_per_s": round(num_tokens / elapsed, 1),
    }


def measure_offline(inputs: list[list[int]]) -> dict:
    from pagedllm import LLM

    llm = LLM(runner="pooling")
    llm.embed(inputs[:8], use_tqdm=False)  # warm-up
    started = time.perf_counter()
    llm.embed(inputs, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return {
        "seconds": round(elapsed, 3),
        "inputs_per_s": round(len(inputs) / elapsed, 2),
        "tokens_per_s": round(sum(map(len, inputs)) / elapsed, 1),
    }


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    args = parse_args()
    OUT.mkdir(exist_ok=True)
    inputs = make_inputs(args.num_inputs, args.input_len, vocab_size=49152)
    port = free_port()
    server, startup_s = start_server(port, OUT / "embeddings_server.log", ("--runner", "pooling"))
    try:
        server_runs = [
            measure_server(f"http://127.0.0.1:{port}", inputs, int(size))
            for size in args.batch_sizes.split(",")
        ]
    finally:
        stop_server(server)
    result = {
        "num_inputs": args.num_inputs,
        "input_len": args.input_len,
        "server_startup_s": round(startup_s, 1),
        "server": server_runs,
        "offline_llm_embed": measure_offline(inputs),
        "cpu_flags": cpu_flags(),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
