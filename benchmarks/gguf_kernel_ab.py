"""The GGUF kernel built from several source trees, timed side by side in one process.

Each `NAME=CSRC_DIR` (a copy of `pagedllm/ops/csrc` with a change in it, or a `git worktree`'s
of another commit) builds `gguf_linear.cpp` alone, ~20 s, with its ops registered under
`torch.ops.gguf_ab_NAME` instead of `torch.ops.pagedllm`, so all the builds load together.
Then, on a real shape's projections (`benchmarks.gguf_matmul`'s random Q4_K_M blocks), every
repeat calls each build once in turn: a machine whose speed drifts by a fifth within minutes
moves them all alike, and the medians compare. Each line also says whether a build's output
has the first build's bits (`=`) or not (`DIFF`).

    .venv/bin/python -m benchmarks.gguf_kernel_ab base=pagedllm/ops/csrc new=/tmp/csrc \\
        [--shape llama-3.2-1b] [--names gate+up,down,head] [--rows 8,32,256] [--threads 1]
        [--isa 1] [--as-type Q5_K]

Builds go to `~/.cache/pagedllm/gguf_kernel_ab/NAME` (rebuilt when their sources change).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from benchmarks.gguf_matmul import projections, random_layer
from benchmarks.random_gguf import SHAPES
from pagedllm.model.layers.gguf_linear import GGUFLinear
from pagedllm.ops import build_spec
from pagedllm.ops.cpu_features import gguf_kernel_isa

BUILD_ROOT = Path.home() / ".cache/pagedllm/gguf_kernel_ab"
KERNEL_SOURCE = "gguf_linear.cpp"


def namespaced_source(text: str, namespace: str) -> str:
    """gguf_linear.cpp's text with its ops registered under `namespace`."""
    renamed = text
    for macro in ("TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
        renamed = renamed.replace(f"{macro}(pagedllm,", f"{macro}({namespace},")
    if renamed.count(f"({namespace},") != text.count("(pagedllm,"):
        raise ValueError("the kernel source registers ops in a way this benchmark does not know")
    return renamed


def build(name: str, csrc: Path) -> object:
    """`torch.ops.gguf_ab_<name>`: the kernel of the tree `csrc`, built (or reused) apart."""
    from torch.utils.cpp_extension import load

    namespace = f"gguf_ab_{name}"
    directory = BUILD_ROOT / name
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / KERNEL_SOURCE
    text = namespaced_source((csrc / KERNEL_SOURCE).read_text(), namespace)
    if not source.exists() or source.read_text() != text:
        source.write_text(text)
    load(
        name=namespace, sources=[str(source)], extra_cflags=list(build_spec.CFLAGS),
        extra_ldflags=list(build_spec.LDFLAGS), extra_include_paths=[str(csrc.resolve())],
        build_directory=str(directory), is_python_module=False,
    )  # fmt: skip
    return getattr(torch.ops, namespace)


def interleaved_medians(calls: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each call, the calls taken in turn `repeats` times (the first turn,
    a warm-up, left out)."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(times[1:]) for name, times in seconds.items()}


def _on_build(layer: GGUFLinear, build_ops: object) -> GGUFLinear:
    """The layer (its tables shared) calling one build's ops: GGUFLinear.matmul_into keeps
    the choice of op and its arguments in one place."""
    twin = copy.copy(layer)
    twin._ops = build_ops
    return twin


def compare(ops: dict[str, object], args: argparse.Namespace) -> None:
    names = args.names.split(",")
    for name, n, k, qtype in projections(SHAPES[args.shape]):
        if name not in names:
            continue
        qtype = GGMLQuantizationType[args.as_type] if args.as_type else qtype
        layer = random_layer(n, k, qtype, args.digits)
        layer.isa = args.isa
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            outs = {build_name: torch.empty(rows, n) for build_name in ops}
            calls = {
                build_name: partial(_on_build(layer, build_ops).matmul_into, x, outs[build_name])
                for build_name, build_ops in ops.items()
            }
            medians = interleaved_medians(calls, args.repeats)
            first = next(iter(outs.values()))
            line = f"{name:8} {qtype.name} rows={rows:4d}"
            for build_name, seconds in medians.items():
                same = "=" if torch.equal(outs[build_name], first) else "DIFF"
                rate = 2 * rows * n * k / seconds / 1e9
                line += f" | {build_name} {seconds * 1e3:8.3f} ms {rate:5.0f} GOP/s {same}"
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="NAME=CSRC_DIR, the first the reference")
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--names", default="gate+up,down,head", help="projections to time")
    parser.add_argument("--rows", default="32")
    parser.add_argument("--digits", type=int, default=2, choices=[1, 2])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--isa", type=int, default=gguf_kernel_isa(), help="0 portable, 1 AVX2, 2 VNNI, 3 AMX"
    )
    parser.add_argument(
        "--as-type", choices=["Q4_K", "Q5_K", "Q6_K"], help="every projection as this K-quant"
    )
    args = parser.parse_args()
    builds = dict(spec.split("=", 1) for spec in args.builds)
    ops = {name: build(name, Path(csrc)) for name, csrc in builds.items()}
    torch.set_num_threads(args.threads)  # after the builds load: their OpenMP then takes it
    torch.manual_seed(0)
    print(f"{args.shape}: threads={args.threads}  digits={args.digits}  isa={args.isa}", flush=True)
    compare(ops, args)


if __name__ == "__main__":
    main()
