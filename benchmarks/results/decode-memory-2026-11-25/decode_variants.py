"""Throw-away builds of the decode loop, to find what bounds decode attention (2026-11-25).

Each variant is `pagedllm/ops/csrc/paged_attention.cpp` as of commit eb3446c, rewritten by
text substitution and compiled under its own op namespace, then timed on one layer's decode
of 256 sequences x 320 tokens (fp32 cache, copied into memory advised MADV_HUGEPAGE as the
engine's pool is). Variant tags, joined with "+":

    pf0 no software prefetch   pf1 prefetch the next block into L2 (as served)
    pf2 prefetch into L1       pf3 prefetch with the T2 hint
    st128 / st256              prefetch one line in two / in four
    to1 no arithmetic: each row loads one float per cache line of its K and V stripes, in
        the kernel's order, prefetches unchanged
    to2 no arithmetic: the block's K, then V, read once, whole and in address order

Layouts: "scattered" (the benchmark's shuffled block ids), "contiguous" (each sequence's
blocks adjacent and in order), "one" (every table entry the same block: data in L1).

    .venv/bin/python benchmarks/results/decode-memory-2026-11-25/decode_variants.py \
        --variants pf1,to1,to2 --layout scattered --rounds 2

The substitutions assert their anchors; at a later commit they may no longer apply.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CSRC = REPO / "pagedllm" / "ops" / "csrc"
BUILD_ROOT = Path("/tmp/pagedllm-decode-variants")
DEFINES = {"pf": "PF_MODE", "st": "PF_STEP", "to": "TOUCH_ONLY"}

SWITCHES = """#ifndef PF_STEP
#define PF_STEP 64
#endif
#ifndef PF_MODE
#define PF_MODE 1
#endif
#if PF_MODE == 0
#define PF_PREFETCH(a) ((void)0)
#elif PF_MODE == 2
#define PF_PREFETCH(a) _mm_prefetch((a), _MM_HINT_T0)
#elif PF_MODE == 3
#define PF_PREFETCH(a) _mm_prefetch((a), _MM_HINT_T2)
#else
#define PF_PREFETCH(a) _mm_prefetch((a), _MM_HINT_T1)
#endif
namespace {"""

ATTEND = (
    "      attend_block<NV>(p.key_cache + offset, p.value_cache + offset, "
    "p.token_stride, valid, r,\n                       s);"
)

TOUCH = (
    """#if defined(TOUCH_ONLY) && TOUCH_ONLY == 2
      if (r == 0) {
        float t = 0;
        const int64_t n = static_cast<int64_t>(valid) * p.token_stride;
        for (int64_t e = 0; e < n; e += 64 / sizeof(T)) t += float(p.key_cache[block + e]);
        for (int64_t e = 0; e < n; e += 64 / sizeof(T)) t += float(p.value_cache[block + e]);
        s.acc[0] += t;
      }
#elif defined(TOUCH_ONLY)
      {
        float t = 0;
        for (int j = 0; j < valid; ++j) {
          for (int e = 0; e < NV * 8; e += 64 / sizeof(T)) {
            const int64_t at = offset + j * p.token_stride + e;
            t += float(p.key_cache[at]) + float(p.value_cache[at]);
          }
        }
        s.acc[r * NV * 8] += t;
      }
#else
"""
    + ATTEND
    + "\n#endif"
)


def substitute(src: str, old: str, new: str, count: int = -1) -> str:
    assert old in src, f"anchor not found: {old[:60]!r}"
    return src.replace(old, new, count)


def variant_source(name: str) -> str:
    src = (CSRC / "paged_attention.cpp").read_text()
    src = substitute(src, "TORCH_LIBRARY(pagedllm,", f"TORCH_LIBRARY({name},")
    src = substitute(src, "TORCH_LIBRARY_IMPL(pagedllm,", f"TORCH_LIBRARY_IMPL({name},")
    src = substitute(src, "_mm_prefetch(row + offset, _MM_HINT_T1);", "PF_PREFETCH(row + offset);")
    src = substitute(src, "offset += 64)", "offset += PF_STEP)")
    src = substitute(src, "namespace {", SWITCHES, 1)
    return substitute(src, ATTEND, TOUCH)


def build(tag: str):
    import torch
    from torch.utils.cpp_extension import load

    name = "pa_" + tag.replace("+", "_")
    directory = BUILD_ROOT / name
    (directory / "build").mkdir(parents=True, exist_ok=True)
    shutil.copy(CSRC / "vec_avx2.h", directory / "vec_avx2.h")
    (directory / "paged_attention.cpp").write_text(variant_source(name))
    defines = [f"-D{DEFINES[t[:2]]}={t[2:]}" for t in tag.split("+") if t[:2] in DEFINES]
    load(
        name=name,
        sources=[str(directory / "paged_attention.cpp")],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", *defines],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory / "build"),
        is_python_module=False,
    )
    return getattr(torch.ops, name)


def time_variant(tag: str, layout: str, batch: int, context: int, repeats: int) -> float:
    """Median ms of one call."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from attention_kernel import HEAD_DIM, make_step

    from pagedllm.worker.huge_pages import _advised_arena

    ops = build(tag)
    q, _, _, kv_cache, metadata = make_step([(context - 1, 1)] * batch)
    tables = metadata.kernel_block_tables
    if layout == "contiguous":
        num_blocks = tables.shape[1]
        tables = torch.arange(1, 1 + batch * num_blocks, dtype=torch.int32).view(batch, -1)
    elif layout == "one":
        tables = torch.ones_like(tables)

    def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
        arena = torch.from_numpy(_advised_arena(tensor.nbytes))
        return arena.view(tensor.dtype).view(tensor.shape).copy_(tensor)

    key_cache, value_cache = (on_huge_pages(t) for t in kv_cache)
    out = torch.empty(q.shape)

    def call() -> None:
        ops.paged_attention(
            out,
            q,
            key_cache,
            value_cache,
            tables,
            metadata.kernel_query_start_loc,
            metadata.kernel_seq_lens,
            HEAD_DIM**-0.5,
        )

    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="pf1,to1,to2")
    parser.add_argument("--layout", default="scattered", choices=["scattered", "contiguous", "one"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.one:
        print(time_variant(args.one, args.layout, args.batch, args.context, args.repeats))
        return
    tags = args.variants.split(",")
    results: dict[str, list[float]] = {tag: [] for tag in tags}
    for round_index in range(args.rounds):
        # Each variant in its own process, the order reversed every other round.
        for tag in tags if round_index % 2 == 0 else tags[::-1]:
            child = [
                sys.executable,
                __file__,
                "--one",
                tag,
                "--layout",
                args.layout,
                "--batch",
                str(args.batch),
                "--context",
                str(args.context),
                "--repeats",
                str(args.repeats),
            ]
            output = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            results[tag].append(float(output.split()[-1]))
    print(f"decode {args.batch} x {args.context}, fp32 cache, {args.layout} blocks, ms")
    for tag, values in results.items():
        rounded = [round(v, 2) for v in values]
        print(f"{tag:10} median {statistics.median(values):6.2f}  {rounded}")


if __name__ == "__main__":
    main()
