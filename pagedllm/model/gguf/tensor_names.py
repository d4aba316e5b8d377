"""GGUF tensor names -> the Hugging Face parameter names, per architecture.

This module owns llama.cpp's tensor-name tables (the global tensors; each block's, for
llama incl. Mistral and Mixtral, qwen2, qwen3, qwen3moe, phi3 and gemma3), the tensors
that only feed the config, and the plan of a file: every tensor mapped and type-checked
before any is dequantized, the parts of a stacked HF tensor (a mixture's gate and up
experts) gathered in the order their rows follow each other. Names it cannot map raise
``ValueError`` naming the tensor.
"""

from __future__ import annotations

import re

from pagedllm.model.gguf.reader import check_tensor_type
from pagedllm.model.gguf.tensor_table import GGUFTensor

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
_BLOCK_TENSOR_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_GLOBAL_TENSOR_RE = re.compile(r"([a-z_]+)\.(weight|bias)")
# Not parameters of the HF model: their content is folded into the config.
_CONFIG_ONLY_TENSORS = frozenset(
    {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
)

# The GGUF tensors one HF tensor is made of (one, or the parts _STACKED_PARTS names, in
# their order), and that HF tensor's name.
PlanEntry = tuple[tuple[GGUFTensor, ...], str]


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


def plan_tensors(tensors: list[GGUFTensor], path: str, arch: str | None = None) -> list[PlanEntry]:
    """Map and type-check every tensor before any is dequantized."""
    parts: dict[str, list[GGUFTensor]] = {}
    for tensor in tensors:
        hf_name = _hf_name(tensor.name, path, arch)
        if hf_name is None:
            continue
        check_tensor_type(tensor, path)
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
