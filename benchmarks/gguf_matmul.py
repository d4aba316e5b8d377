"""The gguf kernel on one decoder layer's four matmuls, beside fp32 oneDNN on the same shapes.

SmolLM2-135M's shapes (fused q/k/v 960 x 576, o 576 x 576, fused gate/up 3072 x 576, down
576 x 1536) with random Q4_1 blocks (the default model's type), at each row count of
`--rows`. Prints ms for the layer's four matmuls (median of `--repeats`) and the rate in
fp32-equivalent GFLOP/s (2 * rows * in * out per matmul), for the gguf kernel with
`--digits` activation digits on the `--isa` path (default: the widest this CPU has) and for
fp32 oneDNN on prepacked weights.

    .venv/bin/python -m benchmarks.gguf_matmul [--rows 64,256,2048] [--digits 2] [--repeats 10]
        [--isa 0|1|2|3]

`--shape llama-3.2-1b` (or another of `benchmarks.random_gguf`'s shapes) times that model's
projections instead, on random blocks of their Q4_K_M types (q/k/o/gate/up Q4_K, v/down
Q6_K, the tied head Q6_K), each alone: integer GOP/s (2 * rows * in * out; one digit's worth
of the dots, as llama.cpp counts them) and, at one row, the weight bytes read per second.

    .venv/bin/python -m benchmarks.gguf_matmul --shape llama-3.2-1b --rows 1,16,64,256

`--whole-model` instead times a decode step's matmuls over every layer of the shape (a copy
of the layer's tables each, so they come from memory as in a real step, not from the
cache) and the head, in order: ms a step and the weight bytes read per second.

    .venv/bin/python -m benchmarks.gguf_matmul --shape llama-3.2-1b --whole-model --rows 1,8,32
"""

from __future__ import annotations

import argparse
import copy
from functools import partial

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from benchmarks.random_gguf import SHAPES as SHAPES_BY_NAME
from benchmarks.random_gguf import LlamaShape, _random_blocks
from benchmarks.timing import median_seconds
from pagedllm.model.layers import onednn
from pagedllm.model.layers.gguf_linear import GGUFLinear, pack_weights
from pagedllm.ops import fused
from pagedllm.ops.cpu_features import gguf_kernel_isa

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
BLOCK = 32


def random_q4_1(out_features: int, in_features: int) -> tuple[torch.Tensor, ...]:
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    d = torch.rand(out_features, in_features // BLOCK) * 0.01
    m = -torch.rand(out_features, in_features // BLOCK) * 0.05
    return pack_weights(q, d, m, bits=4), q.float() * d.repeat_interleave(BLOCK, 1) + (
        m.repeat_interleave(BLOCK, 1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,256,2048")
    parser.add_argument("--digits", type=int, default=2, choices=[1, 2])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--isa",
        type=int,
        default=gguf_kernel_isa(),
        help="0 portable, 1 AVX2, 2 VNNI, 3 AMX-INT8 tiles",
    )
    parser.add_argument("--shape", help="a real model's projections (random_gguf's names)")
    parser.add_argument(
        "--whole-model", action="store_true", help="with --shape: every layer's copy, in order"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.shape and args.whole_model:
        return time_whole_model(SHAPES_BY_NAME[args.shape], args)
    if args.shape:
        return time_shape(SHAPES_BY_NAME[args.shape], args)
    ops = fused.load()
    layers = [random_q4_1(n, k) for n, k in SHAPES]
    packed_fp32 = [onednn.pack(weight) for _, weight in layers]
    print(
        f"threads={torch.get_num_threads()}  digits={args.digits}  isa={args.isa}  "
        "(one layer's four matmuls)"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        time_layer(ops, layers, packed_fp32, rows, args)


def time_layer(ops, layers, packed_fp32, rows: int, args: argparse.Namespace) -> None:
    inputs = {k: torch.randn(rows, k) for _, k in SHAPES}
    outputs = {n: torch.empty(rows, n) for n, _ in SHAPES}

    def gguf_layer():
        for (n, k), ((packed, scales, mins), _) in zip(SHAPES, layers, strict=True):
            ops.gguf_linear(outputs[n], inputs[k], packed, scales, mins, 4, args.digits, args.isa)

    def fp32_layer():
        for (_, k), packed in zip(SHAPES, packed_fp32, strict=True):
            fused.onednn_linear(inputs[k], packed)

    flops = 2 * rows * sum(n * k for n, k in SHAPES)
    for name, call in (("gguf", gguf_layer), ("fp32 oneDNN", fp32_layer)):
        seconds = median_seconds(call, args.repeats)
        rate = flops / seconds / 1e9
        print(f"rows={rows:5d} {name:12} {seconds * 1e3:8.2f} ms  {rate:6.0f} GFLOP/s")


def projections(shape: LlamaShape) -> list[tuple[str, int, int, Q]]:
    """(name, out, in, type) of one layer's projections and the head, as Q4_K_M types them."""
    hidden, intermediate = shape.hidden_size, shape.intermediate_size
    q_out, kv_out = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return [
        ("q+k", q_out + kv_out, hidden, Q.Q4_K),
        ("v", kv_out, hidden, Q.Q6_K),
        ("o", hidden, q_out, Q.Q4_K),
        ("gate+up", 2 * intermediate, hidden, Q.Q4_K),
        ("down", hidden, intermediate, Q.Q6_K),
        ("head", shape.vocab_size, hidden, Q.Q6_K),
    ]


def random_layer(out_features: int, in_features: int, qtype: Q, digits: int) -> GGUFLinear:
    block_weights = GGML_QUANT_SIZES[qtype][0]
    count = out_features * in_features // block_weights
    blocks = _random_blocks(qtype, count, np.random.default_rng(0))
    return GGUFLinear(blocks.reshape(out_features, -1), qtype, digits=digits)


def time_shape(shape: LlamaShape, args: argparse.Namespace) -> None:
    print(f"{shape.name}: threads={torch.get_num_threads()}  digits={args.digits}  isa={args.isa}")
    for name, n, k, qtype in projections(shape):
        layer = random_layer(n, k, qtype, args.digits)
        layer.isa = args.isa
        weight_bytes = sum(t.nbytes for t in layer.buffers())
        for rows in (int(r) for r in args.rows.split(",")):
            x, out = torch.randn(rows, k), torch.empty(rows, n)
            seconds = median_seconds(partial(layer.matmul_into, x, out), args.repeats)
            line = f"{name:8} {qtype.name} {n:6d}x{k:5d} rows={rows:4d} {seconds * 1e3:8.3f} ms"
            line += f" {2 * rows * n * k / seconds / 1e9:7.0f} GOP/s"
            if rows == 1:
                line += f" {weight_bytes / seconds / 1e9:6.1f} GB/s of weights"
            print(line, flush=True)


def _copy(layer: GGUFLinear) -> GGUFLinear:
    """The layer with tables of its own (the same values at other addresses)."""
    twin = copy.copy(layer)
    twin._buffers = {n: None if t is None else t.clone() for n, t in layer._buffers.items()}
    return twin


def time_whole_model(shape: LlamaShape, args: argparse.Namespace) -> None:
    *layer, head = projections(shape)
    first = [random_layer(n, k, qtype, args.digits) for _, n, k, qtype in layer]
    steps = [first] + [[_copy(p) for p in first] for _ in range(shape.num_layers - 1)]
    model = [p for step in steps for p in step] + [random_layer(*head[1:], args.digits)]
    for p in model:
        p.isa = args.isa
    weight_bytes = sum(t.nbytes for p in model for t in p.buffers())
    print(
        f"{shape.name}, {shape.num_layers} layers and the head ({weight_bytes / 1e9:.3f} GB): "
        f"threads={torch.get_num_threads()}  digits={args.digits}  isa={args.isa}"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        pairs = [
            (torch.randn(rows, p.in_features), torch.empty(rows, p.out_features)) for p in model
        ]

        def step(pairs=pairs):
            for p, (x, out) in zip(model, pairs, strict=True):
                p.matmul_into(x, out)

        seconds = median_seconds(step, args.repeats)
        print(
            f"rows={rows:4d} {seconds * 1e3:8.2f} ms a step  "
            f"{weight_bytes / seconds / 1e9:5.1f} GB/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
