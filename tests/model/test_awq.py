"""AutoAWQ GEMM checkpoints served on their packed 4-bit weights: the reader undoes AWQ's
interleaved nibble order and its dequantization equals the format's exactly, the kernel
layer multiplies by those weights, and the engine's greedy tokens are Transformers' on the
same model with the dequantized weights (log-probabilities within tolerance), with q/k/v and
gate/up fused from separately quantized parts, `modules_to_not_convert` left fp32, and the
weights held within 10% of the checkpoint's bytes (groups of 32 and 128).

The test checkpoints' packing (tests/awq_writer.py) was checked once against AutoAWQ
0.2.9's own `awq.utils.packing_utils.dequantize_gemm` (AutoAWQ needs a GPU to quantize and
is not a test dependency): equal bit for bit in its fp16 for groups of 128, 32 and per
channel; run tests/format_library_check.py with AutoAWQ's sources to repeat it.
"""

from __future__ import annotations

import pytest
import torch
from awq_writer import AWQScheme, quantize_awq, reference_dequantize, write_awq_checkpoint
from packed_checks import LOGPROB_TOLERANCE, check_engine, dummy_and_checkpoint_layers
from quantized_llama import SHAPE, make_quantizable_llama

from pagedllm.model.layers.gptq_linear import GPTQLinear
from pagedllm.model.quantization.awq import AWQConfig
from pagedllm.model.quantization.awq_format import AWQTensors, unpack_awq, unpack_awq_columns

SCHEMES = [AWQScheme(128), AWQScheme(32), AWQScheme(-1)]


def _unpacked(weight: torch.Tensor, scheme: AWQScheme):
    tensors = quantize_awq(weight, scheme)
    config = AWQConfig.from_dict(scheme.quantization_config())
    return tensors, unpack_awq(AWQTensors(**tensors), config)


def test_columns_are_read_in_awqs_interleaved_order():
    """Columns 0..7 holding 0..7 pack as nibbles 0, 2, 4, 6, 1, 3, 5, 7 (AutoAWQ's order)."""
    word = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert unpack_awq_columns(word).tolist() == [list(range(8))]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_dequantized_weights_are_the_formats_exactly(scheme):
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    tensors, unpacked = _unpacked(weight, scheme)
    reference = reference_dequantize(tensors, scheme)
    assert torch.equal(unpacked.dequantize(), reference)
    assert unpacked.order is None and not unpacked.symmetric
    # The round trip is a quantization of the weight (a wrong layout would be far off).
    assert (reference - weight).abs().max() < 0.2 * weight.abs().max()


@pytest.mark.parametrize("isa", [0, 1, 2], ids=["portable", "avx2", "vnni"])
def test_layer_multiplies_by_the_dequantized_weights(isa):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 256, generator=generator)
    _, unpacked = _unpacked(weight, AWQScheme(64))
    layer = GPTQLinear(unpacked)
    layer.isa = isa  # lowered to what this CPU has
    x = torch.randn(5, 256, generator=generator)
    torch.testing.assert_close(layer(x), x @ unpacked.dequantize().T, rtol=1e-4, atol=1e-3)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_quantizable_llama(tmp_path_factory)


@pytest.mark.parametrize(
    ("scheme", "most"),
    # Groups of 32 keep the fp16 scale and a uint8 zero point per group and column: 3 bytes
    # where the checkpoint stores 2.5.
    [(AWQScheme(128), 1.10), (AWQScheme(32, not_converted=("down_proj",)), 1.10)],
    ids=str,
)
def test_engine_is_transformers_on_the_dequantized_model(tiny_llama, tmp_path, scheme, most):
    quantized, dequantized = tmp_path / "awq", tmp_path / "dequantized"
    awq_bytes = write_awq_checkpoint(tiny_llama, quantized, dequantized, scheme)
    check = check_engine(quantized, dequantized, "awq")
    print(f"{scheme}: {check}, checkpoint {awq_bytes} bytes")
    assert check.largest_logprob_error < LOGPROB_TOLERANCE
    # qkv, o, gate_up, down in each of 2 layers, less those AWQ did not convert
    assert check.packed_layers == 2 * (4 - len(scheme.not_converted))
    assert 0.9 * awq_bytes <= check.held_bytes <= most * awq_bytes
    # No fp32 copy of a packed weight is left behind; a layer not converted keeps its own.
    down_proj = SHAPE["hidden_size"] * SHAPE["intermediate_size"]
    fp32_largest = down_proj if scheme.not_converted else SHAPE["hidden_size"]
    assert check.largest_layer_parameter == fp32_largest


def test_dummy_weights_are_random_packed_layers_of_the_checkpoints_shapes(tiny_llama, tmp_path):
    """A config.json alone with load_format="dummy": the same packed layers, holding the same
    bytes, as the checkpoint of that config (down_proj, not converted, left fp32 in both);
    the model generates."""
    quantized = tmp_path / "awq"
    scheme = AWQScheme(32, not_converted=("down_proj",))
    write_awq_checkpoint(tiny_llama, quantized, tmp_path / "dequantized", scheme)
    held = dummy_and_checkpoint_layers(quantized, tmp_path / "shape-only")
    assert held["dummy"] == held["checkpoint"] and len(held["dummy"]) == 2 * 3


def test_a_dummy_draft_stored_awq_is_packed_too(tiny_llama, tmp_path):
    """A draft's checkpoint method takes dummy weights as a target's does."""
    from pagedllm.config import EngineArgs
    from pagedllm.core.engine_config import load_engine_config

    quantized = tmp_path / "awq"
    write_awq_checkpoint(tiny_llama, quantized, tmp_path / "dequantized", AWQScheme(128))
    draft = {"method": "draft_model", "model": str(quantized), "num_speculative_tokens": 3}
    args = EngineArgs(
        model=str(tiny_llama), load_format="dummy", speculative_config=draft,
        skip_tokenizer_init=True,
    )  # fmt: skip
    _, _, config = load_engine_config(args, log=False)
    assert config.draft_model_config.quantization == "awq"
    assert config.draft_model_config.load_format == "dummy"
