"""The machine's ceiling for the default model, and how close an engine run gets to it.

Measures, on all cores: the fp32 matrix-multiply rate at the model's linear-layer shapes
(rows = tokens in a step) and the memory copy bandwidth. Given `pagedllm bench throughput
--output-json` reports, prints each run's achieved model FLOP/s as a fraction of the
matmul ceiling. Model FLOPs of a run:

    2 × non-embedding parameters × (input + output tokens)   every token runs every layer
  + 2 × hidden × vocab × output tokens                       logits only where a token is due
  + 4 × layers × heads × head_dim × Σ context length          q·k and p·v per token

    .venv/bin/python -m benchmarks.ceiling [--throughput-json run.json ...]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedllm.ops import fused

try:
    from pagedllm.model.layers import onednn
except ImportError:  # a pagedllm from before oneDNN packing (cpu_perf.sh's "before" side)
    onednn = None

# SmolLM2-135M-Instruct
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS, VOCAB = 576, 9, 3, 64, 1536, 30, 49152
LINEAR_SHAPES = {  # name: (in, out)
    "qkv_proj": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    "o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "gate_up_proj": (HIDDEN, 2 * INTERMEDIATE),
    "down_proj": (INTERMEDIATE, HIDDEN),
}
NON_EMBEDDING_PARAMS = LAYERS * sum(i * o for i, o in LINEAR_SHAPES.values())


def best_seconds(fn, repeats: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def matmul_gflops(rows: int, dtype: torch.dtype = torch.float32) -> float:
    """The rate of one layer's four projections at `rows` tokens in `dtype`, FLOP-weighted:
    for each shape the faster of torch's `F.linear` (sgemm for fp32) and oneDNN on a
    prepacked weight (on AMD CPUs sgemm takes its AVX2 path and oneDNN its AVX-512 one)."""
    flops, seconds = 0.0, 0.0
    for in_features, out_features in LINEAR_SHAPES.values():
        x = torch.randn(rows, in_features).to(dtype)
        w = torch.randn(out_features, in_features).to(dtype)
        candidates = [lambda x=x, w=w: torch.nn.functional.linear(x, w)]
        if onednn is not None and onednn.available():
            packed = onednn.pack(w)
            candidates.append(lambda x=x, p=packed: fused.onednn_linear(x, p))
        seconds += min(best_seconds(fn) for fn in candidates)
        flops += 2 * rows * in_features * out_features
    return flops / seconds / 1e9


def copy_bandwidth_gbs(megabytes: int = 256) -> float:
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    seconds = best_seconds(lambda: target.copy_(source), repeats=5)
    return 2 * source.numel() * 4 / seconds / 1e9  # bytes read + bytes written


def run_flops(report: dict) -> float:
    """Model FLOPs of a `pagedllm bench throughput` run (fixed lengths: the averages)."""
    num_requests = report["num_requests"]
    prompt = report["num_input_tokens"] / num_requests
    output = report["num_output_tokens"] / num_requests
    total = prompt + output
    context_sum = num_requests * total * (total + 1) / 2
    return (
        2 * NON_EMBEDDING_PARAMS * (report["num_input_tokens"] + report["num_output_tokens"])
        + 2 * HIDDEN * VOCAB * report["num_output_tokens"]
        + 4 * LAYERS * HEADS * HEAD_DIM * context_sum
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--throughput-json", nargs="*", default=[])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| rows per step | fp32 GFLOP/s at the model's shapes |")
    print("|---|---|")
    rates = {rows: matmul_gflops(rows) for rows in (1, 16, 64, 256, 2048)}
    for rows, rate in rates.items():
        print(f"| {rows} | {rate:.1f} |")
    ceiling = max(rates.values())
    print(f"\nmatmul ceiling: {ceiling:.1f} GFLOP/s; memory copy: {copy_bandwidth_gbs():.1f} GB/s")
    for path in args.throughput_json:
        with open(path) as f:
            report = json.load(f)
        achieved = run_flops(report) / report["elapsed_s"] / 1e9
        print(f"{path}: {achieved:.1f} GFLOP/s = {100 * achieved / ceiling:.0f}% of the ceiling")


if __name__ == "__main__":
    main()
