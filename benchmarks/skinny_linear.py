"""The skinny-linear kernel against `F.linear` and oneDNN (prepacked weights) at decode shapes.

Times one forward pass's worth of projections of the default model (4 per layer × 30
layers + the tied head, fp32) at 1..128 rows, each way, best of `--repeats`, after checking
that both give the same result.

    .venv/bin/python -m benchmarks.skinny_linear [--rows 1,2,4,8,16,32,64,96,128] [--repeats 5]
        [--huge-pages]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.ceiling import HIDDEN, LAYERS, LINEAR_SHAPES, VOCAB, best_seconds
from pagedllm.model.layers import onednn
from pagedllm.ops import fused
from pagedllm.ops.extension import load
from pagedllm.runner.huge_pages import place_weights_on_huge_pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,96,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="weights in one arena on transparent huge pages, as the engine keeps them",
    )
    args = parser.parse_args()
    ops = load()
    shapes = [(o, i) for i, o in LINEAR_SHAPES.values()] * LAYERS + [(VOCAB, HIDDEN)]
    weights = [torch.randn(shape) for shape in shapes]
    if args.huge_pages:
        holder = torch.nn.Module()
        holder.weights = torch.nn.ParameterList(weights)
        place_weights_on_huge_pages(holder)
        weights = [parameter.detach() for parameter in holder.weights]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    print(f"{len(weights)} weights, {weight_bytes / 1e6:.0f} MB, {torch.get_num_threads()} threads")
    packed = [onednn.pack(w) for w in weights] if onednn.available() else None
    print("| rows | F.linear (ms) | skinny (ms) | skinny GB/s | oneDNN packed (ms) |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        outs = [torch.empty(rows, w.shape[0]) for w in weights]
        for w, out in zip(weights[:4], outs, strict=False):
            ops.skinny_linear(out, inputs[w.shape[1]], w)
            expected = torch.nn.functional.linear(inputs[w.shape[1]], w)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)

        def torch_pass(inputs=inputs):
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)

        def skinny_pass(inputs=inputs, outs=outs):
            for w, out in zip(weights, outs, strict=True):
                ops.skinny_linear(out, inputs[w.shape[1]], w)

        def onednn_pass(inputs=inputs):
            for w, p in zip(weights, packed, strict=True):
                fused.onednn_linear(inputs[w.shape[1]], p)

        torch_ms = 1000 * best_seconds(torch_pass, args.repeats)
        skinny_ms = 1000 * best_seconds(skinny_pass, args.repeats)
        onednn_ms = 1000 * best_seconds(onednn_pass, args.repeats) if packed else float("nan")
        gbs = weight_bytes / skinny_ms / 1e6
        print(f"| {rows} | {torch_ms:.1f} | {skinny_ms:.1f} | {gbs:.1f} | {onednn_ms:.1f} |")


if __name__ == "__main__":
    main()
