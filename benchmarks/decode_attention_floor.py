"""How close one layer's decode attention is to what memory allows: the kernel as served,
the kernel's arithmetic alone, and a plain read of the same bytes.

Decode attention reads every running sequence's K and V once per layer and does little
arithmetic per byte, so its time is bounded below by those bytes over the machine's read
bandwidth. Five timings per case (SmolLM2-135M shapes, `benchmarks.attention_kernel`'s
step builder, blocks scattered over the cache):

- served, N layers: the CPU kernel on N layers' caches in turn (`--layers`, each its own
  mapping like the engine's KV pool), ms a layer: the blocks come from memory, as in a
  decode step;
- in order, N layers: the same N layers with each sequence's blocks adjacent and in order
  (what a fresh pool hands a prompt), the blocks from memory;
- served: the CPU kernel on the scattered blocks of one layer, again and again (from cache);
- blocks in order: the same call with each sequence's blocks adjacent and in order in the
  cache (what a fresh pool hands a prompt's blocks), to show what the scattering costs;
- arithmetic alone: the same call with every block-table entry pointing at one block, so
  the data stays in L1 and only the arithmetic and loads remain;
- read floor: `torch.sum` over a contiguous fp32 tensor of as many bytes as the call reads
  (the K and V of every sequence), on the same threads; a sequential read, which the
  hardware prefetchers serve at their best.

    .venv/bin/python -m benchmarks.decode_attention_floor [--kv-cache-dtype float16]
        [--batch 256] [--context 320] [--repeats 30] [--threads 1] [--tiles amx]

`--tiles amx` (a bfloat16 cache on a CPU with AMX-BF16) or `--tiles bf16_dots` (AVX512-BF16)
times the kernel with its decodes on tiles, as a bf16 model runs it where the engine picks
that engine (`KernelSelection.attention_tiles`); `--amx-tiles` is `--tiles amx`.

`--threads 1` against the default (all cores) shows whether the call is bound by the
memory bus (it would barely slow down) or by each core's own misses (it would take up to
twice as long; 1.7× here: docs/performance.md, "What bounds decode attention").
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch

from benchmarks.attention_kernel import HEAD_DIM, NUM_KV_HEADS, make_step
from benchmarks.timing import median_seconds
from pagedllm.ops import extension
from pagedllm.ops.attention_registry import get_attention_backend
from pagedllm.runner.huge_pages import mapped_zeros


def on_pool_mapping(step):
    """The step with its caches copied onto a mapping like the engine's KV pool (huge pages
    where the kernel gives them): scattered blocks on small pages would time the TLB."""
    q, k, v, kv_cache, layout = step
    moved = []
    for cache in kv_cache:
        mapped = torch.from_numpy(mapped_zeros(cache.numel() * cache.element_size()))
        moved.append(mapped.view(cache.dtype).view(cache.shape).copy_(cache))
    return q, k, v, tuple(moved), layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--kv-cache-dtype", default="float32", choices=["float32", "float16", "bfloat16"]
    )
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument(
        "--tiles",
        choices=["amx", "bf16_dots"],
        default=None,
        help="the bf16 cache's tile path on this engine, as a bf16 model runs it",
    )
    parser.add_argument("--amx-tiles", action="store_const", const="amx", dest="tiles")
    parser.add_argument(
        "--layers",
        type=int,
        default=30,
        help="layers of the 'served, N layers' row (each its own cache on a mapping like the "
        "engine's KV pool), so the blocks come from memory rather than cache",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.kv_cache_dtype)
    extension.build()
    backend = get_attention_backend("cpu", tiles=args.tiles)
    shape = [(args.context - 1, 1)] * args.batch
    q, k, v, kv_cache, layout = make_step(shape, dtype=dtype)
    scale = HEAD_DIM**-0.5

    def metadata_for(block_tables):
        # Built once per variant, outside the timed calls (as the runner does once per step).
        replaced = dataclasses.replace(layout, block_tables=block_tables)
        return backend.build_metadata(replaced, torch.device("cpu"))

    metadata = metadata_for(layout.block_tables)

    def served(meta=metadata):
        backend.forward(q, k, v, kv_cache, meta, scale)

    one_block = metadata_for(np.full_like(layout.block_tables, 1))
    batch, width = layout.block_tables.shape
    in_order_tables = np.arange(1, 1 + batch * width).reshape(batch, width)
    in_order = metadata_for(in_order_tables)
    bytes_read = 2 * args.batch * args.context * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    stream = torch.ones(bytes_read // 4)
    layers = [on_pool_mapping(make_step(shape, seed=i, dtype=dtype)) for i in range(args.layers)]
    layer_metadata = [backend.build_metadata(step[4], torch.device("cpu")) for step in layers]

    layer_in_order = [
        backend.build_metadata(
            dataclasses.replace(step[4], block_tables=in_order_tables), torch.device("cpu")
        )
        for step in layers
    ]

    def served_layers(metadata_per_layer=layer_metadata):
        for (lq, lk, lv, cache, _), meta in zip(layers, metadata_per_layer, strict=True):
            backend.forward(lq, lk, lv, cache, meta, scale)

    results = {
        f"served, {args.layers} layers": 1e3
        * median_seconds(served_layers, max(3, args.repeats // args.layers))
        / args.layers,
        f"in order, {args.layers} layers": 1e3
        * median_seconds(lambda: served_layers(layer_in_order), max(3, args.repeats // args.layers))
        / args.layers,
        "served": 1e3 * median_seconds(served, args.repeats),
        "blocks in order": 1e3 * median_seconds(lambda: served(in_order), args.repeats),
        "arithmetic alone": 1e3 * median_seconds(lambda: served(one_block), args.repeats),
        "read floor": 1e3 * median_seconds(lambda: stream.sum(), args.repeats),
    }
    print(
        f"decode {args.batch} x {args.context}, cache {args.kv_cache_dtype}, "
        f"{bytes_read / 1e6:.0f} MB of K/V per call, threads={torch.get_num_threads()}"
    )
    for name, ms in results.items():
        print(f"{name:18} {ms:7.2f} ms  {bytes_read / ms / 1e6:6.1f} GB/s")
    print(f"served / read floor: {results['served'] / results['read floor']:.2f}")


if __name__ == "__main__":
    main()
