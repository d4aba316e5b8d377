"""Packed integer layers (GPTQ, AWQ, compressed-tensors pack-quantized) over tensor-parallel
ranks, in one process (`model/layers/packed_parallel.py`): each rank keeps whole output rows
with all their groups, so its output columns equal one rank's bit for bit, act-order and
groups that a K slice would cut included. The ranks are built one after another under a
stand-in group; the collectives and the engine run across processes in
tests/distributed/test_packed_parallel.py."""

from __future__ import annotations

import pytest
import torch
from gptq_writer import Scheme, quantize_weight
from rank_columns import outlier_input, rank_columns, switch_rank

from pagedllm.model.layers import packed_swap
from pagedllm.model.layers.gguf_linear import _NO_MINS, GGUFConcatLinear
from pagedllm.model.layers.gguf_parallel import RowSlice
from pagedllm.model.layers.gptq_linear import GPTQLinear
from pagedllm.model.layers.packed_parallel import (
    GPTQRowParallelLinear,
    parallel_packed_layer,
    rank_weights,
)
from pagedllm.model.layers.parallel_linear import QKVParallelLinear, RowParallelLinear
from pagedllm.model.quantization.gptq import GPTQConfig
from pagedllm.model.quantization.gptq_format import GPTQTensors, UnpackedGPTQ, unpack_gptq


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(rank, tp): layers built next see this rank of a tp-rank group."""
    return lambda rank, tp: switch_rank(monkeypatch, rank, tp)


def _unpacked(out_features: int, in_features: int, scheme: Scheme, seed: int) -> UnpackedGPTQ:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    tensors = quantize_weight(weight, scheme, generator)
    return unpack_gptq(GPTQTensors(**tensors), GPTQConfig.from_dict(scheme.quantization_config()))


@pytest.mark.parametrize(
    ("scheme", "k", "out_features", "tp"),
    [
        (Scheme(128, desc_act=False, sym=True), 256, 96, 2),  # K slice 128: one whole group
        (Scheme(128, desc_act=True, sym=False), 384, 104, 3),  # act-order, shares 35 35 34+1
        (Scheme(64, desc_act=False, sym=False), 192, 64, 2),  # K slice 96: cuts a group
        (Scheme(-1, desc_act=True, sym=True), 96, 40, 3),  # per channel, shares 14 14 12+2
    ],
    ids=["g128", "g128-act-order-3-ranks", "g64-k96", "per-channel-3-ranks"],
)
def test_row_parallel_ranks_compute_one_ranks_output_rows(as_rank, scheme, k, out_features, tp):
    """o / down: each rank's output rows over the WHOLE K (its input gathered) are one
    rank's columns bit for bit; joined in rank order and cut, they are one rank's output.
    A symmetric layer's padding rows keep it without a min table."""
    weights, x = _unpacked(out_features, k, scheme, 0), outlier_input(6, k)
    whole_layer = GPTQLinear(weights)
    whole = whole_layer(x)
    shares = []
    for rank in range(tp):
        as_rank(rank, tp)
        module = RowParallelLinear(k, out_features, True, torch.float32)
        layer = parallel_packed_layer(module, rank_weights(module, None, weights))
        assert isinstance(layer, GPTQRowParallelLinear)
        assert layer.bias is module.bias  # the model's parameter: loaded whole, added once
        assert layer.in_features == k and layer.full_out_features == out_features
        assert (layer.mins is _NO_MINS) == scheme.sym  # padding rows keep a symmetric layer's
        # A share of the weights, not all of them: 1/tp, plus what tiles round the rows up
        # to and an act-order layer's input order, whole on every rank (0.42 of 3 ranks').
        assert layer.weight_bytes() <= 0.5 * whole_layer.weight_bytes()
        mine = torch.empty(len(x), layer.out_features)
        layer.matmul_into(x, mine)
        start = rank * -(-out_features // tp)
        rows = min(out_features - start, layer.out_features)
        expected = rank_columns(whole, RowSlice(start, rows, layer.out_features - rows))
        assert torch.equal(mine, expected)
        shares.append(mine)
    assert torch.equal(torch.cat(shares, dim=1)[:, :out_features], whole)


@pytest.mark.parametrize("desc_act", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["kv1-replicated", "kv2"])
def test_qkv_shards_compute_one_ranks_columns(as_rank, desc_act, kv_heads):
    """q, k and v rows by head (a replicated KV head's rows on both ranks), swapped in as the
    engine does (`packed_swap._packed_layer`); each rank's columns of each shard equal one
    rank's bit for bit, and the layer carries the cut for LoRA."""
    hidden, head_dim, heads = 128, 32, 4
    scheme = Scheme(64, desc_act=desc_act, sym=False)
    sizes = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    parts = {s: _unpacked(sizes[s], hidden, scheme, i) for i, s in enumerate("qkv")}
    x = outlier_input(5, hidden)
    whole = {s: GPTQLinear(w)(x) for s, w in parts.items()}
    for rank in range(2):
        as_rank(rank, 2)
        qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, False, torch.float32)
        layer = packed_swap._packed_layer("qkv_proj", qkv, parts, "gptq")
        assert isinstance(layer, GGUFConcatLinear) == desc_act  # one order each: apart
        assert layer.shard_sources == qkv.shard_sources
        for shard, out in zip("qkv", layer.split(layer(x)), strict=True):
            start, _ = qkv.shard_sources[shard]
            assert torch.equal(out, whole[shard][:, start : start + out.shape[1]])
