"""Writing tiny Hugging Face models to GGUF the way llama.cpp's converter does (metadata
keys, blk.N.* names, reversed dims, q/k row permutation for Llama), for the loader's and the
GGUF-quantization tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def to_gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF_GLOBAL:
        return HF_TO_GGUF_GLOBAL[hf_name]
    _, _, layer, *module, suffix = hf_name.split(".")
    return f"blk.{layer}.{HF_TO_GGUF_BLOCK['.'.join(module)]}.{suffix}"


def converter_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (the thing being undone)."""
    rows = weight.shape[0]
    split = weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: Q) -> None:
    data = gguf.quants.quantize(array.astype(np.float32), qtype)
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def write_metadata(writer: gguf.GGUFWriter, arch: str, config: PreTrainedConfig, name: str) -> None:
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)


def write_model_gguf(
    path: Path, model: torch.nn.Module, arch: str, qtype_of, name: str = "tiny"
) -> dict[str, Q]:
    """Write ``model`` like llama.cpp would; returns the type of each HF tensor."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, arch, config, name)
    types = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the converter drops tied heads
        array = tensor.detach().numpy()
        gguf_name = to_gguf_name(hf_name)
        if arch == "llama" and ".attn_q." in gguf_name:
            array = converter_permute(array, config.num_attention_heads)
        if arch == "llama" and ".attn_k." in gguf_name:
            array = converter_permute(array, config.num_key_value_heads)
        types[hf_name] = qtype_of(gguf_name) if array.ndim == 2 else Q.F32
        add_tensor(writer, gguf_name, array, types[hf_name])
    finish(writer)
    return types


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_model(model_type: str, **overrides) -> torch.nn.Module:
    settings = dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    settings.update(overrides)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
