"""The quantized KV cache (int8, fp8 e4m3 / e5m2; `ops/kv_quant.py`): the C++ write stores the
same bits as the torch quantization, and the kernel reading the 8-bit blocks in place equals
attention over the dequantized cache (and so does the torch backend), prefill and decode,
GQA, odd block sizes, sliding windows; neither ever reads the null block."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from pagedllm.ops.attention import AttentionLayout, write_kv_cache
from pagedllm.ops.cpu_attention import CpuAttentionBackend, kernel_covers
from pagedllm.ops.kv_quant import QUANT_MAX, dequantize, kv_cache_entry, quantize
from pagedllm.ops.torch_attention import TorchAttentionBackend
from pagedllm.utils import cdiv

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the kernel needs AVX2 and FMA",
)

DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# Against the dequantized cache only the order of the float operations differs (the kernel
# scales a key's dot product, the reference the key): measured at most 2.4e-6.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.itemsize == 1 else tensor


def make_step(requests, *, block_size, num_heads, num_kv_heads, dtype, head_dim=64, seed=0):
    """(q, k, v, cache, layout) for [(tokens cached, tokens scheduled)], each request's blocks
    scattered over a random quantized cache (block 0, the null block, is never a table's)."""
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    seq_lens = [cached + scheduled for cached, scheduled in requests]
    needed = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = 1 + sum(needed)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_values, k_scale = quantize(torch.randn(shape, generator=generator), dtype)
    v_values, v_scale = quantize(torch.randn(shape, generator=generator), dtype)
    slots = [
        table[p // block_size] * block_size + p % block_size
        for (cached, scheduled), table in zip(requests, tables, strict=True)
        for p in range(cached, cached + scheduled)
    ]
    width = max(needed)
    layout = AttentionLayout(
        slot_mapping=np.array(slots, dtype=np.int64),
        block_tables=np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64),
        query_start_loc=np.array(
            [0, *itertools.accumulate(s for _, s in requests)], dtype=np.int64
        ),
        seq_lens=np.array(seq_lens, dtype=np.int64),
    )
    # Peaked scores (3x) make the running max move, which exercises the rescaling.
    q = 3 * torch.randn(len(slots), num_heads, head_dim, generator=generator)
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator)
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator)
    return q, k, v, (k_values, v_values, k_scale, v_scale), layout


def dense_reference(q, cache, layout, scale, window=None):
    """Causal (windowed) attention by explicit softmax over the dequantized cache."""
    keys_all = dequantize(cache[0], cache[2], torch.float32)
    values_all = dequantize(cache[1], cache[3], torch.float32)
    block_size, group = keys_all.shape[1], q.shape[1] // keys_all.shape[2]
    out = torch.empty_like(q)
    for req, seq_len in enumerate(layout.seq_lens.tolist()):
        start, end = layout.query_start_loc[req], layout.query_start_loc[req + 1]
        table = torch.from_numpy(layout.block_tables[req, : cdiv(seq_len, block_size)])
        keys = keys_all[table].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
        values = values_all[table].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
        positions = torch.arange(seq_len - (end - start), seq_len)[:, None]
        key_positions = torch.arange(seq_len)[None]
        visible = key_positions <= positions
        if window is not None:
            visible &= key_positions > positions - window
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * scale
        weights = scores.masked_fill(~visible, -math.inf).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, values)
    return out


def run(backend, q, k, v, cache, layout, window=None):
    """(output, cache after the step's write) on a private copy of the cache."""
    cache = tuple(c.clone() for c in cache)
    metadata = backend.build_metadata(layout, torch.device("cpu"))
    return backend.forward(q, k, v, cache, metadata, q.shape[-1] ** -0.5, window), cache


@pytest.fixture(scope="module")
def cpu_backend() -> CpuAttentionBackend:
    return CpuAttentionBackend()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_write_stores_the_torch_quantization(cpu_backend, dtype):
    """Same bits as `kv_quant.quantize`: rows of every magnitude (down to the fp8 subnormals
    and values that round to zero), an all-zero row, strided k/v slices of a fused qkv."""
    generator = torch.Generator().manual_seed(0)
    num_tokens, heads, head_dim = 40, 3, 64
    qkv = torch.randn(num_tokens, 3 * heads * head_dim, generator=generator)
    # Each row spans ~12 binades: its small values land on the fp8 subnormals or zero.
    qkv *= torch.logspace(-6, 6, qkv.shape[1], base=2.0)[torch.randperm(qkv.shape[1])]
    qkv *= torch.logspace(-20, 20, num_tokens)[:, None]
    qkv[3] = 0
    k = qkv[:, heads * head_dim : 2 * heads * head_dim].view(num_tokens, heads, head_dim)
    v = qkv[:, 2 * heads * head_dim :].view(num_tokens, heads, head_dim)
    slots = torch.randperm(64)[:num_tokens]
    shape = (4, 16, heads, head_dim)
    kernel = kv_cache_entry(shape, dtype, lambda s, d: torch.zeros(s, dtype=d))
    reference = tuple(c.clone() for c in kernel)
    torch.ops.pagedllm.write_kv_cache(kernel[0], kernel[1], k, v, slots, *kernel[2:])
    write_kv_cache(k, v, reference, slots)
    for got, want in zip(kernel, reference, strict=True):
        assert torch.equal(bits(got), bits(want))
    values, scale = reference[0].flatten(0, 1)[slots], reference[2].flatten(0, 1)[slots]
    assert torch.equal(scale, k.abs().amax(-1) / QUANT_MAX[dtype])
    assert bits(values[3]).count_nonzero() == 0  # the zero row: zeros, scale 0, no NaN
    # Round trip: int8 within half a step of each row's absmax; fp8 within its relative step
    # (3 / 2 mantissa bits) above the smallest normal, and its subnormal step below it.
    restored = dequantize(values, scale, torch.float32)
    relative = {torch.int8: 0.0, torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}[dtype]
    floor = {torch.int8: 0.5, torch.float8_e4m3fn: 2**-10, torch.float8_e5m2: 2**-17}[dtype]
    bound = (k.abs() * relative + floor * scale[..., None]) * (1 + 1e-5)  # + fp32 rounding
    assert ((restored - k).abs() <= bound).all()


CASES = {
    "prefill": [(0, 37)],
    "chunked prefill": [(40, 23), (0, 9)],
    "decodes": [(n, 1) for n in (1, 15, 16, 17, 70, 200)],
    "mixed": [(30, 1), (0, 50), (77, 1), (19, 12)],
    # Enough decodes that one work item takes all kv heads of a request.
    "many decodes": [(random.Random(i).randrange(0, 120), 1) for i in range(40)],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads"), [(16, 9, 3), (7, 4, 4), (32, 8, 1)]
)
def test_kernel_equals_attention_over_the_dequantized_cache(
    cpu_backend, dtype, case, block_size, num_heads, num_kv_heads
):
    q, k, v, cache, layout = make_step(
        CASES[case],
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
    )
    out, written = run(cpu_backend, q, k, v, cache, layout)
    reference = dense_reference(q, written, layout, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, reference, **TOLERANCE)
    torch_out, torch_written = run(TorchAttentionBackend(), q, k, v, cache, layout)
    torch.testing.assert_close(torch_out, reference, **TOLERANCE)
    for got, want in zip(written, torch_written, strict=True):
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("head_dim", [16, 80, 128, 256])
def test_kernel_head_dims(cpu_backend, head_dim):
    q, k, v, cache, layout = make_step(
        [(20, 1), (0, 30), (33, 1)],
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        dtype=torch.int8,
        head_dim=head_dim,
    )
    out, written = run(cpu_backend, q, k, v, cache, layout)
    torch.testing.assert_close(
        out, dense_reference(q, written, layout, head_dim**-0.5), **TOLERANCE
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [1, 6, 45])
def test_sliding_window_never_reads_the_null_block(cpu_backend, dtype, window):
    """Blocks wholly before each request's window are the null block, whose scales are NaN:
    both backends equal the dense windowed reference."""
    requests = [(0, 37), (30, 1), (50, 9), (100, 1)]
    q, k, v, cache, layout = make_step(
        requests, block_size=7, num_heads=4, num_kv_heads=2, dtype=dtype
    )
    reference = dense_reference(
        q, run(cpu_backend, q, k, v, cache, layout)[1], layout, 0.125, window
    )
    tables = layout.block_tables.copy()
    for req, (cached, _) in enumerate(requests):
        tables[req, : max(0, cached - window + 1) // 7] = 0
    layout = AttentionLayout(layout.slot_mapping, tables, layout.query_start_loc, layout.seq_lens)
    cache[2][0], cache[3][0] = math.nan, math.nan
    out, _ = run(cpu_backend, q, k, v, cache, layout, window)
    torch.testing.assert_close(out, reference, **TOLERANCE)
    # The torch reference pads short decodes with the null block and masks it: finite there.
    cache[2][0], cache[3][0] = 100.0, 100.0
    torch_out, _ = run(TorchAttentionBackend(), q, k, v, cache, layout, window)
    torch.testing.assert_close(torch_out, reference, **TOLERANCE)


def test_kernel_covers_the_8_bit_caches():
    assert all(kernel_covers(64, dtype) for dtype in DTYPES)


def test_a_quantized_cache_without_its_scales_is_refused(cpu_backend):
    q, k, v, cache, layout = make_step(
        [(3, 2)], block_size=16, num_heads=2, num_kv_heads=2, dtype=torch.int8
    )
    metadata = cpu_backend.build_metadata(layout, torch.device("cpu"))
    out = torch.empty_like(q)
    args = (metadata.block_tables, metadata.query_start_loc, metadata.seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="needs its key and value scales"):
        torch.ops.pagedllm.paged_attention(out, q, cache[0], cache[1], *args)
    with pytest.raises(RuntimeError, match="needs its key and value scales"):
        torch.ops.pagedllm.write_kv_cache(cache[0], cache[1], k, v, metadata.slot_mapping)
    with pytest.raises(RuntimeError, match="scales are for int8 / fp8 caches only"):
        torch.ops.pagedllm.paged_attention(
            out, q, cache[0].float(), cache[1].float(), *args, 0, cache[2], cache[3]
        )
