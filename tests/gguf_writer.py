"""Writing tiny Hugging Face models to GGUF the way llama.cpp's converter does (metadata
keys, reversed dims, q/k row permutation for Llama, stacked experts split), for the loader's
and the GGUF-quantization tests. Tensor names come from the loader's own mapping (gguf-py's
table), the one place either direction is named."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from benchmarks.gguf_files import add_model_shape, add_tensor, finish
from pagedllm.model.gguf.tensor_names import GGUF_PY_VERSION, TensorNames, gguf_tensor_names


def stored_names(model: torch.nn.Module, arch: str) -> TensorNames:
    """The GGUF tensors each of `model`'s parameters is stored as, by the loader's mapping
    (gguf-py's); a parameter it has no name for fails here, naming it."""
    hf_names = list(model.state_dict())
    names = gguf_tensor_names(hf_names, arch, model.config.num_hidden_layers)
    unnamed = [hf_name for hf_name in hf_names if hf_name not in names]
    if unnamed:
        raise KeyError(f"gguf-py {GGUF_PY_VERSION} names no {arch} tensor for {unnamed}")
    return names


def converter_rows(array: np.ndarray, hf_name: str, arch: str, config: PreTrainedConfig):
    """`array` with its rows in the converter's order: q/k rows permuted for llama files."""
    projection = hf_name.split(".")[-2]
    if arch != "llama" or projection not in ("q_proj", "k_proj"):
        return array
    heads = config.num_attention_heads if projection == "q_proj" else config.num_key_value_heads
    return converter_permute(array, heads)


def converter_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (the thing being undone)."""
    rows = weight.shape[0]
    split = weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def write_metadata(writer: gguf.GGUFWriter, arch: str, config: PreTrainedConfig, name: str) -> None:
    add_model_shape(writer, config, name)
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
    names = stored_names(model, arch)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the converter drops tied heads
        array = converter_rows(tensor.detach().numpy(), hf_name, arch, config)
        (gguf_name,) = names[hf_name]
        types[hf_name] = qtype_of(gguf_name) if array.ndim == 2 else Q.F32
        add_tensor(writer, gguf_name, array, types[hf_name])
    finish(writer)
    return types


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


def converted_tensors(model: torch.nn.Module, arch: str):
    """(GGUF name, array) of each tensor: a tied head dropped, llama files' q/k rows permuted,
    each layer's stacked gate_up experts split into the parts gguf-py names (gate, up)."""
    config = model.config
    names = stored_names(model, arch)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = converter_rows(tensor.detach().float().numpy(), hf_name, arch, config)
        parts = names[hf_name]
        split = np.split(array, len(parts), axis=1) if len(parts) > 1 else [array]
        yield from zip(parts, split, strict=True)


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
