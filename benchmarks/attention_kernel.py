"""One layer's attention call, "torch" (gather + SDPA) vs "cpu" (C++ kernel on the paged blocks).

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, block_size 16, an fp32 cache
unless `--kv-cache-dtype` says otherwise): decode batches of 64 and 256 sequences x
320-token contexts, and prefill chunks (fresh and after cached tokens) including a long
prompt's first two 2048-token chunks and one of eight 256-token prompts (the step
breakdown's prefill chunk). Prints ms per call, median and minimum of the repeats (on a
shared machine the minimum is the better guide), and torch/cpu of the medians. Blocks are
scattered over the cache as after a while of serving. A bf16 cache comes with a bf16 model's
bf16 queries, and where the kernel selection gives a bf16 model tiles (AMX-BF16, or
AVX512-BF16 dot products at least at the FMA rate) a third column times the kernel on them
as that model runs it ("cpu tiles", `KernelSelection.attention_tiles`) and cpu/tiles.

    .venv/bin/python -m benchmarks.attention_kernel [--repeats 20] [--threads N]
        [--kv-cache-dtype float16|int8|float8_e4m3fn|...]
        [--cases "decode 256 x 320,prefill 8 x 256 fresh"]
        [--sliding-window 512]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch

from pagedllm.ops import extension
from pagedllm.ops.attention import AttentionBackend, AttentionLayout
from pagedllm.ops.attention_registry import get_attention_backend
from pagedllm.ops.kernel_selection import select_kernels
from pagedllm.ops.kv_quant import is_quantized, quantize
from pagedllm.utils import cdiv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_step(requests: list[tuple[int, int]], seed: int = 0, dtype=torch.float32):
    """(q, k, v, kv_cache, layout) for [(tokens cached, tokens scheduled)] per request; each
    backend builds its own metadata from the layout."""
    rng = random.Random(seed)
    seq_lens = [cached + scheduled for cached, scheduled in requests]
    needed = [cdiv(n, BLOCK_SIZE) for n in seq_lens]
    num_blocks = 1 + sum(needed)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    width = max(needed)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    if is_quantized(dtype):  # int8 / fp8: values and scales (ops/kv_quant.py)
        (k_values, k_scale), (v_values, v_scale) = (
            quantize(torch.randn(shape), dtype) for _ in range(2)
        )
        kv_cache = (k_values, v_values, k_scale, v_scale)
    slots = [
        table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for (cached, scheduled), table in zip(requests, tables, strict=True)
        for p in range(cached, cached + scheduled)
    ]
    query_lens = [scheduled for _, scheduled in requests]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    layout = AttentionLayout(
        slot_mapping=np.array(slots, dtype=np.int64),
        block_tables=np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64),
        query_start_loc=np.array(starts, dtype=np.int64),
        seq_lens=np.array(seq_lens, dtype=np.int64),
    )
    num_tokens = len(slots)
    # A bf16 cache is a bf16 model's: its q, k and v are bf16 too.
    io_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM).to(io_dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(io_dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(io_dtype)
    return q, k, v, kv_cache, layout


def time_call(
    backend: AttentionBackend, step, repeats: int, window: int | None = None
) -> tuple[float, float]:
    """(median, min) ms per forward (the backend's metadata, built once per step for all
    layers, is not timed)."""
    q, k, v, kv_cache, layout = step
    metadata = backend.build_metadata(layout, torch.device("cpu"))
    scale = HEAD_DIM**-0.5
    backend.forward(q, k, v, kv_cache, metadata, scale, window)  # warm-up: page faults, buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.forward(q, k, v, kv_cache, metadata, scale, window)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def cases() -> dict[str, list[tuple[int, int]]]:
    return {
        "decode 64 x 320": [(319, 1)] * 64,
        "decode 256 x 320": [(319, 1)] * 256,
        "decode 64 mixed 1..640": [(random.Random(i).randrange(0, 640), 1) for i in range(64)],
        "prefill 128 fresh": [(0, 128)],
        "prefill 256 after 512 cached": [(512, 256)],
        "prefill 512 fresh": [(0, 512)],
        "prefill 8 x 256 fresh": [(0, 256)] * 8,
        "prefill 2048 fresh": [(0, 2048)],
        "prefill 2048 after 2048 cached": [(2048, 2048)],
        "64 decodes + 256-token chunk": [(319, 1)] * 64 + [(256, 256)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--kv-cache-dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2"],
    )
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument(
        "--sliding-window", type=int, default=None, help="each query sees this many keys at most"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.kv_cache_dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    extension.build()
    backends = {name: get_attention_backend(name) for name in ("torch", "cpu")}
    # The engine a bf16 model of these shapes gets on this CPU, if any.
    engine = select_kernels(
        "cpu", torch.bfloat16, "cpu", head_dim=HEAD_DIM, cache_dtype=torch.bfloat16
    ).attention_tiles
    if dtype == torch.bfloat16 and engine is not None:
        backends["cpu tiles"] = get_attention_backend("cpu", tiles=engine)
    print(
        f"threads={torch.get_num_threads()}  repeats={args.repeats}  "
        f"cache {args.kv_cache_dtype}  window {args.sliding_window}  (one layer, ms/call)"
    )
    tiles_header = f" {'cpu tiles median/min':>20} {'cpu/tiles':>9}"
    tiles_header = tiles_header if "cpu tiles" in backends else ""
    print(
        f"{'case':30} {'torch median/min':>18} {'cpu median/min':>18} {'torch/cpu':>10}"
        + tiles_header
    )
    wanted = None if args.cases is None else set(args.cases.split(","))
    for name, requests in cases().items():
        if wanted is not None and name not in wanted:
            continue
        step = make_step(requests, dtype=dtype)
        ms = {
            label: time_call(backend, step, args.repeats, args.sliding_window)
            for label, backend in backends.items()
        }
        ratio = ms["torch"][0] / ms["cpu"][0]
        torch_ms, cpu_ms = (f"{m[0]:8.2f} /{m[1]:8.2f}" for m in (ms["torch"], ms["cpu"]))
        tiles = ""
        if "cpu tiles" in ms:
            tiles_ms = ms["cpu tiles"]
            tiles = f" {tiles_ms[0]:10.2f} /{tiles_ms[1]:8.2f} {ms['cpu'][0] / tiles_ms[0]:8.2f}x"
        print(f"{name:30} {torch_ms:>18} {cpu_ms:>18} {ratio:9.2f}x{tiles}")


if __name__ == "__main__":
    main()
