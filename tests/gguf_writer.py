"""Writing tiny Hugging Face models to GGUF the way llama.cpp's converter does (metadata
keys, blk.N.* names, reversed dims, q/k row permutation for Llama), for the loader's and the
GGUF-quantization tests."""

from __future__ import annotations

import math
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


# --------------------------------------------------------------------------- more architectures
# Qwen3, Qwen3-MoE, Phi-3 and Mixtral/Mistral (llama files) as llama.cpp's convert_hf_to_gguf.py
# writes them (Qwen3Model, Qwen3MoeModel, Phi3MiniModel, LlamaModel), from Transformers'
# in-memory tensors (experts stacked).

CONVERTED_BLOCK_NAMES = {
    **HF_TO_GGUF_BLOCK,
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3 keeps q/k/v fused, its rows as they are
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate rows, then up rows
    "mlp.gate": "ffn_gate_inp",  # an MoE router
    "mlp.experts.down_proj": "ffn_down_exps",  # stacked [experts, hidden, intermediate]
}


def converted_tensors(model: torch.nn.Module, arch: str):
    """(GGUF name, array) of each tensor: a tied head dropped, llama files' q/k rows permuted,
    each layer's stacked gate_up experts split into ffn_gate_exps and ffn_up_exps."""
    config = model.config
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if hf_name in HF_TO_GGUF_GLOBAL:
            yield HF_TO_GGUF_GLOBAL[hf_name], array
            continue
        _, _, layer, module = hf_name.split(".", 3)
        if module == "mlp.experts.gate_up_proj":
            gate, up = np.split(array, 2, axis=1)
            yield f"blk.{layer}.ffn_gate_exps.weight", gate
            yield f"blk.{layer}.ffn_up_exps.weight", up
            continue
        suffix = "weight"  # a stacked parameter's name has none
        if module not in CONVERTED_BLOCK_NAMES:
            module, _, suffix = module.rpartition(".")
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if "q_proj" in module else config.num_key_value_heads
            array = converter_permute(array, heads)
        yield f"blk.{layer}.{CONVERTED_BLOCK_NAMES[module]}.{suffix}", array


def converted_writer(path: Path, model: torch.nn.Module, arch: str, name: str = "tiny"):
    """A GGUFWriter holding the metadata llama.cpp's converter writes for `model`; the
    caller may add keys before `write_converted_tensors` and `finish`."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    for add, value in [
        (writer.add_context_length, config.max_position_embeddings),
        (writer.add_embedding_length, config.hidden_size),
        (writer.add_block_count, config.num_hidden_layers),
        (writer.add_feed_forward_length, config.intermediate_size),
        (writer.add_head_count, config.num_attention_heads),
        (writer.add_head_count_kv, config.num_key_value_heads),
        (writer.add_rope_freq_base, config.rope_parameters["rope_theta"]),
        (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
        (writer.add_key_length, getattr(config, "head_dim", None)),  # if the config has one
        (writer.add_value_length, getattr(config, "head_dim", None)),
        (writer.add_expert_count, getattr(config, "num_local_experts", None)),
        (writer.add_expert_used_count, getattr(config, "num_experts_per_tok", None)),
        (writer.add_expert_feed_forward_length, getattr(config, "moe_intermediate_size", None)),
        (writer.add_bos_token_id, config.bos_token_id),
        (writer.add_eos_token_id, config.eos_token_id),
        (writer.add_pad_token_id, config.pad_token_id),
    ]:  # fmt: skip
        if value is not None:
            add(value)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.head_dim)
    if arch == "phi3":
        _write_phi3_metadata(writer, config)
    writer.add_tokenizer_model("gpt2")
    # Only llama files record vocab_size; readers of the others count the vocabulary.
    writer.add_token_list([f"<{i}>" for i in range(config.vocab_size)])
    return writer


def _write_phi3_metadata(writer: gguf.GGUFWriter, config: PreTrainedConfig) -> None:
    """Phi3MiniModel's keys: the pre-training context, the rotated dimensions per head, the
    window (0: none) and, for LongRoPE, its scale and both factor sets as tensors."""
    rope, original = config.rope_parameters, config.original_max_position_embeddings
    rotated = int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(rotated // config.num_attention_heads)
    writer.add_sliding_window(config.sliding_window or 0)
    if rope["rope_type"] != "longrope":
        return
    growth = config.max_position_embeddings / original
    scale = math.sqrt(1 + math.log(growth) / math.log(original)) if growth > 1 else 1.0
    writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    writer.add_rope_scaling_attn_factors(scale)
    for kind in ("long", "short"):
        factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
        writer.add_tensor(f"rope_factors_{kind}.weight", factors)


def write_converted_tensors(
    writer: gguf.GGUFWriter, model: torch.nn.Module, arch: str, qtype: Q = Q.F32
) -> None:
    """Matrices and stacked experts in `qtype`; vectors and the router in F32 (llama.cpp's
    quantizer leaves ffn_gate_inp alone)."""
    for name, array in converted_tensors(model, arch):
        keep_f32 = array.ndim < 2 or ".ffn_gate_inp." in name
        add_tensor(writer, name, array, Q.F32 if keep_f32 else qtype)


def write_converted_gguf(
    path: Path, model: torch.nn.Module, arch: str, qtype: Q = Q.F32, name: str = "tiny"
) -> str:
    writer = converted_writer(path, model, arch, name)
    write_converted_tensors(writer, model, arch, qtype)
    finish(writer)
    return str(path)
