"""Which layers a packed checkpoint's config quantizes, and how, read from the config alone
(`model/quantization/packed_schemes.py`): what dummy weights are made for."""

from __future__ import annotations

from awq_writer import AWQScheme
from ct_writer import CTScheme

from pagedllm.model.quantization.packed_schemes import PackedLayerScheme, layer_schemes

DOWN = "model.layers.0.mlp.down_proj"
Q = "model.layers.0.self_attn.q_proj"


def test_awq_leaves_the_modules_not_to_convert_unquantized():
    schemes = layer_schemes(
        "awq", AWQScheme(32, not_converted=("down_proj",)).quantization_config()
    )
    assert schemes(DOWN) is None
    assert schemes(Q) == PackedLayerScheme(4, 32, sym=False, desc_act=False)


def test_pack_quantized_layers_take_their_groups_scheme_unless_ignored():
    config = CTScheme(4, 64, symmetric=False, actorder=True).quantization_config()
    config["ignore"] = ["lm_head", "re:.*down_proj$"]
    config["config_groups"]["group_1"] = {
        "targets": [Q],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    }
    schemes = layer_schemes("compressed-tensors", config)
    assert schemes(DOWN) is None and schemes("lm_head") is None
    assert schemes("model.layers.0.mlp.up_proj") == PackedLayerScheme(4, 64, False, True)
    assert schemes(Q) == PackedLayerScheme(8, -1, True, False)  # its name outranks Linear


def test_a_layer_no_group_targets_is_left_unquantized():
    config = CTScheme(8, 128, symmetric=True).quantization_config()
    config["config_groups"]["group_0"]["targets"] = ["re:.*mlp.*"]
    schemes = layer_schemes("compressed-tensors", config)
    assert schemes(Q) is None
    assert schemes(DOWN) == PackedLayerScheme(8, 128, True, False)
