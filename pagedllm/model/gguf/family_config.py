"""The config fields only some architectures have, read from GGUF metadata (and tensors).

This module owns, per family: Llama's and Qwen3's biases, Mistral's and Mixtral's window,
the experts of a mixture (Mixtral, Qwen3-MoE), Phi-3's partial rotation, window and
LongRoPE factor sets, and Gemma 3's layer kinds, RoPE per kind, score scale and soft-caps.
`config` builds the fields every architecture has and merges `family_kwargs` over them.
"""

from __future__ import annotations

import math
from typing import Any

from gguf import GGUFReader, ReaderTensor

from pagedllm.model.gguf.reader import dequantize_tensor, get_value, hf_shape, require_int

# What llama.cpp assumes for a Gemma 3 file that does not say (llama-model.cpp, GEMMA3):
# every sixth layer global, the others local with a RoPE base of 10000.
_GEMMA3_DEFAULT_PATTERN = 6
_GEMMA3_DEFAULT_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62


def family_kwargs(
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
        window = get_value(reader, f"{prefix}attention.sliding_window")
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
    count = require_int(reader, f"{prefix}expert_count", path)
    top_k = require_int(reader, f"{prefix}expert_used_count", path)
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
        "norm_topk_prob": bool(get_value(reader, f"{prefix}expert_weights_norm", True)),
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
    width = get_value(reader, f"{prefix}expert_feed_forward_length")
    if width is not None:
        return int(width)
    gate = next((t for n, t in tensors.items() if n.endswith(".ffn_gate_exps.weight")), None)
    return hf_shape(gate)[1] if gate is not None else dense_width


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
    rotated = int(get_value(reader, f"{prefix}rope.dimension_count", head_dim))
    window = get_value(reader, f"{prefix}attention.sliding_window")
    original = get_value(reader, f"{prefix}rope.scaling.original_context_length")
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
    short, long = (dequantize_tensor(tensors[name], path).reshape(-1).tolist() for name in names)
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
    scale = get_value(reader, f"{prefix}rope.scaling.attn_factor")
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
    pattern = get_value(
        reader, f"{prefix}attention.sliding_window_pattern", _GEMMA3_DEFAULT_PATTERN
    )
    local_base = get_value(reader, f"{prefix}rope.freq_base_swa", _GEMMA3_DEFAULT_LOCAL_ROPE_BASE)
    return {
        "sliding_window": require_int(reader, f"{prefix}attention.sliding_window", path),
        "layer_types": _gemma3_layer_types(pattern, num_layers, path),
        "rope_parameters": {
            "full_attention": kwargs["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": float(local_base)},
        },
        "query_pre_attn_scalar": _gemma3_query_pre_attn_scalar(kwargs),
        "attn_logit_softcapping": get_value(reader, f"{prefix}attn_logit_softcapping"),
        "final_logit_softcapping": get_value(reader, f"{prefix}final_logit_softcapping"),
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
