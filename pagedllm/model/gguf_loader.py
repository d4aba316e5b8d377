"""Reading llama.cpp GGUF checkpoints into the Hugging Face view of a model.

This module owns everything that is specific to the GGUF file format:

* ``load_gguf_config`` turns the GGUF metadata into a ``transformers`` config
  (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3 or Gemma 3 text) that the
  model code can build a network from;
* ``load_gguf_tokenizer`` builds the tokenizer stored in the file, chat template
  included;
* ``iter_gguf_weights`` streams every tensor, dequantized to float32 and renamed,
  reshaped, (for Llama-family files) un-permuted, (for Gemma 3) its norm weights
  shifted back by one and (for mixtures of experts) each layer's gate and up experts
  stacked in one tensor, so that it equals the tensor Transformers holds.

Architectures llama.cpp writes under names of its own: Mistral and Mixtral are ``llama``
files (Mixtral told apart by its experts, Mistral by its name); Phi-3 keeps its fused q/k/v
and gate/up tensors and its LongRoPE factors as tensors. Other architectures are refused,
naming the supported ones (``SUPPORTED_GGUF_ARCHITECTURES``).

It does not build models, place weights on devices or pick dtypes: callers own
that. Files that are not valid GGUF raise ``ValueError("<path>: not a valid GGUF
file: ...")``; tensors this module cannot map or decode raise ``ValueError``
naming the tensor.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerBase

from pagedllm.model.gguf_tensors import GGUFTensor, read_gguf_tensors
from pagedllm.utils import cache_root

__all__ = ["iter_gguf_weights", "load_gguf_config", "load_gguf_tokenizer"]

logger = logging.getLogger(__name__)

_T = GGMLQuantizationType
# Bump when the conversion changes, so cached tokenizers are rebuilt.
_TOKENIZER_CACHE_VERSION = "1"
# 2: llama files with experts are Mixtral (version 1 cached them as Llama).
_CONFIG_CACHE_VERSION = "2"
_WEIGHTS_CACHE_VERSION = "1"
# Small files load fast anyway; caching their weights would only fill the disk.
_MIN_WEIGHTS_CACHE_BYTES = 32 * 1024 * 1024
# An explicit list (rather than "whatever gguf-py can decode") so that an
# unsupported file is rejected before any tensor is dequantized.
SUPPORTED_TENSOR_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {
        _T.F32, _T.F16, _T.BF16,
        _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
        _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
    }
)  # fmt: skip

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
# A llama file with experts (llama.cpp writes Mixtral so).
_MIXTRAL = ("mixtral", "MixtralForCausalLM")
SUPPORTED_GGUF_ARCHITECTURES = (
    "gemma3, llama (Llama, Mistral, Mixtral), phi3, qwen2, qwen3, qwen3moe"
)

# llama.cpp's HF->GGUF converter interleaves the rotary halves of q/k rows for
# these architectures (to match its GPT-J style rope); Qwen2 is stored as is.
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})

_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its four norms after where they sit (llama.cpp's ffn_norm is its norm before
# the MLP, not Llama's post-attention norm) and normalizes the q/k heads.
_GEMMA3_BLOCK_TENSORS: dict[str, str] = {
    **_BLOCK_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# A mixture of experts (Mixtral, Qwen3-MoE): the router, and every expert's matrices stacked
# in 3-D tensors [experts, ...] named as Transformers holds them; llama.cpp's separate gate
# and up tensors become the two halves of one `gate_up_proj` (see _STACKED_PARTS).
_MOE_TENSORS: dict[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_up_proj",
    "ffn_up_exps": "mlp.experts.gate_up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Phi-3's checkpoint tensors as stored: q/k/v rows fused in attn_qkv, gate then up rows in
# ffn_up (llama.cpp splits the latter in half at run time); it has no ffn_gate.
_PHI3_BLOCK_TENSORS: dict[str, str] = {
    **{k: v for k, v in _BLOCK_TENSORS.items() if k not in ("ffn_gate", "ffn_up")},
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_ARCH_BLOCK_TENSORS: dict[str, dict[str, str]] = {
    "gemma3": _GEMMA3_BLOCK_TENSORS,
    "llama": {**_BLOCK_TENSORS, **_MOE_TENSORS},
    "qwen3": {**_BLOCK_TENSORS, **_QK_NORM_TENSORS},
    "qwen3moe": {**_BLOCK_TENSORS, **_QK_NORM_TENSORS, **_MOE_TENSORS},
    "phi3": _PHI3_BLOCK_TENSORS,
}
# Stacked expert parameters are named without a `.weight` suffix (Transformers' names).
_STACKED_EXPERT_TENSORS = frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})
# HF tensors several GGUF tensors fill, in the order their rows follow each other (dim 1).
_STACKED_PARTS: dict[str, tuple[str, ...]] = {
    "mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
}
# Architectures whose RMSNorm weight is an offset from one (`x * (1 + w)`): llama.cpp's
# converter stores w + 1, and the loader subtracts the one again in float32, as
# Transformers' GGUF loader does.
_NORM_OFFSET_ARCHITECTURES = frozenset({"gemma3"})
_BLOCK_TENSOR_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_GLOBAL_TENSOR_RE = re.compile(r"([a-z_]+)\.(weight|bias)")
# Not parameters of the HF model: their content is folded into the config.
_CONFIG_ONLY_TENSORS = frozenset(
    {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
)

# What llama.cpp assumes for a Gemma 3 file that does not say (llama-model.cpp, GEMMA3):
# every sixth layer global, the others local with a RoPE base of 10000.
_GEMMA3_DEFAULT_PATTERN = 6
_GEMMA3_DEFAULT_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62

# Where llama.cpp's converter assumes a llama3 model was pre-trained when the
# HF config does not say (convert_hf_to_gguf.py, LlamaModel).
_LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192

_READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError)


# --------------------------------------------------------------------------- reading


def _open_gguf(path: str) -> GGUFReader:
    """Parse the header, metadata and tensor table of ``path`` (once per file version)."""
    stat = os.stat(path)
    return _open_gguf_cached(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


def release_gguf_readers() -> None:
    """Forget the parsed files: once the weights are loaded, nothing should keep a file
    mapped (its touched pages would count in the process's resident size)."""
    _open_gguf_cached.cache_clear()


@functools.lru_cache(maxsize=2)
def _open_gguf_cached(path: str, mtime_ns: int, size: int) -> GGUFReader:
    # Parsing walks every tokenizer string (~3.5 s for a 49k vocabulary); config,
    # weights and tokenizer all need the same reader, so it is parsed once.
    try:
        # gguf-py reads eagerly and without bounds checks: bad magic, truncation
        # or garbage counts surface as one of these errors from inside the reader.
        return GGUFReader(path)
    except _READER_ERRORS as exc:
        raise ValueError(f"{path}: not a valid GGUF file: {exc}") from exc


def _field_value(field: ReaderField) -> Any:
    value = field.contents()
    # GGUF stores hyper-parameters such as 1e-5 as float32; going through the
    # float32's shortest repr gives back the decimal the HF config had.
    if field.types == [GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value


def _get(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else _field_value(field)


def _require(reader: GGUFReader, key: str, path: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise ValueError(f"{path}: missing GGUF metadata key {key!r}")
    return _field_value(field)


def _require_int(reader: GGUFReader, key: str, path: str) -> int:
    value = _require(reader, key, path)
    if isinstance(value, list):
        # Some converters write per-layer lists; this engine needs uniform layers.
        if not value or any(v != value[0] for v in value):
            raise ValueError(f"{path}: per-layer values for {key!r} are not supported: {value}")
        value = value[0]
    return int(value)


# --------------------------------------------------------------------------- config


def _model_type(reader: GGUFReader, arch: str, path: str) -> tuple[str, str]:
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{SUPPORTED_GGUF_ARCHITECTURES}"
        )
    if arch == "llama" and int(_get(reader, "llama.expert_count", 0) or 0) > 0:
        return _MIXTRAL
    if arch == "llama":
        # llama.cpp writes Mistral checkpoints with the llama architecture; only
        # the model's name tells them apart.
        names = (_get(reader, "general.name", ""), _get(reader, "general.basename", ""))
        if any("mistral" in str(name).lower() for name in names):
            return _ARCHITECTURES["mistral"]
    return _ARCHITECTURES[arch]


def _hf_shape(tensor: ReaderTensor | GGUFTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-varying first, i.e. reversed from torch.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _head_dim(
    reader: GGUFReader, prefix: str, tensors: dict[str, ReaderTensor], hidden: int, heads: int
) -> int:
    key_length = _get(reader, f"{prefix}attention.key_length")
    if key_length is not None:
        return int(key_length)
    q_proj = tensors.get("blk.0.attn_q.weight")
    if q_proj is not None:
        return _hf_shape(q_proj)[0] // heads
    return hidden // heads


def _vocab_size(
    reader: GGUFReader, prefix: str, tensors: dict[str, ReaderTensor], path: str
) -> int:
    vocab = _get(reader, f"{prefix}vocab_size")
    if vocab is not None:
        return int(vocab)
    # Older converters omit <arch>.vocab_size; the embedding matrix is authoritative.
    if "token_embd.weight" in tensors:
        return _hf_shape(tensors["token_embd.weight"])[0]
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
    theta = float(_get(reader, f"{prefix}rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = _get(reader, f"{prefix}rope.scaling.type")
    factor = _get(reader, f"{prefix}rope.scaling.factor")
    legacy_linear = _get(reader, f"{prefix}rope.scale_linear")  # key of older converters
    if scaling is None and legacy_linear is not None:
        scaling, factor = "linear", legacy_linear
    scaling = str(scaling or "none")
    orig_ctx = _get(reader, f"{prefix}rope.scaling.original_context_length")
    if scaling == "linear" and factor is not None:
        rope.update(rope_type="linear", factor=float(factor))
    elif scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(factor or 1.0))
        if orig_ctx is not None:
            rope["original_max_position_embeddings"] = int(orig_ctx)
    elif scaling == "longrope":
        rope["rope_type"] = "longrope"  # Phi-3's; its factors are tensors (_phi3_longrope)
    elif scaling != "none":
        raise ValueError(f"{path}: unsupported rope scaling type {scaling!r}")
    elif "rope_freqs.weight" in tensors:
        factors = _dequantize(tensors["rope_freqs.weight"], path).double().numpy().reshape(-1)
        old_ctx = int(orig_ctx or _LLAMA3_DEFAULT_ORIGINAL_CONTEXT)
        llama3 = _llama3_rope(factors, theta, head_dim, old_ctx, path)
        if llama3 is not None:
            rope.update(llama3)
    return rope


def _special_token_ids(reader: GGUFReader) -> dict[str, int]:
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "padding": "pad_token_id"}
    ids = {}
    for gguf_name, hf_key in keys.items():
        value = _get(reader, f"tokenizer.ggml.{gguf_name}_token_id")
        if value is not None:
            ids[hf_key] = int(value)
    return ids


def _config_from_reader(reader: GGUFReader, path: str) -> PreTrainedConfig:
    arch = str(_require(reader, "general.architecture", path))
    model_type, hf_arch = _model_type(reader, arch, path)
    tensors = {t.name: t for t in reader.tensors}
    kwargs = _common_kwargs(reader, f"{arch}.", tensors, hf_arch, path)
    kwargs.update(_family_kwargs(reader, arch, model_type, tensors, kwargs, path))
    return AutoConfig.for_model(model_type, **kwargs)


def _common_kwargs(
    reader: GGUFReader, prefix: str, tensors: dict[str, ReaderTensor], hf_arch: str, path: str
) -> dict[str, Any]:
    """The config fields every architecture has."""
    hidden = _require_int(reader, f"{prefix}embedding_length", path)
    heads = _require_int(reader, f"{prefix}attention.head_count", path)
    kv_field = f"{prefix}attention.head_count_kv"
    kv_heads = _require_int(reader, kv_field, path) if reader.get_field(kv_field) else heads
    head_dim = _head_dim(reader, prefix, tensors, hidden, heads)
    kwargs: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": _vocab_size(reader, prefix, tensors, path),
        "hidden_size": hidden,
        "intermediate_size": _require_int(reader, f"{prefix}feed_forward_length", path),
        "num_hidden_layers": _require_int(reader, f"{prefix}block_count", path),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_parameters": _rope_parameters(reader, prefix, tensors, head_dim, path),
        # llama.cpp drops output.weight when the checkpoint ties it to the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        **_special_token_ids(reader),
    }
    eps = _get(reader, f"{prefix}attention.layer_norm_rms_epsilon")
    if eps is not None:
        kwargs["rms_norm_eps"] = float(eps)
    context = _get(reader, f"{prefix}context_length")
    if context is not None:
        kwargs["max_position_embeddings"] = int(context)
    return kwargs


def _family_kwargs(
    reader: GGUFReader,
    arch: str,
    model_type: str,
    tensors: dict[str, ReaderTensor],
    kwargs: dict[str, Any],
    path: str,
) -> dict[str, Any]:
    """The config fields only some architectures have."""
    prefix = f"{arch}."
    extra: dict[str, Any] = {}
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        extra["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if model_type == "llama":
        extra["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if model_type in ("mistral", "mixtral"):
        # MistralConfig defaults to a 4096 window; llama.cpp's converter writes none for a
        # llama file, so a window is used only where the file records one.
        window = _get(reader, f"{prefix}attention.sliding_window")
        extra["sliding_window"] = int(window) if window else None
    if model_type in ("mixtral", "qwen3_moe"):
        extra.update(_moe_kwargs(reader, prefix, model_type, tensors, kwargs, path))
    if arch == "phi3":
        extra.update(_phi3_kwargs(reader, prefix, tensors, kwargs, path))
    elif kwargs["rope_parameters"]["rope_type"] == "longrope":
        raise ValueError(f"{path}: LongRoPE scaling is supported in phi3 files only")
    if arch == "gemma3":
        extra.update(_gemma3_kwargs(reader, prefix, kwargs, path))
    return extra


def _moe_kwargs(
    reader: GGUFReader,
    prefix: str,
    model_type: str,
    tensors: dict[str, ReaderTensor],
    kwargs: dict[str, Any],
    path: str,
) -> dict[str, Any]:
    """Experts per layer and per token, each expert's width (Mixtral's intermediate_size,
    Qwen3-MoE's moe_intermediate_size) and, for Qwen3-MoE, the routing's renormalization
    (llama.cpp always renormalizes unless the file says otherwise, and Transformers' GGUF
    loader assumes so too) and its dense layers: those without a router."""
    count = _require_int(reader, f"{prefix}expert_count", path)
    top_k = _require_int(reader, f"{prefix}expert_used_count", path)
    width = _expert_width(reader, prefix, tensors, kwargs["intermediate_size"])
    if model_type == "mixtral":
        return {
            "num_local_experts": count,
            "num_experts_per_tok": top_k,
            "intermediate_size": width,
        }
    num_layers = kwargs["num_hidden_layers"]
    return {
        "num_experts": count,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": width,
        "norm_topk_prob": bool(_get(reader, f"{prefix}expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [
            i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
        ],
    }


def _expert_width(
    reader: GGUFReader, prefix: str, tensors: dict[str, ReaderTensor], dense_width: int
) -> int:
    """Each expert's intermediate size: expert_feed_forward_length, else the rows of a stacked
    gate tensor, else feed_forward_length (what Mixtral's converter writes it as)."""
    width = _get(reader, f"{prefix}expert_feed_forward_length")
    if width is not None:
        return int(width)
    gate = next((t for n, t in tensors.items() if n.endswith(".ffn_gate_exps.weight")), None)
    return _hf_shape(gate)[1] if gate is not None else dense_width


def _phi3_kwargs(
    reader: GGUFReader,
    prefix: str,
    tensors: dict[str, ReaderTensor],
    kwargs: dict[str, Any],
    path: str,
) -> dict[str, Any]:
    """Phi-3's own fields, as llama.cpp's converter writes them: the share of each head that
    rotates (rope.dimension_count), the pre-training context, the window (0: none) and
    LongRoPE's factor sets and cos/sin scale."""
    head_dim = kwargs["head_dim"]
    rotated = int(_get(reader, f"{prefix}rope.dimension_count", head_dim))
    window = _get(reader, f"{prefix}attention.sliding_window")
    original = _get(reader, f"{prefix}rope.scaling.original_context_length")
    extra: dict[str, Any] = {"sliding_window": int(window) if window else None}
    if rotated != head_dim:  # else Transformers' default (1.0), as a Phi-3 config leaves it
        extra["partial_rotary_factor"] = rotated / head_dim
    if original is not None:
        extra["original_max_position_embeddings"] = int(original)
    longrope = _phi3_longrope(reader, prefix, tensors, kwargs, (original, rotated), path)
    if longrope is not None:
        extra["rope_parameters"] = longrope
    return extra


def _phi3_longrope(
    reader: GGUFReader,
    prefix: str,
    tensors: dict[str, ReaderTensor],
    kwargs: dict[str, Any],
    dims: tuple[int | None, int],
    path: str,
) -> dict[str, Any] | None:
    """LongRoPE's rope_parameters from the rope_factors_short/long tensors (None: no
    LongRoPE), given `dims`: (the original context, the rotated dimensions per head). The
    cos/sin scale is left to Transformers' default unless the file's differs from it; a file
    that does not say which context the short factors serve is refused."""
    original, rotated = dims
    context = kwargs.get("max_position_embeddings", original)
    names = ("rope_factors_short.weight", "rope_factors_long.weight")
    present = [name for name in names if name in tensors]
    if not present:
        if kwargs["rope_parameters"]["rope_type"] == "longrope":
            raise ValueError(f"{path}: longrope scaling without rope_factors_long/short tensors")
        if original is not None and context > original:
            # A Phi-3 checkpoint grows its context only by LongRoPE (128k models): a file from
            # before llama.cpp stored the factors lost them.
            raise ValueError(
                f"{path}: a {context}-token context grown from {original} tokens, but no "
                "LongRoPE factors (rope_factors_long/short tensors): the conversion lost them"
            )
        return None
    if len(present) < len(names):
        raise ValueError(f"{path}: LongRoPE needs both {names}; the file has only {present}")
    if original is None:
        raise ValueError(
            f"{path}: LongRoPE factors without {prefix}rope.scaling.original_context_length; "
            "which context the short factors serve is unknown"
        )
    short, long = (_dequantize(tensors[name], path).reshape(-1).tolist() for name in names)
    if len(short) != rotated // 2 or len(long) != rotated // 2:
        raise ValueError(
            f"{path}: LongRoPE has {len(short)} short and {len(long)} long factors; "
            f"{rotated} rotated dimensions per head need {rotated // 2} of each"
        )
    rope: dict[str, Any] = {
        "rope_type": "longrope",
        "rope_theta": kwargs["rope_parameters"]["rope_theta"],
        "short_factor": short,
        "long_factor": long,
    }
    scale = _get(reader, f"{prefix}rope.scaling.attn_factor")
    if scale is not None and not math.isclose(
        scale, _longrope_default_scale(context, int(original)), rel_tol=1e-6
    ):
        rope["attention_factor"] = float(scale)
    return rope


def _longrope_default_scale(context: int, original: int) -> float:
    """LongRoPE's cos/sin scale for a context grown from `original` to `context` tokens (what
    llama.cpp's converter writes and Transformers computes when the config gives none)."""
    growth = context / original
    return math.sqrt(1 + math.log(growth) / math.log(original)) if growth > 1 else 1.0


def _gemma3_kwargs(
    reader: GGUFReader, prefix: str, kwargs: dict[str, Any], path: str
) -> dict[str, Any]:
    """Gemma 3's own config fields, as llama.cpp reads the file: the kind of each layer, a
    RoPE per kind (the global one with the file's scaling), the score scale, soft-caps."""
    num_layers = kwargs["num_hidden_layers"]
    pattern = _get(reader, f"{prefix}attention.sliding_window_pattern", _GEMMA3_DEFAULT_PATTERN)
    local_base = _get(reader, f"{prefix}rope.freq_base_swa", _GEMMA3_DEFAULT_LOCAL_ROPE_BASE)
    return {
        "sliding_window": _require_int(reader, f"{prefix}attention.sliding_window", path),
        "layer_types": _gemma3_layer_types(pattern, num_layers, path),
        "rope_parameters": {
            "full_attention": kwargs["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": float(local_base)},
        },
        "query_pre_attn_scalar": _gemma3_query_pre_attn_scalar(kwargs),
        "attn_logit_softcapping": _get(reader, f"{prefix}attn_logit_softcapping"),
        "final_logit_softcapping": _get(reader, f"{prefix}final_logit_softcapping"),
    }


def _gemma3_layer_types(pattern: Any, num_layers: int, path: str) -> list[str]:
    """`sliding_window_pattern` is N (every Nth layer global; 0: all local) or one flag per
    layer (true: local)."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(
                f"{path}: sliding_window_pattern has {len(pattern)} flags for {num_layers} layers"
            )
        local = [bool(flag) for flag in pattern]
    else:
        every = int(pattern)
        local = [every == 0 or i % every < every - 1 for i in range(num_layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in local]


def _gemma3_query_pre_attn_scalar(kwargs: dict[str, Any]) -> int:
    """The file has no field for it: llama.cpp scales scores by head_dim ** -0.5, except
    for the 27B model (62 layers), whose checkpoint uses hidden_size / heads (168)."""
    if kwargs["num_hidden_layers"] == _GEMMA3_27B_LAYERS:
        return kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return kwargs["head_dim"]


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
    cache_dir = _cache_dir(path, "gguf-configs", _CONFIG_CACHE_VERSION)
    if os.path.isfile(os.path.join(cache_dir, "config.json")):
        config = AutoConfig.from_pretrained(cache_dir, local_files_only=True)
        config._name_or_path = ""  # as built from the file, not a path into the cache
        return config
    config = _config_from_reader(_open_gguf(path), path)
    # Parsing the file's metadata takes seconds; the next start reads a small JSON instead.
    _save_atomically(cache_dir, config.save_pretrained)
    return config


def _cache_dir(path: str, kind: str, version: str) -> str:
    """A cache directory for something derived from GGUF file `path` (by path, size, mtime)."""
    stat = os.stat(path)
    key = f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}:{version}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return str(cache_root() / kind / digest)


def _save_atomically(cache_dir: str, save: Callable[[str], Any]) -> None:
    """Write into a staging directory and rename it, so a concurrent reader never sees half."""
    staging = f"{cache_dir}.tmp-{os.getpid()}"
    try:
        save(staging)
        os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
        os.replace(staging, cache_dir)
    except OSError as error:  # a read-only home only costs the next start some seconds
        logger.warning("could not write the cache %s: %s", cache_dir, error)
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------- tokenizer


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Build the tokenizer stored in GGUF file ``path``, with its chat template.

    Converting the GGUF vocabulary takes seconds, so the converted tokenizer is saved
    under the cache directory, keyed by the file's path, size and mtime.
    """
    _check_magic(path)
    cache_dir = _cache_dir(path, "gguf-tokenizers", _TOKENIZER_CACHE_VERSION)
    if os.path.isfile(os.path.join(cache_dir, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)
    tokenizer = _convert_gguf_tokenizer(path)
    _save_atomically(cache_dir, tokenizer.save_pretrained)
    return tokenizer


def _convert_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    directory, filename = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        # transformers maps tokenizer.chat_template today; keep the guarantee
        # even if a release stops doing so.
        template = _get(_open_gguf(path), "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = str(template)
    return tokenizer


def _check_magic(path: str) -> None:
    # Cheap early check: without it transformers fails deep inside with an
    # error that does not say the file is the problem.
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a valid GGUF file: bad magic {magic!r}")


# --------------------------------------------------------------------------- weights


def _hf_name(gguf_name: str, path: str, arch: str | None = None) -> str | None:
    """HF parameter name for a GGUF tensor name of architecture `arch`; None for
    config-only tensors."""
    if gguf_name in _CONFIG_ONLY_TENSORS:
        return None
    block_tensors = _ARCH_BLOCK_TENSORS.get(arch or "", _BLOCK_TENSORS)
    match = _BLOCK_TENSOR_RE.fullmatch(gguf_name)
    if match and match[2] in block_tensors:
        module = f"model.layers.{match[1]}.{block_tensors[match[2]]}"
        if match[2] in _STACKED_EXPERT_TENSORS and match[3] == "weight":
            return module  # a stacked parameter, named without a suffix
        return f"{module}.{match[3]}"
    match = _GLOBAL_TENSOR_RE.fullmatch(gguf_name)
    if match and match[1] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[match[1]]}.{match[2]}"
    raise ValueError(f"{path}: unknown GGUF tensor name {gguf_name!r}")


def _dequantize(tensor: ReaderTensor | GGUFTensor, path: str) -> torch.Tensor:
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}"
        )
    array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    array = array.reshape(_hf_shape(tensor))
    if not array.flags.writeable:
        # F32 tensors come back as views of the read-only memmap; torch needs
        # memory it may write, and the mapping must not outlive the reader.
        array = array.copy()
    return torch.from_numpy(array)


def _unpermute(weight: torch.Tensor, n_head: int, name: str) -> torch.Tensor:
    """Invert llama.cpp's ``LlamaModel.permute`` on the rows of a q/k weight or bias."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{name}: {rows} rows do not split into {n_head} rotary heads")
    # The converter reshaped rows to (head, 2, half) and swapped the last two
    # axes; stored rows are therefore (head, half, 2).
    split = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape).contiguous()


# The GGUF tensors one HF tensor is made of (one, or the parts _STACKED_PARTS names, in
# their order), and that HF tensor's name.
PlanEntry = tuple[tuple[GGUFTensor, ...], str]
# Fused projection -> (projection, rows) in row order (Phi-3's q/k/v and gate/up).
FusedRows = dict[str, list[tuple[str, int]]]


def _plan(tensors: list[GGUFTensor], path: str, arch: str | None = None) -> list[PlanEntry]:
    """Map and type-check every tensor before any is dequantized."""
    parts: dict[str, list[GGUFTensor]] = {}
    for tensor in tensors:
        hf_name = _hf_name(tensor.name, path, arch)
        if hf_name is None:
            continue
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"{path}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}"
            )
        parts.setdefault(hf_name, []).append(tensor)
    return [(_ordered_parts(name, found, path), name) for name, found in parts.items()]


def _ordered_parts(hf_name: str, found: list[GGUFTensor], path: str) -> tuple[GGUFTensor, ...]:
    """`found` in the order their rows are stacked; every part must be there."""
    order = _STACKED_PARTS.get(hf_name.split(".", 3)[-1])
    if order is None:
        return tuple(found)
    by_kind = {tensor.name.split(".")[2]: tensor for tensor in found}
    missing = [kind for kind in order if kind not in by_kind]
    if missing:
        have = ", ".join(tensor.name for tensor in found)
        raise ValueError(f"{path}: {hf_name} needs {order}; the file has only {have}")
    return tuple(by_kind[kind] for kind in order)


def _dequantize_parts(parts: tuple[GGUFTensor, ...], path: str) -> torch.Tensor:
    """One tensor, or its parts stacked along dim 1 (each expert's gate rows, then its up
    rows), filled one part at a time so that only one part is ever held twice."""
    if len(parts) == 1:
        return _dequantize(parts[0], path)
    shapes = [_hf_shape(part) for part in parts]
    out = torch.empty(shapes[0][0], sum(shape[1] for shape in shapes), *shapes[0][2:])
    start = 0
    for part, shape in zip(parts, shapes, strict=True):
        out[:, start : start + shape[1]] = _dequantize(part, path)
        start += shape[1]
    return out


def iter_gguf_weights(
    path: str, config: PreTrainedConfig | None = None, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every parameter stored in GGUF file ``path``.

    Tensors are dequantized one at a time (nothing is retained between yields),
    shaped and named as in the Hugging Face checkpoint, and for Llama/Mistral
    files q_proj/k_proj rows are un-permuted with ``config.num_attention_heads`` /
    ``config.num_key_value_heads``. ``config`` defaults to ``load_gguf_config(path)``.
    ``lm_head.weight`` is only yielded when the file stores it (untied models).
    The file is validated (format, tensor names, tensor types) before this returns.
    Tensors named in ``skip`` (layers that keep the file's blocks) are neither dequantized
    nor yielded; so are Phi-3's fused tensors all of whose projections ``skip`` names (see
    `iter_gguf_raw_weights`).
    """
    config = config or load_gguf_config(path)
    skipped = functools.partial(_is_skipped, skip=skip, fused=_fused_rows(config))
    cache_dir = _cache_dir(path, "gguf-weights", _WEIGHTS_CACHE_VERSION)
    cached = os.path.join(cache_dir, "model.safetensors")
    if os.path.isfile(cached):
        return _stream_cached(cached, skipped)
    tensors, metadata = read_gguf_tensors(path)
    arch = metadata.get("general.architecture")
    plan = [(parts, name) for parts, name in _plan(tensors, path, arch) if not skipped(name)]
    heads = _permuted_heads(metadata, config)
    weights = _stream(plan, heads, path, arch in _NORM_OFFSET_ARCHITECTURES)
    if skip or os.path.getsize(path) < _MIN_WEIGHTS_CACHE_BYTES:  # the cache holds all
        return weights
    return _stream_and_cache(weights, cache_dir)


def _stream_cached(
    cached: str, skipped: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(cached, framework="pt") as checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
            if not skipped(name):
                yield name, checkpoint.get_tensor(name)


def _stream_and_cache(
    weights: Iterator[tuple[str, torch.Tensor]], cache_dir: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the dequantized weights, then save them all for the next start: reading the
    GGUF tensor table and dequantizing costs seconds, a safetensors file is mapped at once."""
    kept: dict[str, torch.Tensor] = {}
    for name, weight in weights:
        kept[name] = weight
        yield name, weight

    def save(directory: str) -> None:
        os.makedirs(directory)
        save_file(kept, os.path.join(directory, "model.safetensors"))

    _save_atomically(cache_dir, save)


def _stream(
    plan: list[PlanEntry], heads: dict[str, int], path: str, offset_norms: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    for parts, hf_name in plan:
        weight = _dequantize_parts(parts, path)
        projection = hf_name.split(".")[-2]
        if projection in heads:
            weight = _unpermute(weight, heads[projection], f"{path}: {parts[0].name}")
        if offset_norms and hf_name.endswith("norm.weight"):
            weight = weight - 1.0  # float32, as Transformers (see _NORM_OFFSET_ARCHITECTURES)
        yield hf_name, weight


def _permuted_heads(metadata: dict[str, Any], config: PreTrainedConfig) -> dict[str, int]:
    """Projection -> heads whose rows llama.cpp's converter permuted (Llama and Mistral)."""
    if metadata.get("general.architecture") not in _PERMUTED_ARCHITECTURES:
        return {}
    return {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}


def iter_gguf_raw_weights(
    path: str, config: PreTrainedConfig, types: frozenset[GGMLQuantizationType] | None = None
) -> Iterator[tuple[str, GGMLQuantizationType, np.ndarray]]:
    """Yield ``(hf_name, type, raw rows)`` for every 2-D weight of GGUF file ``path`` (of
    one of `types`, if given), its blocks left as stored: a uint8 array [rows, bytes per
    row] (q/k rows un-permuted like `iter_gguf_weights`: a copy), for layers that compute
    on the blocks themselves. Phi-3's fused tensors come as the projections they hold
    (q_proj, k_proj, v_proj; gate_proj, up_proj: row ranges of the file's blocks), as the
    other architectures' files store them."""
    tensors, metadata = read_gguf_tensors(path)
    heads = _permuted_heads(metadata, config)
    fused = _fused_rows(config)
    for parts, hf_name in _plan(tensors, path, metadata.get("general.architecture")):
        tensor = parts[0]
        if len(parts) > 1 or not hf_name.endswith(".weight") or len(tensor.shape) != 2:
            continue  # stacked experts and 1-D tensors are dequantized
        if types is not None and tensor.tensor_type not in types:
            continue
        rows = _raw_rows(tensor, hf_name, heads, path)
        for name, start, count in _row_ranges(hf_name, rows.shape[0], fused, path):
            yield name, tensor.tensor_type, rows[start : start + count]


def _raw_rows(tensor: GGUFTensor, hf_name: str, heads: dict[str, int], path: str) -> np.ndarray:
    """The tensor's blocks as [rows, bytes per row], q/k rows un-permuted."""
    raw = np.asarray(tensor.data)
    projection = hf_name.split(".")[-2]
    if projection in heads:
        rows = torch.from_numpy(raw.reshape(raw.shape[0], -1).copy())
        raw = _unpermute(rows, heads[projection], f"{path}: {tensor.name}").numpy()
    return raw.reshape(raw.shape[0], -1)


def _fused_rows(config: PreTrainedConfig) -> FusedRows:
    """The fused projections of checkpoints that store q/k/v and gate/up fused (Phi-3);
    empty for the others."""
    if (getattr(config, "architectures", None) or [""])[0] != "Phi3ForCausalLM":
        return {}
    from pagedllm.model.models.phi3 import fused_projection_rows

    return fused_projection_rows(config)


def _split_names(hf_name: str, fused: FusedRows) -> list[tuple[str, int]]:
    """(name, rows) of each projection fused tensor `hf_name` holds; empty if not fused."""
    parts = hf_name.split(".")
    if len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in fused:
        return []
    return [(".".join([*parts[:-2], name, "weight"]), rows) for name, rows in fused[parts[-2]]]


def _row_ranges(
    hf_name: str, num_rows: int, fused: FusedRows, path: str
) -> list[tuple[str, int, int]]:
    """(name, first row, rows) of each projection in tensor `hf_name` (itself if not fused)."""
    split = _split_names(hf_name, fused)
    if not split:
        return [(hf_name, 0, num_rows)]
    if sum(rows for _, rows in split) != num_rows:
        raise ValueError(f"{path}: {hf_name} has {num_rows} rows; the config gives {split}")
    starts = np.cumsum([0] + [rows for _, rows in split]).tolist()
    return [(name, start, rows) for (name, rows), start in zip(split, starts, strict=False)]


def _is_skipped(hf_name: str, skip: frozenset[str], fused: FusedRows) -> bool:
    """In `skip`, or a fused tensor every projection of which is (its layer holds them all)."""
    split = _split_names(hf_name, fused)
    return hf_name in skip or (bool(split) and all(name in skip for name, _ in split))
