"""Writing tiny Hugging Face models as GPTQ checkpoints, for the GPTQ tests: GPTQModel and
AutoGPTQ do not install on this CPU, so the packing follows the format's documented layout
(pagedllm/model/quantization/gptq_format.py's docstring): round-to-nearest per group (not
GPTQ's error-compensating search: the layout is what is tested), act-order as a seeded
random permutation of the input rows, zero points stored minus 1 in the v1 "gptq" layout.

`reference_dequantize` is the format's own dequantization, scales[g_idx] * (q - zeros[g_idx])
as Transformers' and the format libraries' unpacking write it, computed element by element
from the bits in float64: the reader's exactness is checked against it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# Phi-3's checkpoints store q/k/v and gate/up fused, and the format tools quantize those
# modules as they are: `qkv_proj` and `gate_up_proj` are projections of their own.
QUANTIZED_LAYERS = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    *("qkv_proj", "gate_up_proj"),
)
# With a mixture's experts: Qwen3-MoE's experts.E.gate_proj etc. are named above, Mixtral's
# block_sparse_moe.experts.E.w1 / w3 / w2 (gate, up, down) here; the router ("gate") stays
# unquantized, as GPTQModel and llm-compressor leave it.
MOE_LAYERS = (*QUANTIZED_LAYERS, "w1", "w2", "w3")
MAX_Q = 15


@dataclass(frozen=True)
class Scheme:
    group_size: int
    desc_act: bool
    sym: bool
    checkpoint_format: str = "gptq"

    def quantization_config(self) -> dict:
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": self.group_size,
            "desc_act": self.desc_act,
            "sym": self.sym,
            "checkpoint_format": self.checkpoint_format,
        }

    @property
    def zero_offset(self) -> int:
        return 1 if self.checkpoint_format == "gptq" else 0


def pack_int32(values: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """uint `bits`-bit values -> int32, 32 / bits a word along `dim`, value j of a word in
    bits `bits * j` up."""
    per_word = 32 // bits
    moved = values.long().movedim(dim, -1)
    words = moved.reshape(*moved.shape[:-1], -1, per_word)
    packed = (words << (bits * torch.arange(per_word))).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def group_indices(in_features: int, scheme: Scheme, generator: torch.Generator) -> torch.Tensor:
    group_size = in_features if scheme.group_size == -1 else scheme.group_size
    groups = torch.arange(in_features) // group_size
    if not scheme.desc_act:
        return groups.to(torch.int32)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[torch.randperm(in_features, generator=generator)] = groups.to(torch.int32)
    return g_idx


def quantize_weight(
    weight: torch.Tensor, scheme: Scheme, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A Linear weight [N, K] as qweight, qzeros, scales, g_idx."""
    out_features, in_features = weight.shape
    g_idx = group_indices(in_features, scheme, generator)
    groups = int(g_idx.max()) + 1
    q = torch.empty(in_features, out_features, dtype=torch.long)
    scales = torch.empty(groups, out_features, dtype=torch.float16)
    zeros = torch.empty(groups, out_features, dtype=torch.long)
    for g in range(groups):
        rows = (g_idx == g).nonzero().squeeze(1)
        w = weight[:, rows].double()
        if scheme.sym:
            scale = (2 * w.abs().amax(1) / MAX_Q).clamp_min(1e-6)
            zero = torch.full((out_features,), (MAX_Q + 1) // 2, dtype=torch.long)
        else:
            low, high = w.amin(1).clamp_max(0), w.amax(1).clamp_min(0)
            scale = ((high - low) / MAX_Q).clamp_min(1e-6)
            zero = torch.round(-low / scale.half().double()).long().clamp(0, MAX_Q)
        scales[g] = scale.half()
        stored = scales[g].double()
        q[rows] = (torch.round(w / stored[:, None]).long() + zero[:, None]).clamp(0, MAX_Q).T
        zeros[g] = zero
    stored_zeros = (zeros - scheme.zero_offset) & 0xF  # v1: minus 1, wrapping as the format does
    return {
        "qweight": pack_int32(q, 0),
        "qzeros": pack_int32(stored_zeros, 1),
        "scales": scales,
        "g_idx": g_idx,
    }


def reference_dequantize(tensors: dict[str, torch.Tensor], scheme: Scheme) -> torch.Tensor:
    """float32 [N, K]: scales[g_idx[k], n] * (q[k, n] - zeros[g_idx[k], n]), bit by bit."""
    qweight = tensors["qweight"].numpy().view(np.uint32)
    qzeros = tensors["qzeros"].numpy().view(np.uint32)
    scales = tensors["scales"].numpy().astype(np.float64)
    g_idx = tensors["g_idx"].numpy()
    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    columns = np.arange(out_features)
    zero_words = qzeros[:, columns // 8]  # [G, N]
    zeros = ((zero_words >> (4 * (columns % 8)).astype(np.uint32)) & 0xF) + scheme.zero_offset
    weight = np.empty((out_features, in_features))
    for k in range(in_features):
        q = (qweight[k // 8] >> np.uint32(4 * (k % 8))) & 0xF
        g = g_idx[k]
        weight[:, k] = scales[g] * (q.astype(np.float64) - zeros[g])
    return torch.from_numpy(weight.astype(np.float32))


def write_gptq_checkpoint(
    source: Path,
    quantized: Path,
    dequantized: Path,
    scheme: Scheme,
    seed: int = 0,
    quantized_layers: tuple[str, ...] = QUANTIZED_LAYERS,
) -> int:
    """Quantize the decoder projections of the fp32 model in `source` (those named in
    `quantized_layers`): `quantized` gets the GPTQ checkpoint, `dequantized` the same model
    with `reference_dequantize`'s weights (unquantized, for Transformers and the fp32
    engine). Returns the GPTQ tensors' bytes."""
    return write_quantized_checkpoint(
        source,
        quantized,
        dequantized,
        lambda weight, generator: quantize_weight(weight, scheme, generator),
        lambda tensors: reference_dequantize(tensors, scheme),
        scheme.quantization_config(),
        seed,
        quantized_layers,
    )


def write_quantized_checkpoint(
    source: Path,
    quantized: Path,
    dequantized: Path,
    quantize: Callable[[torch.Tensor, torch.Generator], dict[str, torch.Tensor]],
    dequantize: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    quantization_config: dict,
    seed: int = 0,
    quantized_layers: tuple[str, ...] = QUANTIZED_LAYERS,
) -> int:
    """Any format's checkpoint of the fp32 model in `source` (see `write_gptq_checkpoint`):
    each decoder projection named in `quantized_layers` becomes `quantize`'s tensors, named
    after the layer (the others stay fp32); the dequantized model holds `dequantize`'s
    weights. Returns the quantized tensors' bytes."""
    generator = torch.Generator().manual_seed(seed)
    state = load_file(source / "model.safetensors")
    packed_state, plain_state, quantized_bytes = {}, {}, 0
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in quantized_layers:
            tensors = quantize(tensor, generator)
            packed_state.update({f"{prefix}.{n}": t for n, t in tensors.items()})
            plain_state[name] = dequantize(tensors)
            quantized_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        else:
            packed_state[name] = plain_state[name] = tensor
    for directory, weights in ((quantized, packed_state), (dequantized, plain_state)):
        shutil.copytree(source, directory, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(weights, directory / "model.safetensors")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized_bytes
