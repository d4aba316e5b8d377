"""GGUF blocks over tensor-parallel ranks, in one process: which rows of the file's blocks
each rank keeps (`model/layers/gguf_parallel.py`), and that a rank's layer on them computes
one rank's output columns bit for bit (the ranks are built one after another under a
stand-in group; the collectives are tested across processes in
tests/distributed/test_parallel_combinations.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from rank_columns import outlier_input, rank_columns

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model.layers import gguf_swap, parallel_linear, vocab_parallel
from pagedllm.model.layers.gguf_embedding import GGUFEmbedding
from pagedllm.model.layers.gguf_linear import GGUFConcatLinear, GGUFLinear
from pagedllm.model.layers.gguf_parallel import (
    GGUFParallelLMHead,
    GGUFRowParallelLinear,
    GGUFVocabParallelEmbedding,
    RowSlice,
    gguf_embedding,
    output_row_slice,
    parallel_gguf_layer,
    rank_row_slice,
    rank_rows,
    vocab_row_slice,
)
from pagedllm.model.layers.parallel_linear import QKVParallelLinear, RowParallelLinear
from pagedllm.model.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, VocabShard
from pagedllm.ops.cpu_features import gguf_kernel_isa

TYPES = [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K]
# Every kernel path this CPU can run: 0 portable, 1 AVX2, 2 AVX-512 VNNI.
PATHS = list(range(gguf_kernel_isa() + 1))
K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


class _StandInGroup(GroupCoordinator):
    """Rank `rank` of a `tp`-rank group, in this process: its all-reduce is the identity
    (the test adds the ranks' outputs itself)."""

    def __init__(self, rank: int, tp: int) -> None:
        super().__init__(list(range(tp)), rank, torch.device("cpu"))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(rank, tp): layers built next see this rank of a tp-rank group."""

    def switch(rank: int, tp: int) -> None:
        group = _StandInGroup(rank, tp)
        for module in (parallel_linear, vocab_parallel):
            monkeypatch.setattr(module, "get_tp_group", lambda: group)

    return switch


def _raw(rows: int, cols: int, qtype: Q, seed: int = 0) -> np.ndarray:
    """Random raw blocks [rows, bytes] of `qtype` (K-quants: random bytes, sane scales)."""
    rng = np.random.default_rng(seed)
    if qtype not in K_SCALE_OFFSETS:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block_bytes, blocks = gguf.constants.GGML_QUANT_SIZES[qtype][1], cols // 256
    raw = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(1e-3, 3e-3, (rows, blocks)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


def test_output_rows_are_equal_shares_padded_with_zero_rows():
    assert [output_row_slice(64, r, 2) for r in range(2)] == [RowSlice(0, 32), RowSlice(32, 32)]
    assert [output_row_slice(10, r, 3) for r in range(3)] == [
        RowSlice(0, 4),
        RowSlice(4, 4),
        RowSlice(8, 2, 2),
    ]
    # More ranks than rows: a rank may hold padding only.
    assert output_row_slice(4, 2, 3) == RowSlice(4, 0, 2)


def test_vocabulary_rows_end_in_padding(as_rank):
    slices = []
    for rank in range(2):
        as_rank(rank, 2)
        slices.append(vocab_row_slice(VocabShard(300), 300))  # padded to 384
    assert slices == [RowSlice(0, 192), RowSlice(192, 108, 84)]
    with pytest.raises(ValueError, match="vocabulary tensor has 299 rows, expected 300"):
        vocab_row_slice(VocabShard(300), 299)


def test_unsplit_layers_keep_every_row(as_rank):
    as_rank(0, 1)
    row = RowParallelLinear(64, 48, False, torch.float32)
    assert rank_row_slice(row, None, 48) == RowSlice(0, 48)
    assert rank_row_slice(torch.nn.Linear(4, 5), None, 5) == RowSlice(0, 5)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["kv1-replicated", "kv2"])
def test_qkv_shards_compute_one_ranks_columns(as_rank, qtype, kv_heads):
    """q, k and v rows by head (a replicated KV head's rows on both ranks); each rank's
    columns equal one rank's bit for bit."""
    hidden, head_dim, heads = 256, 32, 4
    x = outlier_input(5, hidden)
    raws = {"q": _raw(heads * head_dim, hidden, qtype, 0)}
    raws |= {s: _raw(kv_heads * head_dim, hidden, qtype, i) for i, s in enumerate("kv", 1)}
    whole = {s: GGUFLinear(raw, qtype)(x) for s, raw in raws.items()}
    for rank in range(2):
        as_rank(rank, 2)
        qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, False, torch.float32)
        for shard, raw in raws.items():
            rows = rank_row_slice(qkv, shard, len(raw))
            out = GGUFLinear(rank_rows(qkv, shard, raw), qtype)(x)
            assert out.shape[1] == qkv.output_sizes["qkv".index(shard)]
            assert torch.equal(out, rank_columns(whole[shard], rows))
        kv_start = rank * head_dim if kv_heads == 2 else 0
        assert rank_row_slice(qkv, "k", kv_heads * head_dim) == RowSlice(kv_start, head_dim)


def test_mixed_type_qkv_shards_into_one_layer_per_type(as_rank):
    """Q4_K_M's q/k in Q4_K and v in Q6_K: each rank's GGUFConcatLinear holds its rows of
    each part and computes one rank's columns of each."""
    hidden, head_dim, heads, kv_heads = 256, 32, 4, 2
    types = {"q": Q.Q4_K, "k": Q.Q4_K, "v": Q.Q6_K}
    sizes = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    raws = {s: _raw(sizes[s], hidden, types[s], i) for i, s in enumerate("qkv")}
    x = outlier_input(3, hidden)
    whole = {s: GGUFLinear(raws[s], types[s])(x) for s in "qkv"}
    parts = {s: (f"{s}_proj.weight", types[s], raws[s]) for s in "qkv"}
    for rank in range(2):
        as_rank(rank, 2)
        qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, False, torch.float32)
        layer = gguf_swap._gguf_layer(qkv, parts)
        assert isinstance(layer, GGUFConcatLinear) and len(layer.parts) == 2
        outs = layer.split(layer(x))
        for shard, out in zip("qkv", outs, strict=True):
            assert torch.equal(
                out, rank_columns(whole[shard], rank_row_slice(qkv, shard, sizes[shard]))
            )


@pytest.mark.parametrize(("qtype", "k", "out_features", "tp"), [
    (Q.Q4_K, 768, 96, 2),  # fp32's K slice 384: no whole super-blocks
    (Q.Q6_K, 768, 100, 3),  # 100 rows in shares of 34: the last rank's ends in 2 zero rows
    (Q.Q8_0, 96, 64, 2),  # K slice 48: no whole blocks of 32
    (Q.Q4_0, 160, 50, 4),
], ids=["Q4_K-k384", "Q6_K-3-ranks-padded", "Q8_0-k48", "Q4_0-4-ranks"])  # fmt: skip
@pytest.mark.parametrize("isa", PATHS)
def test_row_parallel_ranks_compute_one_ranks_output_rows(as_rank, qtype, k, out_features, tp, isa):
    """o / down: each rank's output rows over the WHOLE K (its input gathered) are one
    rank's columns bit for bit, on every kernel path; joined in rank order and cut, they
    are one rank's output."""
    raw, x = _raw(out_features, k, qtype), outlier_input(6, k)
    whole_layer = GGUFLinear(raw, qtype)
    whole_layer.isa = isa
    whole = whole_layer(x)
    shares = []
    for rank in range(tp):
        as_rank(rank, tp)
        module = RowParallelLinear(k, out_features, True, torch.float32)
        layer = parallel_gguf_layer(module, rank_rows(module, None, raw), qtype)
        layer.isa = isa
        assert isinstance(layer, GGUFRowParallelLinear)
        assert layer.bias is module.bias  # the model's parameter: loaded whole, added once
        assert layer.in_features == k and layer.full_out_features == out_features
        mine = torch.empty(len(x), layer.out_features)
        layer.matmul_into(x, mine)
        assert torch.equal(mine, rank_columns(whole, rank_row_slice(module, None, out_features)))
        shares.append(mine)
    assert torch.equal(torch.cat(shares, dim=1)[:, :out_features], whole)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K], ids=["Q8_0", "Q6_K"])
def test_vocabulary_shards_of_the_head_and_the_embedding(as_rank, qtype):
    """A tied head's shard gives one rank's logits of its rows and zeros for the padding;
    the embedding on its tables gives one rank's row for ids in the shard, zeros elsewhere,
    so the sum over ranks (the all-reduce) is one rank's lookup exactly."""
    vocab, hidden = 300, 256
    raw, x = _raw(vocab, hidden, qtype), outlier_input(4, hidden)
    whole = GGUFLinear(raw, qtype)
    ids = torch.tensor([0, 191, 192, 193, 299, 7])
    whole_rows = GGUFEmbedding(
        dict(whole.named_buffers(remove_duplicate=False)), qtype, vocab, hidden
    )(ids)
    whole_logits = whole(x)
    looked_up = torch.zeros_like(whole_rows)
    for rank in range(2):
        as_rank(rank, 2)
        head = ParallelLMHead(vocab, hidden, torch.float32)
        layer = parallel_gguf_layer(head, rank_rows(head, None, raw), qtype)
        assert isinstance(layer, GGUFParallelLMHead) and layer.out_features == 192
        logits = GGUFLinear.forward(layer, x)  # this rank's columns, before the gather
        assert torch.equal(logits, rank_columns(whole_logits, rank_row_slice(head, None, vocab)))
        embedding = VocabParallelEmbedding(vocab, hidden, torch.float32)
        tables = dict(layer.named_buffers(remove_duplicate=False))
        lookup = gguf_embedding(embedding, tables, qtype, layer)
        assert isinstance(lookup, GGUFVocabParallelEmbedding)
        looked_up += lookup(ids)
    assert torch.equal(looked_up, whole_rows)


def test_a_file_tensor_of_another_shape_is_refused(as_rank):
    as_rank(1, 2)
    qkv = QKVParallelLinear(256, 32, 4, 2, False, torch.float32)
    with pytest.raises(ValueError, match="shard 'k' tensor has 32 rows, expected 64"):
        rank_row_slice(qkv, "k", 32)
