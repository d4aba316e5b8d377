"""The GGUF <-> Hugging Face tensor names come from gguf-py's tables for every architecture
the GGUF loader reads: each parameter of each architecture's tiny Transformers model has a
GGUF name (a mixture's stacked gate_up experts: two, gate then up) that maps back to it, so
a gguf-py upgrade that drops or changes a name fails here naming the tensor and the
version. A name gguf-py lacks is refused at load, naming the tensor."""

from __future__ import annotations

import gguf
import pytest
import torch
from model_utils import TINY_CONFIGS
from transformers import AutoConfig, AutoModelForCausalLM

from pagedllm.model.gguf.config import GGUF_ARCHITECTURES
from pagedllm.model.gguf.tensor_names import (
    GGUF_PY_VERSION,
    gguf_tensor_names,
    hf_names_by_gguf,
    model_tensor_names,
    plan_tensors,
)
from pagedllm.model.gguf.tensor_table import GGUFTensor

# Transformers' class -> the general.architecture llama.cpp's converter writes for it.
GGUF_ARCH_OF = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
}


def _tiny_config(architecture: str):
    settings = {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
        **TINY_CONFIGS[architecture],
    }  # fmt: skip
    model_type = settings.pop("model_type")
    return AutoConfig.for_model(model_type, architectures=[architecture], **settings)


def _parameter_names(config) -> list[str]:
    with torch.device("meta"):
        return list(AutoModelForCausalLM.from_config(config).state_dict())


def test_every_loaded_architecture_is_covered() -> None:
    # "mistral" is read by llama's names (gguf-py has no table of its own for it).
    assert GGUF_ARCHITECTURES - {"mistral"} == set(GGUF_ARCH_OF.values())
    assert set(GGUF_ARCH_OF) <= set(TINY_CONFIGS)


@pytest.mark.parametrize("architecture", sorted(GGUF_ARCH_OF))
def test_every_parameter_maps_to_gguf_and_back(architecture: str) -> None:
    config, arch = _tiny_config(architecture), GGUF_ARCH_OF[architecture]
    hf_names = _parameter_names(config)
    names = gguf_tensor_names(hf_names, arch, config.num_hidden_layers)
    by_gguf = hf_names_by_gguf(names)
    for hf_name in hf_names:
        assert hf_name in names, (
            f"gguf-py {GGUF_PY_VERSION} has no GGUF name for {hf_name} ({architecture}, {arch})"
        )
        for gguf_name in names[hf_name]:
            assert gguf_name.endswith((".weight", ".bias")), f"{hf_name} -> {gguf_name}"
            assert by_gguf[gguf_name] == hf_name, (
                f"gguf-py {GGUF_PY_VERSION}: {gguf_name} maps back to {by_gguf[gguf_name]}, "
                f"not {hf_name} ({architecture})"
            )
    assert model_tensor_names(config, arch) == names


@pytest.mark.parametrize(
    ("architecture", "hf_name", "expected"),
    [
        ("LlamaForCausalLM", "model.layers.1.self_attn.q_proj.weight", ("blk.1.attn_q.weight",)),
        ("Qwen2ForCausalLM", "model.layers.0.self_attn.k_proj.bias", ("blk.0.attn_k.bias",)),
        ("Gemma3ForCausalLM", "model.layers.2.pre_feedforward_layernorm.weight",
         ("blk.2.ffn_norm.weight",)),
        ("Gemma3ForCausalLM", "model.layers.0.post_attention_layernorm.weight",
         ("blk.0.post_attention_norm.weight",)),
        ("LlamaForCausalLM", "model.layers.0.post_attention_layernorm.weight",
         ("blk.0.ffn_norm.weight",)),
        ("Phi3ForCausalLM", "model.layers.0.self_attn.qkv_proj.weight", ("blk.0.attn_qkv.weight",)),
        ("Phi3ForCausalLM", "model.layers.1.mlp.gate_up_proj.weight", ("blk.1.ffn_up.weight",)),
        ("MixtralForCausalLM", "model.layers.1.mlp.experts.gate_up_proj",
         ("blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight")),
        ("Qwen3MoeForCausalLM", "model.layers.0.mlp.experts.down_proj",
         ("blk.0.ffn_down_exps.weight",)),
        ("Qwen3MoeForCausalLM", "model.layers.0.mlp.gate.weight", ("blk.0.ffn_gate_inp.weight",)),
        ("Qwen3MoeForCausalLM", "model.layers.1.mlp.gate_proj.weight", ("blk.1.ffn_gate.weight",)),
        ("LlamaForCausalLM", "lm_head.weight", ("output.weight",)),
    ],
)  # fmt: skip
def test_llama_cpps_names(architecture: str, hf_name: str, expected: tuple[str, ...]) -> None:
    config = _tiny_config(architecture)
    assert model_tensor_names(config, GGUF_ARCH_OF[architecture])[hf_name] == expected


def test_a_name_gguf_py_lacks_is_refused_naming_the_tensor(monkeypatch) -> None:
    config = _tiny_config("LlamaForCausalLM")
    real_get_name = gguf.TensorNameMap.get_name

    def without_q(self, key, try_suffixes=()):  # a gguf-py that dropped attn_q
        return None if ".q_proj" in key else real_get_name(self, key, try_suffixes)

    monkeypatch.setattr(gguf.TensorNameMap, "get_name", without_q)
    names = model_tensor_names(config, "llama")
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    tensor = GGUFTensor("blk.0.attn_q.weight", gguf.GGMLQuantizationType.F32, None, None, 0)
    message = rf"unknown GGUF tensor name 'blk\.0\.attn_q\.weight' \(gguf-py {GGUF_PY_VERSION}"
    with pytest.raises(ValueError, match=message):
        plan_tensors([tensor], "tiny.gguf", names)


def test_an_architecture_gguf_py_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match=rf"gguf-py {GGUF_PY_VERSION} has no tensor names"):
        gguf_tensor_names(["model.norm.weight"], "not-an-arch", 1)


def test_mistral_files_use_llamas_names() -> None:
    config = _tiny_config("MistralForCausalLM")
    assert model_tensor_names(config, "mistral") == model_tensor_names(config, "llama")
