"""Which checkpoint quantization a model asks for (config.json's `quantization_config`, as
vLLM reads it), whether `quantization` agrees, and the refusal of what is not served: each
message names the method and scheme and lists what is served."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.model.quantization.registry import METHODS, checkpoint_quantization

GPTQ_4BIT = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False}
AWQ_GEMM = {
    "quant_method": "awq",
    "bits": 4,
    "group_size": 128,
    "zero_point": True,
    "version": "gemm",
}
W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                "group_size": 128,
            },
            "input_activations": None,
        }
    },
    "ignore": ["lm_head"],
}  # fmt: skip
W8A8 = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
            "input_activations": {
                "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True,
            },
        }
    },
}  # fmt: skip
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _w8a8(weights: dict | None = None, activations: dict | None = None, **top) -> dict:
    """W8A8 with some of its weight / activation arguments (or top-level keys) changed."""
    group = W8A8["config_groups"]["group_0"]
    changed = {
        "weights": {**group["weights"], **(weights or {})},
        "input_activations": {**group["input_activations"], **(activations or {})},
    }
    return {**W8A8, "config_groups": {"group_0": changed}, **top}


def _fp8_ct_block(block: tuple = (128, 128), group_size: object = 128) -> dict:
    """compressed-tensors FP8 in blocks, activations per token and group."""
    weights = {"type": "float", "strategy": "block", "block_structure": list(block)}
    activations = {"type": "float", "strategy": "group", "group_size": group_size}
    return _w8a8(weights, activations, format="float-quantized")


def _config(quantization_config: dict | None) -> SimpleNamespace:
    return SimpleNamespace(quantization_config=quantization_config)


def test_the_registry_names_the_methods_vllm_detects():
    assert set(METHODS) == {"gptq", "awq", "compressed-tensors", "fp8"}


@pytest.mark.parametrize("requested", [None, "gptq"])
def test_a_served_gptq_checkpoint_picks_gptq(requested):
    assert checkpoint_quantization(_config(GPTQ_4BIT), requested) == "gptq"


@pytest.mark.parametrize(
    "quantization_config",
    [AWQ_GEMM, {**AWQ_GEMM, "version": "GEMM", "group_size": -1}, W4A16],
    ids=["awq", "awq-channel", "w4a16"],
)
def test_served_awq_and_pack_quantized_checkpoints_pick_their_method(quantization_config):
    name = quantization_config["quant_method"]
    assert checkpoint_quantization(_config(quantization_config), None) == name
    assert checkpoint_quantization(_config(quantization_config), name) == name


def _w4a16(weights: dict | None = None, **group) -> dict:
    """W4A16 with its one group's weights (or the group itself) changed."""
    group_0 = W4A16["config_groups"]["group_0"]
    changed = {**group_0, "weights": {**group_0["weights"], **(weights or {})}, **group}
    return {**W4A16, "config_groups": {"group_0": changed}}


@pytest.mark.parametrize("requested", [None, "int8", "gguf"])
def test_an_unquantized_checkpoint_keeps_what_was_asked(requested):
    assert checkpoint_quantization(_config(None), requested) == requested


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        ({**GPTQ_4BIT, "bits": 8}, r"gptq 8-bit group 128.*8-bit GPTQ weights have no kernel"),
        ({**GPTQ_4BIT, "bits": 3}, r"3-bit GPTQ weights"),
        ({**GPTQ_4BIT, "group_size": 48}, r"group size 48 is not -1 or 32 \* 2\^n"),
        ({**GPTQ_4BIT, "checkpoint_format": "marlin"}, r"checkpoint_format 'marlin'"),
        ({**GPTQ_4BIT, "lm_head": True}, r"quantized lm_head"),
        ({**GPTQ_4BIT, "dynamic": {"-:.*mlp.*": {}}}, r"'dynamic' overrides"),
        ({**AWQ_GEMM, "version": "gemv"}, r"awq 4-bit, group size 128.*gemv packing is not"),
        ({**AWQ_GEMM, "version": "gemv_fast"}, r"AWQ's gemv_fast packing is not read"),
        ({**AWQ_GEMM, "bits": 8}, r"8-bit AWQ weights have no kernel"),
        ({**AWQ_GEMM, "zero_point": False}, r"AWQ without zero points"),
        ({**AWQ_GEMM, "group_size": 96}, r"AWQ group size 96 is not -1 or 32 \* 2\^n"),
        (_w4a16({"num_bits": 2}), r"W2A16 int group 128.*2-bit weights have no kernel"),
        (_w4a16({"strategy": "tensor"}), r"weight strategy 'tensor' is not served"),
        (_w4a16({"group_size": 48}), r"group size 48 is not 32 \* 2\^n"),
        (_w4a16({"type": "float"}), r"float weights are not packed integers"),
        (_w4a16({"dynamic": True}), r"dynamic weight scales"),
        (_w4a16(input_activations={"num_bits": 8}), r"activations quantized to 8 bits"),
        ({**W4A16, "kv_cache_scheme": {"num_bits": 8}}, r"kv_cache_scheme is not read"),
        ({**W4A16, "format": "marlin-24"}, r"format 'marlin-24' is not read"),
        ({**W4A16, "quantization_status": "frozen"}, r"quantization_status 'frozen'"),
        (
            _w8a8(activations={"symmetric": False}),
            r"\(W8A8 int channel\) is not served \(asymmetric",
        ),
        (_w8a8(weights={"num_bits": 4}), r"4-bit weights are not 8-bit"),
        (_w8a8(weights={"strategy": "group", "group_size": 128}), r"weights quantized per group"),
        (_w8a8(activations={"strategy": "group"}), r"dynamic int activations per group"),
        (_w8a8(activations={"dynamic": "local"}), r"local int activations per token"),
        (_w8a8(activations={"type": "float"}), r"float activations with int weights"),
        (_w8a8(kv_cache_scheme={"num_bits": 8, "type": "float"}), r"kv_cache_scheme is not"),
        ({**FP8_BLOCK, "fmt": "e5m2"}, r"fp8 e5m2 weights \(blocks.*no reader"),
        ({**FP8_BLOCK, "activation_scheme": "static"}, r"static activation scales with block"),
        ({**FP8_BLOCK, "weight_block_size": [0, 128]}, r"\[0, 128\] is not two positive"),
        ({**FP8_BLOCK, "weight_block_size": [128, "128"]}, r"is not two positive integers"),
        (_fp8_ct_block(block=(128, 0)), r"block_structure \[128, 0\] is not two positive"),
        (_fp8_ct_block(group_size=-128), r"group_size -128 is not a positive integer"),
        ({"quant_method": "bitsandbytes"}, r"'bitsandbytes' are not supported"),
        # Present but null or not a number: refused, never a traceback from int().
        ({**GPTQ_4BIT, "group_size": None}, r"gptq checkpoint is not served \(group_size None"),
        ({**GPTQ_4BIT, "bits": "four"}, r"bits 'four' is not an integer"),
        ({**AWQ_GEMM, "group_size": None}, r"awq checkpoint is not served \(group_size None"),
        ({"quant_method": "awq", "w_bit": None}, r"w_bit None is not an integer"),
        (_w4a16(input_activations={"num_bits": None}), r"compressed-tensors checkpoint is not"),
    ],
)
def test_what_is_not_served_is_refused_naming_it_and_what_is(quantization_config, named):
    with pytest.raises(ValueError, match=named) as refusal:
        checkpoint_quantization(_config(quantization_config), None)
    assert "served: checkpoints stored quantized as gptq: gptq 4-bit" in str(refusal.value)


@pytest.mark.parametrize(
    ("quantization_config", "method"),
    [
        (W8A8, "compressed-tensors"),
        (_w8a8(weights={"type": "float"}, activations={"type": "float"}, format="float-quantized"),
         "compressed-tensors"),
        (FP8_BLOCK, "fp8"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "fp8"),
        (_fp8_ct_block(), "compressed-tensors"),
    ],
)  # fmt: skip
def test_served_8bit_checkpoints_pick_their_method(quantization_config, method):
    assert checkpoint_quantization(_config(quantization_config), None) == method
    assert checkpoint_quantization(_config(quantization_config), method) == method


def test_a_config_mixing_8bit_schemes_is_refused():
    per_tensor = _w8a8(weights={"strategy": "tensor"})["config_groups"]["group_0"]
    groups = {"a": W8A8["config_groups"]["group_0"], "b": per_tensor}
    mixed = {**W8A8, "config_groups": groups}
    with pytest.raises(ValueError, match="config groups with different schemes"):
        checkpoint_quantization(_config(mixed), None)


def test_quantization_must_agree_with_the_checkpoint():
    with pytest.raises(ValueError, match=r"quantization='int8' disagrees.*'gptq'"):
        checkpoint_quantization(_config(GPTQ_4BIT), "int8")
    with pytest.raises(ValueError, match=r"quantization='awq' disagrees"):
        checkpoint_quantization(_config(GPTQ_4BIT), "awq")


def test_a_checkpoint_method_needs_a_quantized_checkpoint():
    with pytest.raises(ValueError, match="has no quantization_config"):
        checkpoint_quantization(_config(None), "gptq")
