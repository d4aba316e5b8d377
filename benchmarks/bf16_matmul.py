"""bf16 linear layers on oneDNN: the bf16 packed weight against its fp32 packed copy.

For each projection shape of the default model and of Llama-3.2-1B and each row count, the
GFLOP/s of a bf16 layer multiplying on its bf16 packed weight (oneDNN's AVX512-BF16 or AMX
kernels) and on an fp32 packed copy (activations widened, the result rounded back to bf16),
beside an fp32 layer's rate, with the register probe's bf16-dot / fp32-FMA speed ratio.
Where the ratio is below 1 the fp32 copy wins from some row count on: that count is
`fused.BF16_IN_FP32_MIN_ROWS`. Medians of nine timings of ~0.2 GFLOP each.

    .venv/bin/python -m benchmarks.bf16_matmul [--rows 1,2,4,8,16,32,64,256] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.parallel_memory import LlamaShape
from pagedllm.model.layers import onednn
from pagedllm.ops import extension, fused

LLAMA_3_2_1B = LlamaShape("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 128256, tie_word_embeddings=True)

SHAPES = {  # (in, out): the fused q/k/v and gate/up, and down, of each model
    "smollm2 gate_up": (576, 3072),
    "smollm2 down": (1536, 576),
    "llama-3.2-1b qkv": (2048, 3072),
    "llama-3.2-1b gate_up": (2048, 16384),
    "llama-3.2-1b down": (8192, 2048),
}


def gflops(fn, flops: float) -> float:
    for _ in range(3):
        fn()
    calls = max(2, int(0.2e9 / flops))
    timings = []
    for _ in range(9):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        timings.append((time.perf_counter() - started) / calls)
    return flops / statistics.median(timings) / 1e9


def rates(x: torch.Tensor, packed_bf16, packed_fp32, flops: float) -> dict[str, float]:
    """GFLOP/s of the three ways to multiply bf16 rows x (the fp32 layer on x's values)."""
    x32 = x.float()
    return {
        "bf16_packed": gflops(lambda: fused.onednn_linear(x, packed_bf16), flops),
        "bf16_on_fp32_copy": gflops(
            lambda: fused.onednn_linear(x.float(), packed_fp32).bfloat16(), flops
        ),
        "fp32": gflops(lambda: fused.onednn_linear(x32, packed_fp32), flops),
    }


def measure(rows_list: list[int]) -> list[dict]:
    results = []
    for name, (in_features, out_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features).bfloat16()
        packed_bf16, packed_fp32 = onednn.pack(weight), onednn.pack(weight.float())
        for rows in rows_list:
            x = torch.randn(rows, in_features).bfloat16()
            flops = 2 * rows * in_features * out_features
            result = {"shape": name, "rows": rows, **rates(x, packed_bf16, packed_fp32, flops)}
            results.append(result)
            print(
                f"{name:22s} {rows:5d} rows: bf16 packed {result['bf16_packed']:6.1f}, "
                f"bf16 on fp32 copy {result['bf16_on_fp32_copy']:6.1f}, "
                f"fp32 {result['fp32']:6.1f} GFLOP/s",
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    ratio = float(extension.load().bf16_dot_speed_ratio())
    print(f"bf16 dot / fp32 FMA speed ratio (register probe): {ratio:.2f}")
    results = measure([int(r) for r in args.rows.split(",")])
    if args.json:
        report = {"threads": torch.get_num_threads(), "bf16_dot_speed_ratio": ratio}
        args.json.write_text(json.dumps({**report, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
