"""compressed-tensors `pack-quantized` checkpoints (llm-compressor's W4A16 and W8A16)
served on their packed weights: the reader's dequantization equals the format's exactly
(groups or channels, symmetric or not, with group activation order), the kernel layer
multiplies by those weights (4-bit with no min table, 8-bit with and without one), layers
find their config group's scheme by its targets, and the engine's greedy tokens are
Transformers' on the same model with the dequantized weights (log-probabilities within
tolerance), the ignored head unquantized and the weights held within 10% of the
checkpoint's bytes.

The test checkpoints' packing (tests/ct_writer.py) was checked once against
compressed-tensors 0.20.1's own `PackedQuantizationCompressor.decompress` (not a test
dependency: it pulls loguru and pydantic in): equal bit for bit in the scale's dtype
for W4 group 128 symmetric, W4 group 32 and per channel asymmetric, W8 per channel
symmetric and W8 group 128 asymmetric; 0.20.1 no longer reads activation order "group"
(weight_g_idx), which older llm-compressor checkpoints carry and pagedllm reads as GPTQ's
g_idx. Run tests/format_library_check.py with the library to repeat it.
"""

from __future__ import annotations

import pytest
import torch
from ct_writer import CTScheme, quantize_packed, reference_dequantize, write_ct_checkpoint
from packed_checks import LOGPROB_TOLERANCE, check_engine, dummy_and_checkpoint_layers
from quantized_llama import SHAPE, make_quantizable_llama

from pagedllm.model.layers.ct_pack_swap import layout
from pagedllm.model.layers.gptq_linear import GPTQLinear
from pagedllm.model.layers.linear import Linear
from pagedllm.model.layers.packed_swap import swap_packed_layers
from pagedllm.model.quantization.ct_pack_format import PackedTensors, unpack_pack_quantized
from pagedllm.model.quantization.ct_pack_quantized import layer_scheme, packed_scheme

SCHEMES = [
    CTScheme(4, 128, symmetric=True),
    CTScheme(4, 32, symmetric=False),
    CTScheme(4, -1, symmetric=False),
    CTScheme(4, 64, symmetric=False, actorder=True),
    CTScheme(8, -1, symmetric=True),
    CTScheme(8, 128, symmetric=False),
]


def _unpacked(weight: torch.Tensor, scheme: CTScheme, seed: int = 0):
    tensors = quantize_packed(weight, scheme, torch.Generator().manual_seed(seed))
    group = scheme.quantization_config()["config_groups"]["group_0"]
    return tensors, unpack_pack_quantized(PackedTensors(**tensors), packed_scheme(group))


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_dequantized_weights_are_the_formats_exactly(scheme):
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    tensors, unpacked = _unpacked(weight, scheme)
    reference = reference_dequantize(tensors, scheme)
    assert torch.equal(unpacked.dequantize(), reference)
    assert (unpacked.order is not None) == scheme.actorder
    assert unpacked.symmetric == scheme.symmetric
    # The round trip is a quantization of the weight (a wrong layout would be far off).
    bound = (0.2 if scheme.bits == 4 else 0.02) * weight.abs().max()
    assert (reference - weight).abs().max() < bound


def test_values_are_stored_offset_and_packed_along_the_inputs():
    """Row 0 of weight_packed holds input k's q + 8 at bits 4k: a weight of one scale step
    at input 1 is 0x90 in the first word (0x8 at inputs 0, 2..7)."""
    weight = torch.zeros(8, 32)
    weight[:, 0] = -7.5  # sets the scale to 1 (symmetric: max |w| / 7.5)
    weight[0, 1] = 1.0
    tensors = quantize_packed(weight, CTScheme(4, 32), torch.Generator())
    assert tensors["weight_packed"].shape == (8, 4)
    assert tensors["weight_packed"][0, 0].item() == 0x88888890 - 2**32


def _zero_points_unpacked(tensors: dict) -> None:  # int8 [N, G], as a writer might forget
    tensors["weight_zero_point"] = torch.zeros(48, 8, dtype=torch.int8)


MALFORMED = {
    "zero points unpacked": (CTScheme(4, 32, symmetric=False), None, _zero_points_unpacked),
    "8-bit words read as 4-bit": (CTScheme(8, 32), CTScheme(4, 32), None),
    "no inputs": (CTScheme(4, -1), None, lambda t: t.update(weight_shape=torch.tensor([48, 0]))),
    "int64 words": (
        CTScheme(4, 32), None, lambda t: t.update(weight_packed=t["weight_packed"].long())
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_packed_tensors_are_refused_before_they_are_read(case):
    """A shape or dtype off is refused, never trimmed to fit and served as other values."""
    written, read_as, spoil = MALFORMED[case]
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(4))
    tensors = quantize_packed(weight, written, torch.Generator())
    if spoil is not None:
        spoil(tensors)
    group = (read_as or written).quantization_config()["config_groups"]["group_0"]
    with pytest.raises(ValueError, match="weight_"):
        unpack_pack_quantized(PackedTensors(**tensors), packed_scheme(group))


@pytest.mark.parametrize("isa", [0, 1, 2], ids=["portable", "avx2", "vnni"])
@pytest.mark.parametrize("scheme", [SCHEMES[0], SCHEMES[4], SCHEMES[5]], ids=str)
def test_layer_multiplies_by_the_dequantized_weights(scheme, isa):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 256, generator=generator)
    _, unpacked = _unpacked(weight, scheme)
    layer = GPTQLinear(unpacked)
    assert (layer.mins.numel() == 0) == scheme.symmetric  # the kernel derives m then
    layer.isa = isa  # lowered to what this CPU has
    x = torch.randn(5, 256, generator=generator)
    torch.testing.assert_close(layer(x), x @ unpacked.dequantize().T, rtol=1e-4, atol=1e-3)


def test_a_layer_takes_the_scheme_of_the_group_its_name_matches():
    groups = {
        "attention": {
            "targets": ["re:.*self_attn\\..*", "model.layers.1.mlp.down_proj"],
            "weights": CTScheme(8, -1).quantization_config()["config_groups"]["group_0"]["weights"],
        },
        "rest": CTScheme(4, 128).quantization_config()["config_groups"]["group_0"],
    }
    config = {"config_groups": groups}
    assert layer_scheme(config, "model.layers.0.self_attn.q_proj").bits == 8
    assert layer_scheme(config, "model.layers.1.mlp.down_proj").bits == 8
    assert layer_scheme(config, "model.layers.0.mlp.down_proj").group_size == 128
    with pytest.raises(ValueError, match="matches no config group"):
        layer_scheme(
            {"config_groups": {"g": {**groups["attention"]}}}, "model.layers.0.mlp.up_proj"
        )


def _weights(bits: int, group_size: int) -> dict:
    return CTScheme(bits, group_size).quantization_config()["config_groups"]["group_0"]["weights"]


def test_a_name_outranks_a_regex_which_outranks_the_class_whatever_the_group_order():
    """compressed-tensors ranks a layer's matching targets, not its groups' order: a
    "Linear" group listed first must not give down_proj its 4-bit scheme."""
    config = {
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": _weights(4, 32)},
            "group_1": {"targets": ["re:.*down_proj"], "weights": _weights(8, 32)},
            "group_2": {"targets": ["model.layers.0.mlp.down_proj"], "weights": _weights(4, 64)},
        }
    }
    assert layer_scheme(config, "model.layers.1.mlp.down_proj").bits == 8
    assert layer_scheme(config, "model.layers.0.mlp.down_proj").group_size == 64
    assert layer_scheme(config, "model.layers.0.mlp.up_proj").group_size == 32


def test_a_layer_two_groups_claim_alike_with_different_schemes_is_refused():
    config = {
        "config_groups": {
            "a": {"targets": ["re:.*proj"], "weights": _weights(4, 32)},
            "b": {"targets": ["re:.*down_proj"], "weights": _weights(8, 32)},
            "c": {"targets": ["re:.*up_proj"], "weights": _weights(8, 32)},
        }
    }
    with pytest.raises(ValueError, match="'a', 'b'"):
        layer_scheme(config, "model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="'a', 'c'"):
        layer_scheme(config, "model.layers.0.mlp.up_proj")
    config["config_groups"]["b"]["weights"] = _weights(4, 32)  # the same scheme: no doubt
    assert layer_scheme(config, "model.layers.0.mlp.down_proj").bits == 4


class _HeadOnly(torch.nn.Module):
    """A model whose one linear layer is its head, named as the loader names it."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = Linear(64, 48, False, torch.float32)

    def checkpoint_target(self, name: str) -> tuple[str, None]:
        return name, None


def test_a_packed_head_is_refused_by_name():
    """A head quantized with no `ignore` would run as a plain packed layer: no logits
    gathered across ranks, and the head is documented unquantized."""
    tensors = quantize_packed(torch.randn(48, 64), CTScheme(4, 32), torch.Generator())

    def unpack(prefix, layer_tensors):  # the refusal comes before any layer is read
        raise AssertionError(f"{prefix} was unpacked")

    with pytest.raises(ValueError, match=r"'lm_head'.*heads are not served"):
        config = CTScheme(4, 32).quantization_config()
        method = "compressed-tensors"
        swap_packed_layers(_HeadOnly(), {"lm_head": tensors}, unpack, method, layout(config))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_quantizable_llama(tmp_path_factory)


@pytest.mark.parametrize(
    ("scheme", "layers", "most"),
    [
        # Symmetric: no min table, the checkpoint's bf16 scale per group.
        (CTScheme(4, 128, symmetric=True), 4, 1.10),
        (CTScheme(8, -1, symmetric=True), 4, 1.10),
        # Per part act-orders: q, k, v and gate, up one layer each; groups of 32 keep the
        # bf16 scale and a uint8 zero point: 3 bytes where the checkpoint stores 2.5.
        (CTScheme(4, 32, symmetric=False, actorder=True), 7, 1.10),
    ],
    ids=str,
)
def test_engine_is_transformers_on_the_dequantized_model(
    tiny_llama, tmp_path, scheme, layers, most
):
    quantized, dequantized = tmp_path / "ct", tmp_path / "dequantized"
    ct_bytes = write_ct_checkpoint(tiny_llama, quantized, dequantized, scheme)
    check = check_engine(quantized, dequantized, "compressed-tensors")
    print(f"{scheme}: {check}, checkpoint {ct_bytes} bytes")
    assert check.largest_logprob_error < LOGPROB_TOLERANCE
    assert check.packed_layers == 2 * layers
    assert 0.9 * ct_bytes <= check.held_bytes <= most * ct_bytes
    assert check.largest_layer_parameter <= SHAPE["hidden_size"]  # no fp32 copy left behind


@pytest.mark.parametrize(
    ("scheme", "layers"),
    [(CTScheme(8, -1, symmetric=True), 4), (CTScheme(4, 32, symmetric=False, actorder=True), 7)],
    ids=str,
)
def test_dummy_weights_are_random_packed_layers_of_the_checkpoints_shapes(
    tiny_llama, tmp_path, scheme, layers
):
    """A config.json alone with load_format="dummy": the same packed layers (8-bit without
    a min table; act-order's parts apart), holding the same bytes, as the checkpoint of that
    config; the model generates."""
    quantized = tmp_path / "ct"
    write_ct_checkpoint(tiny_llama, quantized, tmp_path / "dequantized", scheme)
    held = dummy_and_checkpoint_layers(quantized, tmp_path / "shape-only")
    assert held["dummy"] == held["checkpoint"] and len(held["dummy"]) == 2 * layers
