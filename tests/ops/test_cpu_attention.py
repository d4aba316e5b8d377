"""The "cpu" attention backend (C++ kernel on the paged blocks) equals the "torch" reference
on random paged caches: shared and scattered blocks, odd block sizes, GQA, decode, chunked
and mixed prefill; and greedy engine output is the same with either backend."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from model_utils import torch_threads

from pagedllm import LLM, SamplingParams
from pagedllm.ops import extension
from pagedllm.ops.attention import AttentionLayout, write_kv_cache
from pagedllm.ops.attention_registry import get_attention_backend
from pagedllm.ops.cpu_attention import CpuAttentionBackend, CpuAttentionMetadata, kernel_covers
from pagedllm.ops.cpu_features import cpu_features
from pagedllm.ops.torch_attention import TorchAttentionBackend, TorchAttentionMetadata
from pagedllm.utils import cdiv

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the kernel needs AVX2 and FMA",
)

# fp32 kernel vs SDPA: only the summation order differs.
FP32_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: tuple[torch.Tensor, torch.Tensor]
    layout: AttentionLayout
    scale: float


def make_batch(
    requests: list[tuple[int, int]],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    share_blocks: bool = True,
    seed: int = 0,
) -> Batch:
    """A step over `requests` = [(tokens already cached, tokens scheduled now)], with their
    blocks scattered over a random cache and, if `share_blocks`, full cached blocks shared
    between requests (as prefix caching does)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [cached + scheduled for cached, scheduled in requests]
    blocks_needed = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_needed) + 8  # block 0 is the null block of padded tables
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables: list[list[int]] = []
    for (cached, _), needed in zip(requests, blocks_needed, strict=True):
        table = []
        if share_blocks and tables and rng.random() < 0.5:
            donor_index = rng.randrange(len(tables))
            donor_full = requests[donor_index][0] // block_size
            table = tables[donor_index][: min(donor_full, cached // block_size)]
        table += [free.pop() for _ in range(needed - len(table))]
        tables.append(table)
    width = max(blocks_needed)
    block_tables = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    slots = [
        table[position // block_size] * block_size + position % block_size
        for (cached, scheduled), table in zip(requests, tables, strict=True)
        for position in range(cached, cached + scheduled)
    ]
    num_tokens = len(slots)
    # Peaked scores make the running max move, which exercises the rescaling.
    q = (3 * torch.randn(num_tokens, num_heads, head_dim, generator=generator)).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)

    query_lens = [scheduled for _, scheduled in requests]
    layout = AttentionLayout(
        slot_mapping=np.array(slots, dtype=np.int64),
        block_tables=block_tables,
        query_start_loc=np.array([0, *itertools.accumulate(query_lens)], dtype=np.int64),
        seq_lens=np.array(seq_lens, dtype=np.int64),
    )
    return Batch(q, k, v, (key_cache, value_cache), layout, head_dim**-0.5)


def widened(batch: Batch) -> Batch:
    """The same step in fp32: q, k, v and the cache widened exactly."""
    return Batch(
        batch.q.float(),
        batch.k.float(),
        batch.v.float(),
        tuple(c.float() for c in batch.kv_cache),
        batch.layout,
        batch.scale,
    )


def run_backend(backend, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Output and the cache after the step, on a private copy of the cache; the backend
    builds its own metadata from the batch's layout."""
    kv_cache = tuple(c.clone() for c in batch.kv_cache)
    metadata = backend.build_metadata(batch.layout, torch.device("cpu"))
    out = backend.forward(batch.q, batch.k, batch.v, kv_cache, metadata, batch.scale)
    return out, kv_cache


@pytest.fixture(scope="module")
def cpu_backend() -> CpuAttentionBackend:
    return CpuAttentionBackend()


def assert_matches_torch(cpu_backend, batch: Batch, **tolerance) -> None:
    expected, expected_cache = run_backend(TorchAttentionBackend(), batch)
    actual, actual_cache = run_backend(cpu_backend, batch)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **(tolerance or FP32_TOLERANCE))
    for got, want in zip(actual_cache, expected_cache, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def random_requests(rng: random.Random, count: int) -> list[tuple[int, int]]:
    """Decodes, fresh prefills and chunks after cached tokens; contexts of 1..300 tokens."""
    requests = []
    for _ in range(count):
        kind = rng.choice(["decode", "decode", "fresh", "chunk"])
        if kind == "decode":
            requests.append((rng.randrange(0, 300), 1))
        elif kind == "fresh":
            requests.append((0, rng.randrange(2, 80)))
        else:
            scheduled = rng.randrange(2, 60)
            requests.append((rng.randrange(1, 300 - scheduled), scheduled))
    return requests


# Prefill tiles take a block's keys 16 at a time: 7 is one partial slice, 32 two slices.
@pytest.mark.parametrize("block_size", [16, 7, 32])
# Query heads per kv head 1, 3, 8 and 5: a prefill tile has 48 rows (45 for 5) and takes
# them six at a time, so full tiles give groups of six and six-then-three, and short
# prompts' tiles the groups of one to five.
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 1), (10, 2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batches_match_torch(cpu_backend, block_size, num_heads, num_kv_heads, seed):
    requests = random_requests(random.Random(seed), 12)
    batch = make_batch(
        requests,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        seed=seed,
    )
    assert_matches_torch(cpu_backend, batch)


@pytest.mark.parametrize("block_size", [16, 7])
def test_decode_batch_matches_torch(cpu_backend, block_size):
    rng = random.Random(3)
    requests = [(rng.randrange(0, 300), 1) for _ in range(64)] + [(0, 1), (299, 1)]
    batch = make_batch(requests, block_size=block_size, num_heads=9, num_kv_heads=3)
    assert_matches_torch(cpu_backend, batch)


@pytest.mark.parametrize("threads", [1, 2])
def test_many_decodes_beside_prefills_match_torch(cpu_backend, threads):
    """Past 8 requests per thread a decode's kv heads go to one work item; prefill chunks in
    the same step keep one item per kv head and tile."""
    rng = random.Random(4)
    requests = [(rng.randrange(0, 200), 1) for _ in range(20)] + [(0, 37), (50, 20)]
    rng.shuffle(requests)
    batch = make_batch(requests, block_size=16, num_heads=9, num_kv_heads=3)
    with torch_threads(threads):
        assert_matches_torch(cpu_backend, batch)


@pytest.mark.parametrize("head_dim", [16, 32, 80, 128, 256])
def test_head_dims_match_torch(cpu_backend, head_dim):
    batch = make_batch(
        [(37, 1), (0, 23), (50, 17), (200, 1)],
        block_size=16,
        num_heads=6,
        num_kv_heads=2,
        head_dim=head_dim,
    )
    assert_matches_torch(cpu_backend, batch)


def test_long_prefill_chunks_match_torch(cpu_backend):
    requests = [(0, 300), (20, 1), (100, 301), (5, 9)]
    batch = make_batch(requests, block_size=16, num_heads=9, num_kv_heads=3)
    assert_matches_torch(cpu_backend, batch)


# 24: a full slice of 16 keys and a partial one, whose lanes past the block's end are NaN.
@pytest.mark.parametrize("block_size", [7, 24])
def test_never_reads_past_a_sequence(cpu_backend, block_size):
    """Slots past each sequence's end (and unused blocks) hold NaN; no output sees them."""
    batch = make_batch(
        [(13, 1), (0, 20), (40, 9), (6, 1)],
        block_size=block_size,
        num_heads=9,
        num_kv_heads=3,
        share_blocks=False,
    )
    expected, _ = run_backend(TorchAttentionBackend(), batch)
    poisoned = tuple(torch.full_like(c, math.nan) for c in batch.kv_cache)
    tables, block_size = batch.layout.block_tables, poisoned[0].shape[1]
    for req, seq_len in enumerate(batch.layout.seq_lens.tolist()):
        for position in range(seq_len):
            block = int(tables[req, position // block_size])
            for source, target in zip(batch.kv_cache, poisoned, strict=True):
                target[block, position % block_size] = source[block, position % block_size]
    batch.kv_cache = poisoned
    actual, _ = run_backend(cpu_backend, batch)
    torch.testing.assert_close(actual, expected, **FP32_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(cpu_backend, dtype):
    """bf16/fp16 caches are read as such and accumulated in fp32: the result is the fp32
    reference on the same (rounded) values, rounded once to `dtype`."""
    batch = make_batch(
        [(100, 1), (0, 30), (57, 12), (250, 1)],
        block_size=16,
        num_heads=9,
        num_kv_heads=3,
        dtype=dtype,
    )
    actual, _ = run_backend(cpu_backend, batch)
    expected, _ = run_backend(TorchAttentionBackend(), widened(batch))
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.to(dtype).float(), rtol=1e-2, atol=1e-3)


def test_bf16_queries_give_the_fp32_round_trips_bits(cpu_backend):
    """A bf16 model's queries and output stay bf16 through the kernel: the same bits as
    widening q to fp32 and rounding the fp32 output once, with no copies around the call."""
    batch = make_batch(
        [(100, 1), (0, 30), (57, 12), (250, 1)],
        block_size=16,
        num_heads=9,
        num_kv_heads=3,
        dtype=torch.bfloat16,
    )
    metadata = cpu_backend.build_metadata(batch.layout, torch.device("cpu"))
    kv_cache = tuple(c.clone() for c in batch.kv_cache)
    write_kv_cache(batch.k, batch.v, kv_cache, metadata.slot_mapping)  # as the step does
    # A strided view, as the query heads of a fused q/k/v output are.
    fused_qkv = torch.cat([batch.q, batch.q[:, :2]], dim=1)
    query = fused_qkv[:, :9]
    outputs = {}
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.empty(query.shape, dtype=dtype)
        extension.load().paged_attention(
            out,
            query.to(dtype),
            *kv_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            batch.scale,
            0,
        )
        outputs[dtype] = out
    assert torch.equal(outputs[torch.bfloat16], outputs[torch.float32].bfloat16())
    actual, _ = run_backend(cpu_backend, batch)
    assert torch.equal(actual, outputs[torch.bfloat16])


def test_kv_write_reads_strided_slices_of_fused_qkv(cpu_backend):
    """The model hands k and v over as column slices of the fused q/k/v output."""
    batch = make_batch([(30, 1), (0, 40), (17, 5)], block_size=16, num_heads=9, num_kv_heads=3)
    num_tokens, head_dim = batch.q.shape[0], batch.q.shape[2]
    fused = torch.cat([batch.q, batch.k, batch.v], dim=1).reshape(num_tokens, -1)
    q, k, v = fused.split([9 * head_dim, 3 * head_dim, 3 * head_dim], dim=1)
    batch.q, batch.k, batch.v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    assert not batch.k.is_contiguous()
    assert_matches_torch(cpu_backend, batch)


def test_kv_write_rejects_a_slot_outside_the_cache(cpu_backend):
    batch = make_batch([(0, 3)], block_size=16, num_heads=4, num_kv_heads=4)
    key_cache, value_cache = batch.kv_cache
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = torch.tensor([0, 1, num_slots])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.pagedllm.write_kv_cache(key_cache, value_cache, batch.k, batch.v, slots)


def test_kernel_covers_its_head_dims_and_cache_dtypes():
    assert kernel_covers(64, torch.float32) and kernel_covers(128, torch.bfloat16)
    assert not kernel_covers(24, torch.float32)
    assert not kernel_covers(64, torch.float64)


def test_each_backend_builds_only_its_own_metadata(cpu_backend):
    batch = make_batch([(10, 1), (0, 5), (3, 1)], block_size=16, num_heads=2, num_kv_heads=1)
    cpu = cpu_backend.build_metadata(batch.layout, torch.device("cpu"))
    assert type(cpu) is CpuAttentionMetadata
    assert all(isinstance(value, torch.Tensor) for value in vars(cpu).values())
    assert cpu.block_tables.dtype == cpu.seq_lens.dtype == torch.int32
    assert cpu.block_tables.shape == (3, 2)  # padded to two columns for torch.compile
    reference = TorchAttentionBackend().build_metadata(batch.layout, torch.device("cpu"))
    assert type(reference) is TorchAttentionMetadata
    assert reference.decode_req_indices.tolist() == [0, 2]
    assert reference.decode_token_indices.tolist() == [0, 6]
    assert reference.prefill_req_indices == [1]
    assert reference.seq_lens == [11, 5, 4]


def test_backend_is_registered_by_name():
    assert isinstance(get_attention_backend("cpu"), CpuAttentionBackend)
    assert isinstance(get_attention_backend("torch"), TorchAttentionBackend)


def test_cache_dir_follows_pagedllm_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    assert extension.cache_dir().parent == tmp_path / "extensions"
    assert torch.__version__ in extension.cache_dir().name


def test_cache_dir_differs_when_the_sources_do(monkeypatch, tmp_path):
    """Checkouts with different kernel sources build into different directories instead of
    rebuilding over each other's; the same sources and torch find the same one."""
    first = extension.cache_dir()
    assert first == extension.cache_dir()
    changed = tmp_path / "csrc"
    changed.mkdir()
    for path in extension._source_files():
        (changed / path.name).write_bytes(path.read_bytes())
    (changed / "cpu_ops.cpp").write_text("// another version\n")
    monkeypatch.setattr(extension, "_CSRC", changed)
    assert extension.cache_dir() != first
    assert extension.cache_dir().parent == first.parent


def test_greedy_tokens_equal_torch_backend(tiny_llama):
    """Chunked prefill (small token budget), an odd block size and a batch of decodes."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 6, 17, 40, 95, 130)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for backend, backend_type in (("torch", TorchAttentionBackend), ("cpu", CpuAttentionBackend)):
        llm = LLM(
            str(tiny_llama),
            max_model_len=256,
            block_size=7,
            max_num_batched_tokens=48,
            attention_backend=backend,
        )
        model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
        assert {type(m.backend) for m in model.modules() if hasattr(m, "backend")} == {backend_type}
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[backend] = [r.outputs[0].token_ids for r in results]
    assert outputs["cpu"] == outputs["torch"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_keys_and_values_go_into_a_16_bit_cache(cpu_backend, dtype):
    """kv_cache_dtype under an fp32 model: the write rounds each value once, as .to(dtype)
    does, and both backends then read the same rounded cache in fp32."""
    batch = make_batch([(20, 1), (0, 25), (9, 6)], block_size=16, num_heads=9, num_kv_heads=3)
    batch.kv_cache = tuple(c.to(dtype) for c in batch.kv_cache)
    slots = torch.from_numpy(batch.layout.slot_mapping)
    reference = tuple(c.clone() for c in batch.kv_cache)
    write_kv_cache(batch.k, batch.v, reference, slots)
    kernel = tuple(c.clone() for c in batch.kv_cache)
    torch.ops.pagedllm.write_kv_cache(kernel[0], kernel[1], batch.k, batch.v, slots)
    for got, want in zip(kernel, reference, strict=True):
        assert torch.equal(got, want)
    assert_matches_torch(cpu_backend, batch)


def dense_reference(batch: Batch, window: int) -> torch.Tensor:
    """Windowed causal attention of every query over its request's keys, by explicit
    softmax on the whole (un-nulled) tables: query at position p sees keys p - window + 1..p."""
    key_cache, value_cache = (c.clone() for c in batch.kv_cache)
    write_kv_cache(
        batch.k, batch.v, (key_cache, value_cache), torch.from_numpy(batch.layout.slot_mapping)
    )
    layout, block_size = batch.layout, key_cache.shape[1]
    group = batch.q.shape[1] // key_cache.shape[2]
    out = torch.empty_like(batch.q)
    for req, seq_len in enumerate(layout.seq_lens.tolist()):
        start, end = layout.query_start_loc[req], layout.query_start_loc[req + 1]
        table = torch.from_numpy(layout.block_tables[req, : cdiv(seq_len, block_size)])
        keys = key_cache[table].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
        values = value_cache[table].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
        positions = torch.arange(seq_len - (end - start), seq_len)
        key_positions = torch.arange(seq_len)
        visible = (key_positions[None] <= positions[:, None]) & (
            key_positions[None] > positions[:, None] - window
        )
        scores = torch.einsum("qhd,khd->hqk", batch.q[start:end], keys) * batch.scale
        weights = scores.masked_fill(~visible, -math.inf).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, values)
    return out


@pytest.mark.parametrize("window", [1, 6, 16, 45])
def test_sliding_window_skips_blocks_before_it(cpu_backend, window):
    """Both backends equal a dense windowed reference when the blocks wholly before each
    request's window are the null block."""
    requests = [(0, 37), (30, 1), (50, 9), (3, 20), (100, 1), (64, 1)]
    batch = make_batch(requests, block_size=7, num_heads=4, num_kv_heads=2, share_blocks=False)
    reference = dense_reference(batch, window)
    tables = batch.layout.block_tables.copy()
    for req, (cached, _) in enumerate(requests):
        first_needed_block = max(0, cached - window + 1) // 7
        tables[req, :first_needed_block] = 0
    batch.layout = dataclasses.replace(batch.layout, block_tables=tables)
    # The kernel must never read the null block: NaN there would show. The torch reference
    # pads short decodes with it and masks them, so it gets finite garbage.
    for backend, garbage in ((TorchAttentionBackend(), 100.0), (cpu_backend, math.nan)):
        kv_cache = tuple(c.clone() for c in batch.kv_cache)
        for cache in kv_cache:
            cache[0] = garbage
        metadata = backend.build_metadata(batch.layout, torch.device("cpu"))
        out = backend.forward(batch.q, batch.k, batch.v, kv_cache, metadata, batch.scale, window)
        torch.testing.assert_close(out, reference, **FP32_TOLERANCE)


@pytest.mark.skipif(
    not (extension.available() and cpu_features().avx512f), reason="the CPU has no AVX-512"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5, 20])
@pytest.mark.parametrize(("head_dim", "block_size"), [(16, 16), (80, 7), (128, 32)])
def test_16_lane_attention_gives_the_8_lane_bits(cpu_backend, dtype, window, head_dim, block_size):
    """With AVX-512 a prefill tile's scores, softmax and value sums take one register per
    16 keys, and a decode row's dot products and value sums 16 elements of d at a time;
    every lane does the 8-lane code's operations in its order: the same bits, for groups of
    one to six rows, decodes, windows that start inside or past a slice, and partial
    blocks."""
    batch = make_batch(
        [(0, 37), (30, 1), (50, 9), (3, 20), (0, 70), (90, 1)],
        block_size=block_size,
        num_heads=9,
        num_kv_heads=3,
        head_dim=head_dim,
        dtype=dtype,
    )
    ops, outputs = extension.load(), {}
    before = ops.get_vector_lanes()
    try:
        for lanes in (8, 16):
            ops.set_vector_lanes(lanes)
            metadata = cpu_backend.build_metadata(batch.layout, torch.device("cpu"))
            kv_cache = tuple(c.clone() for c in batch.kv_cache)
            outputs[lanes] = cpu_backend.forward(
                batch.q, batch.k, batch.v, kv_cache, metadata, batch.scale, window or None
            )
    finally:
        ops.set_vector_lanes(before)
    assert torch.equal(outputs[8], outputs[16])
