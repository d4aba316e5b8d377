"""The 8-bit checkpoint layers (`model/layers/w8a8_linear.py`) on a Llama shape's
projections, beside fp32 `torch.mm` on the dequantized weights: what keeping the weights
8-bit costs or saves per matmul.

For each projection (fused q/k/v, o, fused gate/up, down) and row count: ms per call (median
of `--repeats`) for int8 W8A8 (fbgemm on VNNI CPUs, else torch._int_mm; activations per
token), FP8 dynamic (e4m3 weights per channel dequantized 1 MiB of rows at a time,
activations fake-quantized per token), FP8 in 128 x 128 blocks (activations per group of
128), and fp32. Random weights: the time does not depend on the values.

    .venv/bin/python -m benchmarks.w8a8_matmul [--shape llama-3.2-1b] [--rows 1,32]
        [--repeats 10] [--threads 1]

Prints one JSON line per projection and row count; record `lscpu` flags and `uptime`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import torch

from benchmarks.random_gguf import SHAPES
from pagedllm.model.layers.w8a8_linear import w8a8_layer
from pagedllm.model.layers.w8a8_weights import W8A8Weights
from pagedllm.model.quantization.w8a8_scheme import (
    FP8,
    INT8,
    PER_GROUP,
    PER_TOKEN,
    WEIGHT_BLOCK,
    WEIGHT_CHANNEL,
    ActivationScheme,
    W8A8Scheme,
)

PER_TOKEN_DYNAMIC = ActivationScheme(PER_TOKEN, True)
SCHEMES = {
    "int8-w8a8": W8A8Scheme(INT8, WEIGHT_CHANNEL, PER_TOKEN_DYNAMIC),
    "fp8-dynamic": W8A8Scheme(FP8, WEIGHT_CHANNEL, PER_TOKEN_DYNAMIC),
    "fp8-block": W8A8Scheme(FP8, WEIGHT_BLOCK, ActivationScheme(PER_GROUP, True, 128), (128, 128)),
}


def projections(shape) -> dict[str, tuple[int, int]]:
    """name -> (inputs, outputs) of one decoder layer's four matmuls."""
    kv = shape.num_kv_heads * shape.head_dim
    return {
        "qkv": (shape.hidden_size, shape.num_heads * shape.head_dim + 2 * kv),
        "o": (shape.num_heads * shape.head_dim, shape.hidden_size),
        "gate_up": (shape.hidden_size, 2 * shape.intermediate_size),
        "down": (shape.intermediate_size, shape.hidden_size),
    }


def random_weights(scheme: W8A8Scheme, inputs: int, outputs: int) -> W8A8Weights:
    if scheme.weight_type == INT8:
        values = torch.randint(-127, 128, (outputs, inputs), dtype=torch.int8)
    else:
        values = torch.randn(outputs, inputs).mul_(64).to(torch.float8_e4m3fn)
    if scheme.block is None:
        scales = torch.rand(outputs, 1) * 1e-4
    else:
        scales = torch.rand(-(-outputs // 128), -(-inputs // 128)) * 1e-4
    return W8A8Weights(values, scales, scheme)


def median_ms(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for name, (inputs, outputs) in projections(SHAPES[args.shape]).items():
        layers = {k: w8a8_layer(random_weights(s, inputs, outputs)) for k, s in SCHEMES.items()}
        dense = torch.randn(outputs, inputs)
        for rows in (int(r) for r in args.rows.split(",")):
            print(json.dumps(time_row(name, layers, dense, rows, args.repeats)))


def time_row(name: str, layers: dict, dense: torch.Tensor, rows: int, repeats: int) -> dict:
    """ms per call of each layer and of fp32 torch.mm at `rows` input rows."""
    outputs, inputs = dense.shape
    x = torch.randn(rows, inputs)
    with torch.no_grad():
        row = {key: median_ms(partial(layer, x), repeats) for key, layer in layers.items()}
        row["fp32"] = median_ms(partial(torch.mm, x, dense.T), repeats)
    return {"projection": name, "in": inputs, "out": outputs, "rows": rows, **row}


if __name__ == "__main__":
    main()
