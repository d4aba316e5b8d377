"""bf16 linear layers on the tile-layout copy (`fused.amx_linear` on AMX tiles,
`fused.bf16_dot_linear` on AVX512-BF16 dot products) against oneDNN's packed bf16 linear.

Two measurements at the default model's shapes (random bf16 weights), for each kernel the
CPU has:

- `stream`: a decode step's matmuls, 30 layers' four projections and the tied head, each
  weight read once from memory (512 MB of weights do not stay in cache between passes):
  milliseconds a pass and the weight bytes' rate, per row count;
- `layer`: one layer's four projections with the weights in cache, milliseconds a call
  summed, per row count: where the kernels stop winning (`fused.AMX_MAX_ROWS`,
  `fused.BF16_DOT_MAX_ROWS`).

Medians of ten passes (stream) and of seven timings (layer), after one warm-up call. To
time oneDNN without its AMX path on an AMX CPU, run with `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`.

    .venv/bin/python -m benchmarks.amx_linear [--stream-rows 1,32,64,128,256]
        [--layer-rows 128,512,2048] [--kernels amx_tiles,bf16_dots] [--json F]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks.timing import median_seconds
from pagedllm.model.layers import amx_tiles, onednn
from pagedllm.ops import fused
from pagedllm.ops.kernel_selection import amx_tiles_granted, bf16_dot_granted

LAYERS = 30
# The default model's projections (out, in): fused q/k/v, o, fused gate/up, down.
PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
# The kernels on the tile-layout copy, and whether this CPU runs each.
TILE_KERNELS: dict[str, tuple[Callable, Callable[[], bool]]] = {
    "amx_tiles": (fused.amx_linear, amx_tiles_granted),
    "bf16_dots": (fused.bf16_dot_linear, bf16_dot_granted),
}


def each(linear: Callable, xs: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
    for x, weight in zip(xs, weights, strict=True):
        linear(x, weight)


def stream(rows_list: list[int], kernels: list[str]) -> list[dict]:
    """The decode step's projections, every weight read once a pass."""
    torch.manual_seed(0)
    weights = [torch.randn(o, i).bfloat16() for _ in range(LAYERS) for o, i in PROJECTIONS]
    weights.append(torch.randn(*HEAD).bfloat16())
    onednn_weights = [onednn.pack(w) for w in weights]
    tile_weights = [amx_tiles.pack(w) for w in weights]
    weight_bytes = sum(w.nbytes for w in weights)
    results = []
    for rows in rows_list:
        inputs = {i: torch.randn(rows, i).bfloat16() for i in {w.shape[1] for w in weights}}
        xs = [inputs[w.shape[1]] for w in weights]
        seconds = {
            "onednn": median_seconds(partial(each, fused.onednn_linear, xs, onednn_weights), 10)
        }
        for name in kernels:
            kernel = TILE_KERNELS[name][0]
            seconds[name] = median_seconds(partial(each, kernel, xs, tile_weights), 10)
        result = {"rows": rows, "weight_bytes": weight_bytes}
        for name, value in seconds.items():
            result[f"{name}_ms"] = value * 1e3
            result[f"{name}_gb_per_s"] = weight_bytes / value / 1e9
        results.append(result)
        line = ", ".join(
            f"{name} {result[f'{name}_ms']:6.2f} ms ({result[f'{name}_gb_per_s']:4.1f} GB/s)"
            for name in seconds
        )
        print(f"stream {rows:5d} rows: {line}", flush=True)
    return results


def layer(rows_list: list[int], kernels: list[str]) -> list[dict]:
    """One layer's projections, weights in cache: the sum of each call's median time."""
    torch.manual_seed(1)
    weights = [torch.randn(o, i).bfloat16() for o, i in PROJECTIONS]
    onednn_weights = [onednn.pack(w) for w in weights]
    tile_weights = [amx_tiles.pack(w) for w in weights]
    results = []
    for rows in rows_list:
        result = {"rows": rows, "onednn_ms": 0.0} | {f"{name}_ms": 0.0 for name in kernels}
        for weight, packed, tiles in zip(weights, onednn_weights, tile_weights, strict=True):
            x = [torch.randn(rows, weight.shape[1]).bfloat16()]
            timed = [("onednn", fused.onednn_linear, packed)]
            timed += [(name, TILE_KERNELS[name][0], tiles) for name in kernels]
            for name, kernel, copy in timed:
                result[f"{name}_ms"] += median_seconds(partial(each, kernel, x, [copy]), 7) * 1e3
        results.append(result)
        line = ", ".join(f"{name} {result[f'{name}_ms']:6.2f} ms" for name in ["onednn", *kernels])
        print(f"layer  {rows:5d} rows: {line}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream-rows", default="1,32,64,128,256")
    parser.add_argument("--layer-rows", default="128,512,2048")
    parser.add_argument("--kernels", default=",".join(TILE_KERNELS))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    kernels = [name for name in args.kernels.split(",") if TILE_KERNELS[name][1]()]
    if not kernels:
        raise SystemExit("this CPU runs none of the kernels asked for (no AMX-BF16, AVX512-BF16)")
    report = {
        "threads": torch.get_num_threads(),
        "kernels": kernels,
        "stream": stream([int(r) for r in args.stream_rows.split(",")], kernels),
        "layer": layer([int(r) for r in args.layer_rows.split(",")], kernels),
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
