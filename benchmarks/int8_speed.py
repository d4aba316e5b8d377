"""Speed of `quantization="int8"`: per-shape matmul rates, and W1 with and without it.

    .venv/bin/python -m benchmarks.int8_speed matmul [--rows 1,16,64,256,2048]
    .venv/bin/python -m benchmarks.int8_speed w1 [--rounds 2] [--variants fp32,int8]

`matmul` times each candidate kernel at SmolLM2-135M's shapes (fused q/k/v, o, fused
gate/up, down, and the tied head) against fp32 `F.linear`: the smallest time over many
interleaved rounds, so a busy machine slows every candidate alike and the minimum stays
near the quiet figure. Candidates: our `Int8Linear` (`int8`: fbgemm, per-channel weights,
each row scaled to max |x| = 1, 8-bit activations on VNNI CPUs); fbgemm's call alone
(`tensor`: one activation scale per batch, what `int8` adds its per-row scaling to); the
same with `reduce_range` (`tensor_rr`: 7-bit activations, what non-VNNI CPUs need);
`torch.ao.nn.quantized.dynamic.Linear` (`ao_dyn`); the onednn engine's packed weights
(`onednn`); and `torch._int_mm` with per-row symmetric activations quantized by hand.

`w1` runs `pagedllm bench throughput --num-prompts 64 --input-len 256 --output-len 128`
alternately without and with `--quantization int8` (`--variants fp32,int8,gguf,int8/fp32head`
adds `--quantization gguf` and int8 with the head left fp32, patched in here) and prints each
run and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.model.layers.quantization import Int8Linear, quantize_weight

BIN = Path(sys.executable).parent
# (input features, output features) of SmolLM2-135M's matmuls; 30 layers of the first four.
SHAPES = {
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}
NUM_LAYERS = 30
CANDIDATES = ("int8", "tensor", "tensor_rr", "ao_dyn", "onednn", "int_mm")


def min_time(fns: dict[str, Callable[[], object]], rounds: int, target_s: float = 0.003):
    """Smallest seconds per call of each function, over `rounds` interleaved batches."""
    repeats = {}
    for name, fn in fns.items():
        fn()
        started = time.perf_counter()
        fn()
        repeats[name] = max(1, int(target_s / max(time.perf_counter() - started, 1e-7)))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            started = time.perf_counter()
            for _ in range(repeats[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - started) / repeats[name])
    return best


def _engine_packed(weight: torch.Tensor, engine: str):
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        return torch.ops.quantized.linear_prepack(quantize_weight(weight), None)
    finally:
        torch.backends.quantized.engine = previous


def _ao_linear(weight: torch.Tensor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        layer = DynamicLinear(weight.shape[1], weight.shape[0], dtype=torch.qint8)
        layer.set_weight_bias(quantize_weight(weight), None)
    return layer


def _int_mm(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    scales = weight.abs().amax(dim=1) / 127
    qweight = torch.round(weight / scales[:, None]).to(torch.int8).t().contiguous()

    def forward(x: torch.Tensor) -> torch.Tensor:
        x_scales = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
        qx = torch.round(x / x_scales).to(torch.int8)
        return torch._int_mm(qx, qweight).float() * x_scales * scales

    return forward


def candidates(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    ours = Int8Linear(weight, None)
    onednn = _engine_packed(weight, "onednn")
    ao = _ao_linear(weight)
    int_mm = _int_mm(weight)
    fns = {
        "fp32": lambda: F.linear(x, weight),
        "int8": lambda: ours(x),
        "tensor": lambda: torch.ops.quantized.linear_dynamic(x, ours._packed, ours.reduce_range),
        "tensor_rr": lambda: torch.ops.quantized.linear_dynamic(x, ours._packed, True),
        "ao_dyn": lambda: ao(x),
        "onednn": lambda: torch.ops.quantized.linear_dynamic(x, onednn, ours.reduce_range),
    }
    if x.shape[0] >= 16:  # _int_mm wants more than 16 rows on some builds
        fns["int_mm"] = lambda: int_mm(x)
    return fns


def run_matmul(rows: list[int], rounds: int) -> dict:
    torch.manual_seed(0)
    results: dict = {}
    reduce_range = Int8Linear(torch.ones(1, 1), None).reduce_range
    print(f"threads={torch.get_num_threads()} reduce_range={reduce_range}")
    header = f"{'shape':8s} {'rows':>5s}  fp32 ms  " + "  ".join(f"{n:>8s}" for n in CANDIDATES)
    print(header + "   (speed-up over fp32)")
    with torch.inference_mode():
        for shape, (k, n) in SHAPES.items():
            weight = torch.randn(n, k) * 0.05
            for m in rows:
                if shape == "lm_head" and m > 256:
                    continue  # the head only sees the rows that sample
                times = min_time(candidates(weight, torch.randn(m, k)), rounds)
                results[f"{shape}/{m}"] = times
                ratios = "  ".join(
                    f"{times['fp32'] / times[c]:8.2f}" if c in times else f"{'-':>8s}"
                    for c in CANDIDATES
                )
                print(f"{shape:8s} {m:5d} {times['fp32'] * 1e3:8.3f}  {ratios}", flush=True)
    _print_per_step(results, rows)
    return results


def _print_per_step(results: dict, rows: list[int]) -> None:
    """One step's matmuls: 30 layers' four, plus the head where timed (rows <= 256)."""
    print("\nOne step's matmuls (ms): rows, fp32, int8, speed-up (head included up to 256 rows)")
    for m in rows:
        shapes = [s for s in SHAPES if f"{s}/{m}" in results]
        fp32 = sum(_layers(s) * results[f"{s}/{m}"]["fp32"] for s in shapes)
        int8 = sum(_layers(s) * results[f"{s}/{m}"]["int8"] for s in shapes)
        print(f"{m:5d} {fp32 * 1e3:9.2f} {int8 * 1e3:9.2f} {fp32 / int8:6.2f}x")


def _layers(shape: str) -> int:
    return 1 if shape == "lm_head" else NUM_LAYERS


W1_ARGS = ["bench", "throughput", "--num-prompts", "64", "--input-len", "256"]
W1_ARGS += ["--output-len", "128", "--disable-log-stats"]
# Variant -> the command before W1_ARGS, and its extra flags.
W1_VARIANTS = {
    "fp32": ([str(BIN / "pagedllm")], []),
    "int8": ([str(BIN / "pagedllm")], ["--quantization", "int8"]),
    "gguf": ([str(BIN / "pagedllm")], ["--quantization", "gguf"]),
    # The head left fp32: an fp32 engine quantized by this script with quantize_head=False.
    "int8/fp32head": ([sys.executable, "-m", "benchmarks.int8_speed", "fp32-head-child"], []),
}


def _steal_s() -> float:
    """CPU time the hypervisor gave to other guests (all cores, /proc/stat), in seconds."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def _w1_once(variant: str, extra: list[str]) -> dict:
    """One run's report, plus its CPU seconds and the steal time seen meanwhile: a VM's
    neighbours can slow a run without any process here being busy."""
    prefix, flags = W1_VARIANTS[variant]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    steal_before = _steal_s()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [*prefix, *W1_ARGS, *flags, "--output-json", out.name, *extra]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = json.loads(Path(out.name).read_text())
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result["cpu_s"] = round(
        cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime, 1
    )
    result["steal_s"] = round(_steal_s() - steal_before, 1)
    return result


def run_w1(rounds: int, variants: list[str], extra: list[str]) -> dict:
    """Each round runs every variant, in reverse order on odd rounds."""
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for index in range(rounds):
        for variant in variants if index % 2 == 0 else variants[::-1]:
            result = _w1_once(variant, extra)
            runs[variant].append(result)
            print(
                f"round {index} {variant:9s}: {result['elapsed_s']:7.2f} s  "
                f"{result['output_tokens_per_s']:7.1f} output tok/s  "
                f"{result['total_tokens_per_s']:7.1f} total tok/s  "
                f"cpu {result['cpu_s']:6.1f} s  steal {result['steal_s']:5.1f} s",
                flush=True,
            )
    for variant, results in runs.items():
        elapsed = statistics.median(r["elapsed_s"] for r in results)
        output = statistics.median(r["output_tokens_per_s"] for r in results)
        total = statistics.median(r["total_tokens_per_s"] for r in results)
        print(f"median {variant:9s}: {elapsed:.2f} s, {output:.1f} output tok/s, {total:.1f} total")
    return runs


def fp32_head_child(argv: list[str]) -> int:
    """`pagedllm <argv>` on an fp32 engine quantized here with its head left fp32."""
    from pagedllm.entrypoints import bench_cli, cli
    from pagedllm.model.layers.quantization import quantize_model

    build = bench_cli.llm_from_args

    def build_int8_fp32_head(namespace, model=None):
        llm = build(namespace, model)
        quantize_model(
            llm.model_runner.model,
            "int8",
            quantize_head=False,
        )
        return llm

    bench_cli.llm_from_args = build_int8_fp32_head
    return cli.main(argv)


def main() -> None:
    if sys.argv[1:2] == ["fp32-head-child"]:
        sys.exit(fp32_head_child(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["matmul", "w1"])
    parser.add_argument(
        "--variants", default="fp32,int8", help=f"w1: any of {','.join(W1_VARIANTS)}"
    )
    parser.add_argument("--rows", default="1,16,64,256,2048")
    parser.add_argument("--rounds", type=int, default=None, help="matmul: 30; w1: 2")
    parser.add_argument(
        "--threads", type=int, default=None, help="matmul: torch threads (default: torch's)"
    )
    parser.add_argument("--output-json", default=None)
    args, extra = parser.parse_known_args()
    if args.mode == "matmul":
        if args.threads:
            # One thread shrugs off a busy machine better: no barrier waits on a descheduled
            # peer thread; the int8/fp32 ratios are what matter here.
            torch.set_num_threads(args.threads)
        rows = [int(r) for r in args.rows.split(",")]
        result = run_matmul(rows, args.rounds or 30)
    else:
        result = run_w1(args.rounds or 2, args.variants.split(","), extra)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
