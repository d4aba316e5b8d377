"""A packed checkpoint's layer (GPTQ-style 4-bit, groups of 32, zero points) on the gguf
kernel: the compact tables (fp16 scales, uint8 zero points) against fp32 scale and min
tables, side by side, and the time to build the layer from its unpacked integers.

One Llama-3.2-1B projection (`--out` x `--in`, default gate_proj 8192 x 2048) with random
q, fp16 scales and integer zero points. For each row count of `--rows` the two table forms
run alternately, `--rounds` rounds of `--repeats` calls each; printed: the median ms of
each form over all rounds, and the machine's load average before and after (the machine is
shared: compare the forms within one run only; one thread unless `--threads`). With
`--fp32-only` only the fp32 form runs, through the kernel's op directly: run under another
checkout's PYTHONPATH, it times that checkout's kernel on the same weights.

    .venv/bin/python -m benchmarks.packed_tables [--rows 1,32] [--rounds 5] [--repeats 20]
        [--out 8192] [--in 2048] [--threads 1] [--fp32-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

GROUP = 32


def _random_weights(out_features: int, in_features: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    groups = in_features // GROUP
    q = torch.randint(0, 16, (out_features, in_features), generator=generator).to(torch.uint8)
    scales = (torch.rand(out_features, groups, generator=generator) * 2e-3 + 1e-3).half()
    zeros = torch.randint(0, 16, (out_features, groups), generator=generator).float()
    return q, scales.float(), zeros


def _fp32_call(q, scales, zeros, rows: int) -> Callable[[], object]:
    from pagedllm.model.layers.gguf_linear import pack_q, per_tile
    from pagedllm.ops.cpu_features import gguf_kernel_isa
    from pagedllm.ops.extension import load

    ops, packed = load(), pack_q(q, 4)
    d, m = per_tile(scales), per_tile(-scales * zeros)
    x = torch.randn(rows, q.shape[1])
    out = torch.empty(rows, q.shape[0])
    isa, shift = gguf_kernel_isa(), (GROUP // 32).bit_length() - 1
    return lambda: ops.gguf_linear(out, x, packed, d, m, 4, 2, isa, shift)


def _compact_call(q, scales, zeros, rows: int) -> tuple[Callable[[], object], float]:
    from pagedllm.model.layers.gptq_linear import GPTQLinear
    from pagedllm.model.quantization.gptq_format import UnpackedGPTQ

    started = time.perf_counter()
    layer = GPTQLinear(UnpackedGPTQ(q, scales, zeros, None, GROUP))
    build_s = time.perf_counter() - started
    x = torch.randn(rows, q.shape[1])
    return (lambda: layer(x)), build_s


def _seconds(call: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=int, default=8192)
    parser.add_argument("--in", dest="inputs", type=int, default=2048)
    parser.add_argument("--fp32-only", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="1: a shared machine's threads "
        "wait on each other's time slices (20 ms medians at load 7 on 2 cores)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = _random_weights(args.out, args.inputs)
    result = {"shape": [args.out, args.inputs], "threads": args.threads, "ms": {}}
    result["load_before"] = os.getloadavg()
    for rows in (int(r) for r in args.rows.split(",")):
        calls = {"fp32 tables": _fp32_call(*weights, rows)}
        if not args.fp32_only:
            calls["compact tables"], result["layer_build_s"] = _compact_call(*weights, rows)
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():
            call()  # warm-up
        for _ in range(args.rounds):
            for name, call in calls.items():
                samples[name] += _seconds(call, args.repeats)
        result["ms"][rows] = {n: round(statistics.median(s) * 1e3, 3) for n, s in samples.items()}
    result["load_after"] = os.getloadavg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
