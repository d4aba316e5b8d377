"""GGUF metadata -> the Hugging Face config of the model (`load_gguf_config`).

This module owns the architecture the file names (llama.cpp's ``llama`` is Llama, Mistral
by its name or Mixtral by its experts), the config fields every architecture has, RoPE
scaling (linear, YaRN, and llama3 recovered from llama.cpp's precomputed factors) and the
config cache; the fields only some architectures have are `family_config`'s. Other
architectures are refused, naming the supported ones (``SUPPORTED_GGUF_ARCHITECTURES``).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderTensor
from transformers import AutoConfig, PreTrainedConfig

from pagedllm.model.gguf.cache import cache_dir_for, save_atomically
from pagedllm.model.gguf.family_config import family_kwargs
from pagedllm.model.gguf.reader import (
    dequantize_tensor,
    get_value,
    hf_shape,
    open_gguf,
    require_int,
    require_value,
)

logger = logging.getLogger(__name__)

# 2: llama files with experts are Mixtral (version 1 cached them as Llama).
_CONFIG_CACHE_VERSION = "2"

# GGUF architecture -> (HF model_type, HF architecture class name).
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# The general.architecture values the loader reads.
GGUF_ARCHITECTURES = frozenset(_ARCHITECTURES)
# A llama file with experts (llama.cpp writes Mixtral so).
_MIXTRAL = ("mixtral", "MixtralForCausalLM")
SUPPORTED_GGUF_ARCHITECTURES = (
    "gemma3, llama (Llama, Mistral, Mixtral), phi3, qwen2, qwen3, qwen3moe"
)


# Where llama.cpp's converter assumes a llama3 model was pre-trained when the
# HF config does not say (convert_hf_to_gguf.py, LlamaModel).
_LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192


def _model_type(reader: GGUFReader, arch: str, path: str) -> tuple[str, str]:
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{SUPPORTED_GGUF_ARCHITECTURES}"
        )
    if arch == "llama" and int(get_value(reader, "llama.expert_count", 0) or 0) > 0:
        return _MIXTRAL
    if arch == "llama":
        # llama.cpp writes Mistral checkpoints with the llama architecture; only
        # the model's name tells them apart.
        names = (get_value(reader, "general.name", ""), get_value(reader, "general.basename", ""))
        if any("mistral" in str(name).lower() for name in names):
            return _ARCHITECTURES["mistral"]
    return _ARCHITECTURES[arch]


def _head_dim(
    reader: GGUFReader, prefix: str, tensors: dict[str, ReaderTensor], hidden: int, heads: int
) -> int:
    key_length = get_value(reader, f"{prefix}attention.key_length")
    if key_length is not None:
        return int(key_length)
    q_proj = tensors.get("blk.0.attn_q.weight")
    if q_proj is not None:
        return hf_shape(q_proj)[0] // heads
    return hidden // heads


def _vocab_size(
    reader: GGUFReader, prefix: str, tensors: dict[str, ReaderTensor], path: str
) -> int:
    vocab = get_value(reader, f"{prefix}vocab_size")
    if vocab is not None:
        return int(vocab)
    # Older converters omit <arch>.vocab_size; the embedding matrix is authoritative.
    if "token_embd.weight" in tensors:
        return hf_shape(tensors["token_embd.weight"])[0]
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    raise ValueError(f"{path}: cannot determine vocab_size (no metadata, no token_embd.weight)")


def _llama3_factors(theta: float, head_dim: int, params: dict[str, float]) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores in ``rope_freqs.weight``."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    old_ctx = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen > old_ctx / low, factor, smoothed)
    return np.where(wavelen < old_ctx / high, 1.0, out)


def _llama3_rope(
    factors: np.ndarray, theta: float, head_dim: int, old_ctx: int, path: str
) -> dict[str, Any] | None:
    """Recover HF's llama3 rope parameters from llama.cpp's precomputed factors."""
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    params: dict[str, Any] = {
        "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": old_ctx,
    }  # fmt: skip
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = old_ctx * freqs / (2 * math.pi)  # == old_ctx / wavelen
    ramp = (factors > 1.0 + 1e-4) & (factors < factor - 1e-4)
    if int(ramp.sum()) >= 2:
        # In the ramp, 1/f = (1 - s)/factor + s with s = (x - low) / (high - low),
        # i.e. s is linear in x; a line fit gives both ramp ends.
        s = (1.0 / factors[ramp] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(x[ramp], s, 1)
        params["low_freq_factor"] = round(float(-intercept / slope), 4)
        params["high_freq_factor"] = round(float((1.0 - intercept) / slope), 4)
    expected = _llama3_factors(theta, head_dim, params)
    if not np.allclose(expected, factors, rtol=1e-3, atol=1e-3):
        logger.warning(
            "%s: rope_freqs.weight is not reproduced by llama3 rope parameters %s", path, params
        )
    return {"rope_type": "llama3", **params}


def _rope_parameters(
    reader: GGUFReader, prefix: str, tensors: dict[str, ReaderTensor], head_dim: int, path: str
) -> dict[str, Any]:
    # transformers 5 keeps the rope base inside rope_parameters, not as rope_theta.
    theta = float(get_value(reader, f"{prefix}rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = get_value(reader, f"{prefix}rope.scaling.type")
    factor = get_value(reader, f"{prefix}rope.scaling.factor")
    legacy_linear = get_value(reader, f"{prefix}rope.scale_linear")  # key of older converters
    if scaling is None and legacy_linear is not None:
        scaling, factor = "linear", legacy_linear
    scaling = str(scaling or "none")
    orig_ctx = get_value(reader, f"{prefix}rope.scaling.original_context_length")
    if scaling == "linear" and factor is not None:
        rope.update(rope_type="linear", factor=float(factor))
    elif scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(factor or 1.0))
        if orig_ctx is not None:
            rope["original_max_position_embeddings"] = int(orig_ctx)
    elif scaling == "longrope":
        rope["rope_type"] = "longrope"  # Phi-3's; its factors are tensors (family_config)
    elif scaling != "none":
        raise ValueError(f"{path}: unsupported rope scaling type {scaling!r}")
    elif "rope_freqs.weight" in tensors:
        factors = dequantize_tensor(tensors["rope_freqs.weight"], path).double().numpy().reshape(-1)
        old_ctx = int(orig_ctx or _LLAMA3_DEFAULT_ORIGINAL_CONTEXT)
        llama3 = _llama3_rope(factors, theta, head_dim, old_ctx, path)
        if llama3 is not None:
            rope.update(llama3)
    return rope


def _special_token_ids(reader: GGUFReader) -> dict[str, int]:
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "padding": "pad_token_id"}
    ids = {}
    for gguf_name, hf_key in keys.items():
        value = get_value(reader, f"tokenizer.ggml.{gguf_name}_token_id")
        if value is not None:
            ids[hf_key] = int(value)
    return ids


def _config_from_reader(reader: GGUFReader, path: str) -> PreTrainedConfig:
    arch = str(require_value(reader, "general.architecture", path))
    model_type, hf_arch = _model_type(reader, arch, path)
    tensors = {t.name: t for t in reader.tensors}
    kwargs = _common_kwargs(reader, f"{arch}.", tensors, hf_arch, path)
    kwargs.update(family_kwargs(reader, arch, model_type, tensors, kwargs, path))
    return AutoConfig.for_model(model_type, **kwargs)


def _common_kwargs(
    reader: GGUFReader, prefix: str, tensors: dict[str, ReaderTensor], hf_arch: str, path: str
) -> dict[str, Any]:
    """The config fields every architecture has."""
    hidden = require_int(reader, f"{prefix}embedding_length", path)
    heads = require_int(reader, f"{prefix}attention.head_count", path)
    kv_field = f"{prefix}attention.head_count_kv"
    kv_heads = require_int(reader, kv_field, path) if reader.get_field(kv_field) else heads
    head_dim = _head_dim(reader, prefix, tensors, hidden, heads)
    kwargs: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": _vocab_size(reader, prefix, tensors, path),
        "hidden_size": hidden,
        "intermediate_size": require_int(reader, f"{prefix}feed_forward_length", path),
        "num_hidden_layers": require_int(reader, f"{prefix}block_count", path),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_parameters": _rope_parameters(reader, prefix, tensors, head_dim, path),
        # llama.cpp drops output.weight when the checkpoint ties it to the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        **_special_token_ids(reader),
    }
    eps = get_value(reader, f"{prefix}attention.layer_norm_rms_epsilon")
    if eps is not None:
        kwargs["rms_norm_eps"] = float(eps)
    context = get_value(reader, f"{prefix}context_length")
    if context is not None:
        kwargs["max_position_embeddings"] = int(context)
    return kwargs


def load_gguf_config(path: str) -> PreTrainedConfig:
    """Build the Hugging Face config described by the metadata of GGUF file ``path``.

    ``architectures`` is ``LlamaForCausalLM``, ``MistralForCausalLM``,
    ``MixtralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
    ``Qwen3MoeForCausalLM``, ``Phi3ForCausalLM`` or ``Gemma3ForCausalLM``; the rope base
    lives in ``config.rope_parameters["rope_theta"]`` (transformers 5 has no ``rope_theta``
    attribute), together with linear, YaRN, llama3 or (Phi-3) LongRoPE scaling when the file
    has it (Gemma 3: one such dict per layer kind, ``full_attention`` and
    ``sliding_attention``). ``tie_word_embeddings`` is true when the file has no
    ``output.weight``. Any other architecture raises ``ValueError`` naming the supported ones.
    """
    cache_dir = cache_dir_for(path, "gguf-configs", _CONFIG_CACHE_VERSION)
    if os.path.isfile(os.path.join(cache_dir, "config.json")):
        config = AutoConfig.from_pretrained(cache_dir, local_files_only=True)
        config._name_or_path = ""  # as built from the file, not a path into the cache
        return config
    config = _config_from_reader(open_gguf(path), path)
    # Parsing the file's metadata takes seconds; the next start reads a small JSON instead.
    save_atomically(cache_dir, config.save_pretrained)
    return config
