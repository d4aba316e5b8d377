"""8-bit layers (int8 W8A8, FP8) over tensor-parallel ranks, in one process
(`model/layers/w8a8_parallel.py`): each rank keeps whole output rows over the whole K, so
its output columns are one rank's, whatever the activation scales (per token, per tensor,
static, per group) and wherever a rank's rows start in an FP8 block: bit for bit where the
kernel computes each column on its own (int8 x int8 on the integer GEMM; fp8 up to 4 rows
in registers), within fp32 rounding through torch.mm's bands (fp8 from 5 rows, weight-only
int8), whose summation order follows the GEMM's shape (a scale taken over a rank's K slice
would be off by the quantization step, ~1e-2). The ranks are built one after another under
a stand-in group; the collectives and the engine run across processes in
tests/distributed/test_w8a8_parallel.py."""

from __future__ import annotations

import pytest
import torch
from rank_columns import outlier_input, rank_columns, switch_rank
from w8a8_writer import Format, format_named, quantize_weight

import pagedllm.model.layers.w8a8_linear as w8a8_linear
from pagedllm.model.layers.gguf_parallel import RowSlice
from pagedllm.model.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.model.layers.w8a8_linear import on_int8_gemm
from pagedllm.model.layers.w8a8_parallel import (
    Int8W8A8RowParallelLinear,
    TiledDequantRowParallelLinear,
    parallel_w8a8_layer,
    rank_w8a8_weights,
)
from pagedllm.model.layers.w8a8_swap import _w8a8_layer, checkpoint_scheme, layer_weights
from pagedllm.model.layers.w8a8_weights import W8A8Weights, fp8_ops

INT8_TOKEN, INT8_STATIC, INT8_WEIGHT_ONLY, FP8_TENSOR, FP8_BLOCK = map(
    format_named,
    ["ct-int8-token", "ct-int8-static", "ct-int8-weight-only", "fp8-tensor", "fp8-block"],
)


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(rank, tp): layers built next see this rank of a tp-rank group."""
    return lambda rank, tp: switch_rank(monkeypatch, rank, tp)


def _weights(out_features: int, in_features: int, fmt: Format, seed: int) -> W8A8Weights:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    scheme = checkpoint_scheme(fmt.method, fmt.quantization_config())
    return layer_weights("layer", quantize_weight(weight, fmt), scheme)


# Up to fused_max_rows() rows fp8 weights are multiplied in registers, more through bands.
ROWS = [w8a8_linear.fused_max_rows() - 1, w8a8_linear.fused_max_rows() + 3]


def _columns_on_their_own(weights: W8A8Weights, rows: int) -> bool:
    """Whether the layer computes each output column apart from the others (see the module
    docstring): then a rank's columns are one rank's bit for bit."""
    in_registers = weights.values.dtype == torch.float8_e4m3fn and fp8_ops() is not None
    return on_int8_gemm(weights.scheme) or (in_registers and rows <= w8a8_linear.fused_max_rows())


def _assert_one_ranks(mine: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(mine, expected)
    else:
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    ("fmt", "k", "out_features", "tp"),
    [
        (INT8_TOKEN, 384, 300, 2),  # a K slice of 192 would scale half a token's row
        (INT8_STATIC, 384, 200, 3),  # shares 67 67 66+1
        (INT8_WEIGHT_ONLY, 384, 200, 3),
        (FP8_TENSOR, 384, 300, 2),
        (FP8_BLOCK, 384, 255, 2),  # rank 1 starts on a block: 127 rows + 1 padding
        (FP8_BLOCK, 384, 200, 3),  # ranks 1 and 2 start inside a block; 66+1
    ],
    ids=lambda v: str(v),
)
def test_row_parallel_ranks_compute_one_ranks_output_rows(as_rank, fmt, k, out_features, tp, rows):
    """o / down: each rank's output rows over the WHOLE K (its input gathered) are one
    rank's columns; joined in rank order and cut, they are one rank's output."""
    weights, x = _weights(out_features, k, fmt, 0), outlier_input(rows, k)
    exact = _columns_on_their_own(weights, rows)
    whole_layer = w8a8_linear.w8a8_layer(weights)
    whole = whole_layer(x)
    shares = []
    for rank in range(tp):
        as_rank(rank, tp)
        module = RowParallelLinear(k, out_features, True, torch.float32)
        layer = parallel_w8a8_layer(module, rank_w8a8_weights(module, None, weights))
        expected_class = (
            Int8W8A8RowParallelLinear
            if isinstance(whole_layer, w8a8_linear.Int8W8A8Linear)
            else TiledDequantRowParallelLinear
        )
        assert isinstance(layer, expected_class)
        assert layer.bias is module.bias  # the model's parameter: loaded whole, added once
        assert layer.in_features == k and layer.full_out_features == out_features
        # A share of the weights, not all of them (1/tp, plus a padding row and, where a
        # rank's rows start inside a block, a scale per row and block).
        assert layer.weight_bytes() <= (1 / tp + 0.06) * whole_layer.weight_bytes()
        mine = torch.empty(len(x), layer.out_features)
        layer.matmul_into(x, mine)
        start = rank * -(-out_features // tp)
        real = min(out_features - start, layer.out_features)
        expected = rank_columns(whole, RowSlice(start, real, layer.out_features - real))
        _assert_one_ranks(mine, expected, exact)
        shares.append(mine)
    _assert_one_ranks(torch.cat(shares, dim=1)[:, :out_features], whole, exact)


HEADS, HEAD_DIM = 4, 64


def _part_rows(kind: str, kv_heads: int) -> dict[str, int]:
    """The output rows of each part of a fused projection of 256 inputs (all ranks')."""
    if kind == "qkv":
        return {"q": HEADS * HEAD_DIM, "k": kv_heads * HEAD_DIM, "v": kv_heads * HEAD_DIM}
    return {"gate": 384, "up": 384}


def _fused_module(kind: str, kv_heads: int) -> MergedColumnParallelLinear:
    """This rank's fp32 fused projection, as the model builds it."""
    if kind == "qkv":
        return QKVParallelLinear(256, HEAD_DIM, HEADS, kv_heads, False, torch.float32)
    return MergedColumnParallelLinear(256, [384, 384], ["gate", "up"], False, torch.float32)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", [INT8_TOKEN, FP8_TENSOR, FP8_BLOCK], ids=str)
@pytest.mark.parametrize(
    ("kind", "kv_heads"),
    [("qkv", 1), ("qkv", 2), ("gate_up", 0)],
    ids=["qkv-kv1-replicated", "qkv-kv2", "gate_up"],
)
def test_column_parallel_shards_compute_one_ranks_columns(as_rank, fmt, kind, kv_heads, rows):
    """q/k/v rows by head (a replicated KV head's rows on both ranks) and gate/up, swapped
    in as the engine does (`w8a8_swap._w8a8_layer`): each rank's columns of each shard are
    one rank's, FP8 blocks cut at 64 (k, v) and 192 (gate, up) rows included, and the layer
    carries the cut for LoRA."""
    x = outlier_input(rows, 256)
    sizes = _part_rows(kind, kv_heads)
    parts = {s: _weights(n, 256, fmt, i) for i, (s, n) in enumerate(sizes.items())}
    whole = {s: w8a8_linear.w8a8_layer(w)(x) for s, w in parts.items()}
    exact = _columns_on_their_own(parts[next(iter(sizes))], rows)
    for rank in range(2):
        as_rank(rank, 2)
        module = _fused_module(kind, kv_heads)
        layer = _w8a8_layer(kind, module, parts)
        assert layer.shard_sources == module.shard_sources
        assert layer.shard_slices == module.shard_slices
        for shard, out in zip(sizes, layer.split(layer(x)), strict=True):
            start, _ = module.shard_sources[shard]
            _assert_one_ranks(out, whole[shard][:, start : start + out.shape[1]], exact)
