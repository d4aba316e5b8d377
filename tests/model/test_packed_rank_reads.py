"""Each tensor-parallel rank reads only its output rows of a packed checkpoint's layers, and a
pipeline stage none of another stage's (`model/layers/packed_reads.py`), in GPTQ (act-order),
AWQ and compressed-tensors (4- and 8-bit zero points, packed along the outputs): the reads
are recorded where they happen (`packed_reads.read_stored`), and the layers built from them
compute one rank's output columns bit for bit. The ranks are built one after another under
a stand-in group, as in tests/model/test_packed_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
from awq_writer import AWQScheme, quantize_awq
from ct_writer import CTScheme, quantize_packed
from gptq_writer import Scheme, quantize_weight
from rank_columns import outlier_input, rank_columns
from safetensors.torch import save_file
from torch import nn

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model.layers import awq_swap, ct_pack_swap, gptq_swap, packed_reads, parallel_linear
from pagedllm.model.layers.gguf_parallel import output_row_slice
from pagedllm.model.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.model.models.llama import fused_param_name

K, GATE_UP, DOWN = 384, 96, 104  # down's 104 rows over 3 ranks: 35, 35, 34 and one padding
PREFIX = "model.layers.0.mlp"


class _Group(GroupCoordinator):
    def __init__(self, rank: int, tp: int) -> None:
        super().__init__(list(range(tp)), rank, torch.device("cpu"))


class _OneMLP(nn.Module):
    """gate/up (column-parallel) and down (row-parallel, here over K inputs too) of one
    decoder layer, named as the model names them; `elsewhere`: another stage holds it."""

    def __init__(self, elsewhere: bool = False) -> None:
        super().__init__()
        mlp = nn.Module()
        mlp.gate_up_proj = MergedColumnParallelLinear(
            K, [GATE_UP, GATE_UP], ["gate", "up"], False, torch.float32
        )
        mlp.down_proj = RowParallelLinear(K, DOWN, False, torch.float32)
        layer = nn.Module()
        layer.mlp = mlp
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])
        self.elsewhere = elsewhere

    def checkpoint_target(self, name: str):
        return fused_param_name(name)

    def on_other_stage(self, param_name: str) -> bool:
        return self.elsewhere


FORMATS = {
    "gptq-g128-act-order": (
        lambda w, g: quantize_weight(w, Scheme(128, desc_act=True, sym=False), g),
        gptq_swap.keep_gptq_weights,
        Scheme(128, desc_act=True, sym=False).quantization_config(),
        lambda config: gptq_swap.LAYOUT,
    ),
    "awq-g64": (
        lambda w, g: quantize_awq(w, AWQScheme(64), g),
        awq_swap.keep_awq_weights,
        AWQScheme(64).quantization_config(),
        lambda config: awq_swap.LAYOUT,
    ),
    "w4a16-g32-asym": (
        lambda w, g: quantize_packed(w, CTScheme(4, 32, symmetric=False), g),
        ct_pack_swap.keep_pack_quantized_weights,
        CTScheme(4, 32, symmetric=False).quantization_config(),
        ct_pack_swap.layout,
    ),
    "w8a16-g128-asym-actorder": (
        lambda w, g: quantize_packed(w, CTScheme(8, 128, symmetric=False, actorder=True), g),
        ct_pack_swap.keep_pack_quantized_weights,
        CTScheme(8, 128, symmetric=False, actorder=True).quantization_config(),
        ct_pack_swap.layout,
    ),
}


@pytest.fixture
def checkpoint(tmp_path, request):
    """(directory, keep_*_weights, quantization_config, layout) of FORMATS[param]."""
    quantize, keep, config, layout = FORMATS[request.param]
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for projection, rows in (("gate_proj", GATE_UP), ("up_proj", GATE_UP), ("down_proj", DOWN)):
        weight = torch.randn(rows, K, generator=generator)
        for leaf, tensor in quantize(weight, generator).items():
            tensors[f"{PREFIX}.{projection}.{leaf}"] = tensor.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path), keep, config, layout(config)


@pytest.fixture
def reads(monkeypatch):
    """Every packed tensor read: (name, dimension cut or None, first, last element)."""
    recorded: list[tuple[str, int | None, int, int]] = []
    read = packed_reads.read_stored

    def recording(checkpoint, stored, dim, first, last):
        recorded.append((stored.name, dim, first, last))
        return read(checkpoint, stored, dim, first, last)

    monkeypatch.setattr(packed_reads, "read_stored", recording)
    return recorded


def _built(monkeypatch, directory, keep, config, rank: int, tp: int, elsewhere=False):
    group = _Group(rank, tp)
    monkeypatch.setattr(parallel_linear, "get_tp_group", lambda: group)
    model = _OneMLP(elsewhere)
    consumed = keep(model, directory, config)
    return model.model.layers[0].mlp, consumed


def _outputs_read(reads, layout, leaf: str, projection: str) -> range:
    """The outputs of `projection` whose `leaf` elements were read (once)."""
    name = f"{PREFIX}.{projection}.{leaf}"
    ((_, dim, first, last),) = [r for r in reads if r[0] == name]
    axis, per_element = layout.axes(f"{PREFIX}.{projection}")[leaf]
    assert dim == axis
    return range(first * per_element, last * per_element)


@pytest.mark.parametrize("checkpoint", list(FORMATS), indirect=True)
@pytest.mark.parametrize("tp", [2, 3])
def test_each_rank_reads_its_rows_and_computes_one_ranks_columns(
    monkeypatch, checkpoint, reads, tp
):
    directory, keep, config, layout = checkpoint
    x = outlier_input(5, K)
    whole, _ = _built(monkeypatch, directory, keep, config, 0, 1)
    whole_down, whole_gate_up = whole.down_proj(x), whole.gate_up_proj.split(whole.gate_up_proj(x))
    reads.clear()
    for rank in range(tp):
        mlp, _ = _built(monkeypatch, directory, keep, config, rank, tp)
        # down (row-parallel): its output rows over the whole K, widened to whole words.
        keep_rows = output_row_slice(DOWN, rank, tp)
        read = _outputs_read(reads, layout, layout_leaf(layout), "down_proj")
        assert read.start <= keep_rows.start and keep_rows.start + keep_rows.rows <= read.stop
        assert len(read) < keep_rows.rows + 2 * packed_reads.WORD_OUTPUTS
        mine = torch.empty(len(x), mlp.down_proj.out_features)
        mlp.down_proj.matmul_into(x, mine)
        assert torch.equal(mine, rank_columns(whole_down, keep_rows))
        # gate/up (column-parallel): each shard's rows of this rank, exactly.
        share = GATE_UP // tp
        for projection in ("gate_proj", "up_proj"):
            read = _outputs_read(reads, layout, layout_leaf(layout), projection)
            assert read == range(rank * share, (rank + 1) * share)
        for mine, whole_part in zip(
            mlp.gate_up_proj.split(mlp.gate_up_proj(x)), whole_gate_up, strict=True
        ):
            assert torch.equal(mine, whole_part[:, rank * share : (rank + 1) * share])
        # Whatever is not along the outputs (act-order's g_idx, a shape) is read whole.
        assert all(dim is None for name, dim, _, _ in reads if name.endswith("g_idx"))
        reads.clear()


def layout_leaf(layout) -> str:
    """The format's weight tensor (the largest it stores)."""
    leaf, _ = layout.rows
    return {"scales": "qweight", "weight_scale": "weight_packed"}[leaf]


@pytest.mark.parametrize("checkpoint", ["awq-g64"], indirect=True)
def test_a_stage_reads_none_of_another_stages_layers(monkeypatch, checkpoint, reads):
    directory, keep, config, _ = checkpoint
    mlp, consumed = _built(monkeypatch, directory, keep, config, 0, 1, elsewhere=True)
    assert reads == []
    assert len(consumed) == 3 * 3  # every tensor of gate, up and down: the loader skips them
    assert isinstance(mlp.down_proj, RowParallelLinear)  # left for its own stage


def test_zero_points_of_another_layout_are_refused_before_a_rank_cuts_them(monkeypatch, tmp_path):
    """qzeros int32 [G, N] (one zero point a word) cut to a rank's words would have the
    window's shape; its length along the outputs is checked first, as one rank checks it."""
    scheme = Scheme(128, desc_act=False, sym=False)
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for projection, rows in (("gate_proj", GATE_UP), ("up_proj", GATE_UP), ("down_proj", DOWN)):
        layer = quantize_weight(torch.randn(rows, K, generator=generator), scheme, generator)
        for leaf, tensor in layer.items():
            tensors[f"{PREFIX}.{projection}.{leaf}"] = tensor.contiguous()
    tensors[f"{PREFIX}.down_proj.qzeros"] = torch.full((K // 128, DOWN), 8, dtype=torch.int32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = scheme.quantization_config()
    with pytest.raises(ValueError, match=r"down_proj'.*qzeros \(3, 104\) does not hold 104"):
        _built(monkeypatch, str(tmp_path), gptq_swap.keep_gptq_weights, config, 1, 2)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_a_symmetric_layers_zero_points_are_never_cut_by_rank(symmetric):
    """A symmetric layer's zero points are unused (the midpoint is): a stored tensor of them,
    of whatever layout, is read whole and ignored at any tp, as at tp=1, not checked as
    outputs packed 32 / bits a word; an asymmetric layer's are cut as its rows are."""
    config = CTScheme(4, 128, symmetric=symmetric).quantization_config()
    axes = ct_pack_swap.layout(config).axes("model.layers.0.self_attn.q_proj")
    assert ("weight_zero_point" in axes) is not symmetric
    assert axes["weight_packed"] == (0, 1)
