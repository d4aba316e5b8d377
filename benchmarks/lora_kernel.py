"""The LoRA deltas of one decode step, isolated: the torch path against the CPU kernel.

64 decode tokens of 8 adapters (8 each, round-robin), 30 layers x the default model's four
fused projections (q/k/v, o, gate/up, down), each with its own rank-16 slots: the slots'
weights are cold, as they are between the base model's matmuls in a real step. Reported:
milliseconds per step for `add_lora` (the torch path: two `bmm` over the slots) and for
`lora_sgmv` (ops/csrc/lora.cpp), median of `--repeats`.

    .venv/bin/python -m benchmarks.lora_kernel [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagedllm.lora.model.layers import LoRAStep, add_lora
from pagedllm.ops.extension import load

RANK, SLOTS, TOKENS, LAYERS = 16, 8, 64, 30
# (in features, the fused output's shard sizes) of SmolLM2-135M's projections.
PROJECTIONS = [(576, [576, 192, 192]), (576, [576]), (576, [1536, 1536]), (1536, [576])]


def layer_weights():
    layers = []
    for _ in range(LAYERS):
        for in_features, shards in PROJECTIONS:
            width, out_features = len(shards) * RANK, sum(shards)
            columns = np.concatenate(([0], np.cumsum(shards)))
            lora_b = torch.zeros(SLOTS, width, out_features)
            blocks = []
            for k in range(len(shards)):
                ranks = slice(k * RANK, (k + 1) * RANK)
                cols = slice(int(columns[k]), int(columns[k + 1]))
                lora_b[:, ranks, cols] = torch.randn(SLOTS, RANK, cols.stop - cols.start)
                blocks.append((ranks, cols))
            layers.append(
                (
                    torch.randn(TOKENS, in_features),
                    torch.randn(TOKENS, out_features),
                    torch.randn(SLOTS, in_features, width),
                    lora_b,
                    blocks,
                    torch.from_numpy(columns),
                )
            )
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    step = LoRAStep.build(np.arange(TOKENS) % SLOTS, SLOTS, torch.device("cpu"))
    layers = layer_weights()
    kernel = load()

    def torch_path():
        for x, out, lora_a, lora_b, blocks, _ in layers:
            add_lora(out, x, lora_a, lora_b, step, blocks)

    def kernel_path():
        for x, out, lora_a, lora_b, _, columns in layers:
            kernel.lora_sgmv(
                out, x, lora_a, lora_b, step.sorted_tokens, step.group_starts, columns, RANK
            )

    for name, run in (("torch", torch_path), ("kernel", kernel_path)):
        run()
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        print(f"{name:7s} {1e3 * statistics.median(times):.1f} ms per decode step")


if __name__ == "__main__":
    main()
