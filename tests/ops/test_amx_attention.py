"""Prefill tiles and decodes of a bf16 cache on tiles (ops/csrc/attention_amx.h), on each
engine: AMX, and AVX512-BF16 dot products doing the tiles' work (ops/csrc/attention_dots.h).
bf16 softmax weights times bf16 values summed in fp32, against a dense fp32 reference; what
the tiles do not cover keeps the vector kernel's bits; stale cache rows past a context never
reach a sum.
An engine's arithmetic runs where the CPU has it (AMX-BF16; AVX512-BF16, which AMX machines
have too); which backend asks for which engine is checked on every CPU."""

from __future__ import annotations

import math

import pytest
import torch
from model_utils import model_runner
from test_cpu_attention import Batch, dense_reference, make_batch, widened

from pagedllm import LLM
from pagedllm.ops import extension
from pagedllm.ops.attention import write_kv_cache
from pagedllm.ops.attention_registry import get_attention_backend
from pagedllm.ops.kernel_selection import _bf16_dots_win, amx_tiles_granted, bf16_dot_granted

pytestmark = pytest.mark.skipif(not extension.available(), reason="no AVX2 compiler here")
needs_amx = pytest.mark.skipif(
    not (extension.available() and amx_tiles_granted()), reason="the CPU has no AMX-BF16"
)
needs_bf16_dots = pytest.mark.skipif(
    not (extension.available() and bf16_dot_granted()), reason="the CPU has no AVX512-BF16"
)
# Every test below runs on each engine the CPU has.
ENGINES = [pytest.param("amx", marks=needs_amx), pytest.param("bf16_dots", marks=needs_bf16_dots)]

# Prompts from scratch and continued, chunk tails of 2-3 tokens, decodes beside them, and
# contexts that end inside a 16-key slice and inside a 32-key step.
REQUESTS = [(0, 37), (30, 1), (50, 9), (3, 20), (0, 70), (90, 1), (0, 256), (61, 2), (17, 3)]


def run_kernel(batch: Batch, tiles: str | None, window: int = 0) -> torch.Tensor:
    backend = get_attention_backend("cpu", tiles=tiles)
    assert backend.tiles == tiles
    kv_cache = tuple(c.clone() for c in batch.kv_cache)
    metadata = backend.build_metadata(batch.layout, torch.device("cpu"))
    return backend.forward(batch.q, batch.k, batch.v, kv_cache, metadata, batch.scale, window)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_engine_builds_its_backend_with_the_selections_tiles(tiny_llama, dtype):
    """The cpu backend takes the engine the kernel selection names: AMX for a bf16 cache on
    a CPU with AMX-BF16 granted, dot products where those win without AMX, else none."""
    runner = model_runner(LLM(str(tiny_llama), dtype=dtype, max_model_len=64))
    bf16 = dtype == "bfloat16"
    assert runner.kernels.bf16_amx_attention == (bf16 and amx_tiles_granted())
    assert runner.kernels.bf16_dot_attention == (bf16 and _bf16_dots_win())
    expected = "amx" if bf16 and amx_tiles_granted() else None
    expected = "bf16_dots" if bf16 and _bf16_dots_win() else expected
    assert runner.attention_backend.tiles == runner.kernels.attention_tiles == expected
    assert get_attention_backend("cpu").tiles is None


def test_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="tiles"):
        get_attention_backend("cpu", tiles="tensor_cores")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (32, 32), (128, 16), (64, 48)])
def test_tiles_equal_fp32_attention_within_bf16_weights(engine, head_dim, block_size, window):
    """Prefill tiles (decodes beside them) over the same bf16 q, k and v as the fp32
    reference: as close on average as the vector kernel to within a bf16 weight's
    rounding."""
    batch = make_batch(
        REQUESTS, block_size=block_size, num_heads=9, num_kv_heads=3, head_dim=head_dim,
        dtype=torch.bfloat16,
    )  # fmt: skip
    assert_tiles_near_fp32(batch, engine, window, mean_error_slack=2**-3)


def assert_tiles_near_fp32(batch: Batch, engine: str, window: int, mean_error_slack: float) -> None:
    """The tiles' outputs within what rounding the weights and the output to bf16 allows of
    the fp32 reference, and on average within `mean_error_slack` of the vector kernel's
    (fp32 weights) error."""
    reference = dense_reference(widened(batch), window or 10**9)
    tiles, vector = run_kernel(batch, engine, window), run_kernel(batch, None, window)
    assert tiles.dtype == torch.bfloat16
    torch.testing.assert_close(tiles.float(), reference, rtol=2**-6, atol=2**-8)
    tile_error = (tiles.float() - reference).abs().mean()
    vector_error = (vector.float() - reference).abs().mean()
    assert tile_error <= vector_error * (1 + mean_error_slack)
    # The tiles ran: bf16 weights do not give the vector kernel's bits everywhere.
    assert not torch.equal(tiles, vector)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("window", [0, 7, 40])
@pytest.mark.parametrize(("head_dim", "num_decodes"), [(64, 5), (64, 40), (128, 5), (32, 40)])
def test_decodes_on_tiles_equal_fp32_attention_within_bf16_weights(
    engine, head_dim, num_decodes, window
):
    """Decodes take AMX's two passes (scores over the whole context, then P V) or the dot
    products' slices (decode_dots.h): within the prefill tiles' bounds of the fp32 reference
    at contexts that end inside a slice and a step. Forty decodes make items of all kv
    heads, five an item per kv head."""
    contexts = [1, 15, 16, 17, 33, 200, 31, 64][:num_decodes]
    contexts += [(7 * i) % 300 + 1 for i in range(num_decodes - len(contexts))]
    batch = make_batch(
        [(n, 1) for n in contexts], block_size=16, num_heads=9, num_kv_heads=3,
        head_dim=head_dim, dtype=torch.bfloat16,
    )  # fmt: skip
    # A decode's error is mostly its weights' rounding: 1.05-1.14x the vector kernel's here.
    assert_tiles_near_fp32(batch, engine, window, mean_error_slack=2**-2)


@needs_bf16_dots
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(34, 2, 16), (4, 4, 32)])
def test_decodes_on_dot_products_take_any_group_and_block_size(num_heads, num_kv_heads, block_size):
    """The dot products' decode takes a kv head's rows four (head size 64) at a time: groups
    of 17 query heads and of one, and blocks of two slices, stay within the bounds."""
    batch = make_batch(
        [(n, 1) for n in (1, 16, 33, 200, 47, 64)], block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, dtype=torch.bfloat16,
    )  # fmt: skip
    assert_tiles_near_fp32(batch, "bf16_dots", 0, mean_error_slack=2**-2)


@needs_amx
def test_decodes_of_more_than_sixteen_heads_a_kv_head_keep_the_vector_kernel_on_amx():
    """An AMX decode's rows are one A tile of at most 16 query heads; a larger group runs
    the vector kernel."""
    batch = make_batch(
        [(n, 1) for n in (1, 16, 33, 200)],
        block_size=16,
        num_heads=34,
        num_kv_heads=2,
        dtype=torch.bfloat16,
    )
    assert torch.equal(run_kernel(batch, "amx"), run_kernel(batch, None))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("head_dim", "block_size", "dtype"),
    [(80, 16, torch.bfloat16), (64, 8, torch.bfloat16), (64, 16, torch.float32)],
)
def test_what_the_tiles_do_not_cover_keeps_the_vector_kernel(engine, head_dim, block_size, dtype):
    """Head sizes that are not 32, 64 or 128, blocks not a multiple of 16 keys, and caches
    other than bf16 run the vector kernel, whatever engine is asked for."""
    batch = make_batch(
        REQUESTS,
        block_size=block_size,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        dtype=dtype,
    )
    assert torch.equal(run_kernel(batch, engine), run_kernel(batch, None))


@pytest.mark.parametrize("engine", ENGINES)
def test_stale_rows_past_a_context_never_reach_a_sum(engine):
    """A slice's rows past its context are read as A tiles of keys (masked) and skipped as
    values: NaN in every cache row no request holds leaves every output finite."""
    batch = make_batch(REQUESTS, block_size=16, num_heads=9, num_kv_heads=3, dtype=torch.bfloat16)
    key_cache, value_cache = batch.kv_cache
    write_kv_cache(batch.k, batch.v, batch.kv_cache, torch.from_numpy(batch.layout.slot_mapping))
    held = torch.zeros(key_cache.shape[:2], dtype=torch.bool)
    for req, seq_len in enumerate(batch.layout.seq_lens.tolist()):
        for position in range(seq_len):
            block = batch.layout.block_tables[req, position // 16]
            held[block, position % 16] = True
    for cache in (key_cache, value_cache):
        cache[~held] = math.nan
    out = run_kernel(batch, engine)
    assert out.isfinite().all()
    reference = dense_reference(widened(batch), 10**9)
    torch.testing.assert_close(out.float(), reference, rtol=2**-6, atol=2**-8)
