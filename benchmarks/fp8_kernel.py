"""The fp8 matmul kernels (ops/csrc/fp8_dequant.cpp) on a Llama shape's projections: each
path of `fp8_linear` (AVX2, AVX-512) and the band path (`fp8_dequant` into 1 MiB of fp32
rows, then torch.mm), per row count.

Each call reads a different copy of the weight, enough copies for `--megabytes` of bytes
(default 600, over twice a 260 MiB L3), so one-row calls read from memory as decode does;
the result is ms per call (median over rounds through the copies) and the weight bytes
read per second. Random e4m3 bytes (NaNs replaced), per-channel scales: the time does not
depend on the values. One thread by default: on a shared machine a second thread waits on
whatever else runs, and the ratios between paths are what is measured.

    .venv/bin/python -m benchmarks.fp8_kernel [--shape llama-3.2-1b] [--rows 1,4,8,32]
        [--rounds 5] [--megabytes 600] [--threads 1] [--library OLD.so]

`--library` loads another build of the extension (e.g. an older commit's, from its JIT cache
directory) instead of this checkout's, for a before/after pair of runs; a build whose fp8
ops take no `isa` runs its one path, reported as "before".

Prints one JSON line per projection and row count; record `lscpu` flags and `uptime`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.random_gguf import SHAPES
from benchmarks.w8a8_matmul import projections
from pagedllm.model.layers.w8a8_linear import BAND_BYTES
from pagedllm.ops.cpu_features import FP8_AVX2, FP8_AVX512, fp8_kernel_isa
from pagedllm.ops.extension import load

NAN_MAGNITUDE = 0x7F


def random_e4m3(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (out_features, in_features), dtype=torch.uint8, generator=generator)
    raw[(raw & NAN_MAGNITUDE) == NAN_MAGNITUDE] = 0x7E
    return raw.view(torch.float8_e4m3fn)


def takes_isa(ops) -> bool:
    return "isa" in str(ops.fp8_linear.default._schema)


def band_matmul(ops, out, x, values, scales) -> None:
    """The band path as TiledDequantLinear runs it past its fused rows."""
    rows, cols = values.shape
    band_rows = max(1, BAND_BYTES // (4 * cols))
    band = torch.empty(band_rows, cols)
    for start in range(0, rows, band_rows):
        stop = min(start + band_rows, rows)
        part = band[: stop - start]
        isa = (fp8_kernel_isa(),) if takes_isa(ops) else ()
        ops.fp8_dequant(part, values[start:stop], scales[start:stop], 1, cols, *isa)
        torch.mm(x, part.T, out=out[:, start:stop])


def time_calls(call, copies: list, rounds: int) -> float:
    """Median ms of one call, each on the next copy of the weights."""
    call(*copies[0])  # warm-up
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for operands in copies:
            call(*operands)
        samples.append((time.perf_counter() - start) * 1000 / len(copies))
    return statistics.median(samples)


def measure(name: str, shape: tuple[int, int], rows: int, args, ops) -> dict:
    in_features, out_features = shape
    count = max(1, int(args.megabytes * 1e6) // (out_features * in_features))
    weights = [random_e4m3(out_features, in_features, seed) for seed in range(count)]
    scales = torch.rand(out_features, 1) * 1e-2
    x = torch.randn(rows, in_features)
    out = torch.empty(rows, out_features)
    copies = [(w,) for w in weights]
    paths = {"band": lambda w: band_matmul(ops, out, x, w, scales)}
    if not takes_isa(ops):
        paths["before"] = lambda w: ops.fp8_linear(out, x, w, scales, 1, in_features)
    else:
        paths["avx2"] = lambda w: ops.fp8_linear(out, x, w, scales, 1, in_features, FP8_AVX2)
    if takes_isa(ops) and fp8_kernel_isa() == FP8_AVX512:
        paths["avx512"] = lambda w: ops.fp8_linear(out, x, w, scales, 1, in_features, FP8_AVX512)
    record = {"projection": name, "out": out_features, "in": in_features, "rows": rows}
    for path, call in paths.items():
        ms = time_calls(call, copies, args.rounds)
        record[f"{path}_ms"] = round(ms, 3)
        record[f"{path}_GB_s"] = round(out_features * in_features / ms / 1e6, 1)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,4,8,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--megabytes", type=float, default=600)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--library", type=Path, help="another build of the extension")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.library is not None:
        torch.ops.load_library(str(args.library))
        ops = torch.ops.pagedllm
    else:
        ops = load()
    torch.manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        for name, shape in projections(SHAPES[args.shape]).items():
            print(json.dumps(measure(name, shape, rows, args, ops)), flush=True)


if __name__ == "__main__":
    main()
