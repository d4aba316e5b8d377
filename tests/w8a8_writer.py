"""Writing tiny Hugging Face models as 8-bit checkpoints (compressed-tensors int8 W8A8 and
FP8, and `quant_method` "fp8"), for the W8A8 / FP8 tests. llm-compressor does not run here,
so the tensors follow the formats as their writers lay them out:
- compressed-tensors: `weight` int8 or float8_e4m3fn [N, K], `weight_scale` [N, 1] per
  channel, [1] per tensor, [ceil(N/bn), ceil(K/bk)] per block; symmetric (no zero point);
  `input_scale` [1] for static activations; scale = max |w| / 127.5 for int8 (half the
  range [-128, 127]), / 448 for fp8; the head left out (`ignore`).
- fp8: `weight` float8_e4m3fn, `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)] for
  blocks (the multiplier), or a 0-d `weight_scale` per tensor; `input_scale` 0-d if static.

`reference_dequantize` is the formats' dequantization, q * scale, element by element in
float64; `fake_quantize_activation` the serving math's activation quantization, written
apart from the engine's, and `add_activation_quantization` hooks it into a Transformers
model so it computes what the 8-bit engine should (`add_expert_activation_quantization`
into a mixture's experts, which Transformers holds stacked, not as Linear layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.gptq_writer import QUANTIZED_LAYERS, write_quantized_checkpoint

FP8_MAX = 448.0
STATIC_INPUT_SCALE = 0.01  # fp8 activations up to 4.48; int8 up to 1.27, then clamped


@dataclass(frozen=True)
class Format:
    """One checkpoint scheme: weights, activations and the quantization_config naming it."""

    name: str
    method: str  # "compressed-tensors" or "fp8"
    weight_type: str  # "int" or "float"
    weight_strategy: str  # "channel", "tensor" or "block"
    activations: str | None  # "token", "tensor", "group", "static" or None
    block: tuple[int, int] = (128, 128)

    def __str__(self) -> str:
        return self.name

    def quantization_config(self) -> dict:
        if self.method == "fp8":
            config = {"quant_method": "fp8", "fmt": "e4m3"}
            config["activation_scheme"] = "static" if self.activations == "static" else "dynamic"
            if self.weight_strategy == "block":
                config["weight_block_size"] = list(self.block)
            return config
        return {
            "quant_method": "compressed-tensors",
            "format": "int-quantized" if self.weight_type == "int" else "float-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
            "config_groups": {"group_0": self._group()},
        }

    def _group(self) -> dict:
        weights = {
            "num_bits": 8, "type": self.weight_type, "symmetric": True, "dynamic": False,
            "strategy": self.weight_strategy, "group_size": None,
            "block_structure": list(self.block) if self.weight_strategy == "block" else None,
        }  # fmt: skip
        activations = None
        if self.activations is not None:
            static = self.activations == "static"
            activations = {
                "num_bits": 8, "type": self.weight_type, "symmetric": True,
                "dynamic": not static, "strategy": "tensor" if static else self.activations,
                "group_size": self.block[1] if self.activations == "group" else None,
            }  # fmt: skip
        return {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": activations,
            "output_activations": None,
        }


# The nine schemes the tests serve, by name (`format_named`).
FORMATS = (
    Format("ct-int8-token", "compressed-tensors", "int", "channel", "token"),
    Format("ct-int8-static", "compressed-tensors", "int", "tensor", "static"),
    Format("ct-int8-weight-only", "compressed-tensors", "int", "channel", None),
    Format("ct-fp8-dynamic", "compressed-tensors", "float", "channel", "token"),
    Format("ct-fp8-static", "compressed-tensors", "float", "tensor", "static"),
    Format("ct-fp8-block", "compressed-tensors", "float", "block", "group"),
    Format("fp8-block", "fp8", "float", "block", "group"),
    Format("fp8-tensor", "fp8", "float", "tensor", "tensor"),
    Format("fp8-static", "fp8", "float", "tensor", "static"),
)


def format_named(name: str) -> Format:
    (fmt,) = [f for f in FORMATS if f.name == name]
    return fmt


def _max(weight_type: str) -> float:
    return 127.5 if weight_type == "int" else FP8_MAX


def _to_grid(scaled: torch.Tensor, weight_type: str) -> torch.Tensor:
    if weight_type == "int":
        return torch.round(scaled).clamp(-128, 127).to(torch.int8)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _expand_blocks(scales: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    rows = scales.repeat_interleave(block[0], 0)[: shape[0]]
    return rows.repeat_interleave(block[1], 1)[:, : shape[1]]


def weight_scales(weight: torch.Tensor, fmt: Format) -> torch.Tensor:
    """fp32 scales in the format's stored shape."""
    amax_of = lambda w: w.abs().amax().clamp_min(1e-8)  # noqa: E731
    if fmt.weight_strategy == "channel":
        return (weight.abs().amax(1, keepdim=True).clamp_min(1e-8) / _max(fmt.weight_type)).float()
    if fmt.weight_strategy == "tensor":
        scale = amax_of(weight) / _max(fmt.weight_type)
        return scale.reshape(() if fmt.method == "fp8" else (1,)).float()
    rows, cols = fmt.block
    blocks = torch.empty(-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
    for i in range(blocks.shape[0]):
        for j in range(blocks.shape[1]):
            tile = weight[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            blocks[i, j] = amax_of(tile) / FP8_MAX
    return blocks


def quantize_weight(weight: torch.Tensor, fmt: Format) -> dict[str, torch.Tensor]:
    """A Linear weight [N, K] as the format's tensors."""
    scales = weight_scales(weight, fmt)
    full = _full_scales(scales, weight.shape, fmt)
    tensors = {"weight": _to_grid(weight / full, fmt.weight_type)}
    scale_name = (
        "weight_scale_inv"
        if fmt.method == "fp8" and fmt.weight_strategy == "block"
        else "weight_scale"
    )
    tensors[scale_name] = scales
    if fmt.activations == "static":
        scale = torch.tensor(STATIC_INPUT_SCALE)
        tensors["input_scale"] = scale if fmt.method == "fp8" else scale.reshape(1)
    return tensors


def _full_scales(scales: torch.Tensor, shape: torch.Size, fmt: Format) -> torch.Tensor:
    if fmt.weight_strategy == "block":
        return _expand_blocks(scales, shape, fmt.block)
    return scales.reshape(-1, 1) if scales.numel() > 1 else scales.reshape(1, 1)


def reference_dequantize(tensors: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """float32 [N, K]: q[n, k] * scale(n, k), each product in float64, then rounded."""
    q = tensors["weight"].to(torch.float64)
    scales = tensors.get("weight_scale_inv", tensors.get("weight_scale")).to(torch.float64)
    return (q * _full_scales(scales, q.shape, fmt)).to(torch.float32)


def fake_quantize_activation(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """x [..., K] as the 8-bit matmul sees it: int8 scale max|x| / 127 (round half to even,
    clamp [-128, 127]), fp8 scale max|x| / 448 (at least 1 / (448 * 512)), per token, per
    token and group, per tensor, or the static input scale."""
    top = 127.0 if fmt.weight_type == "int" else FP8_MAX
    rows = x.reshape(-1, x.shape[-1]).float()
    if fmt.activations == "static":
        scale = torch.tensor(STATIC_INPUT_SCALE, dtype=torch.float32)
    elif fmt.activations == "tensor":
        scale = rows.abs().max() / top
    else:
        size = fmt.block[1] if fmt.activations == "group" else rows.shape[1]
        rows = rows.reshape(rows.shape[0], -1, size)
        scale = rows.abs().amax(-1, keepdim=True) / top
    if fmt.weight_type == "float":
        scale = scale.clamp_min(1 / (FP8_MAX * 512))
    else:
        scale = scale.clamp_min(torch.finfo(torch.float32).tiny)
    grid = rows / scale
    if fmt.weight_type == "int":
        values = torch.round(grid).clamp(-128, 127)
    else:
        values = grid.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (values * scale).reshape(x.shape)


def add_activation_quantization(model: torch.nn.Module, fmt: Format) -> None:
    """Fake-quantize the input of every quantized projection of a Transformers model; under
    a PEFT adapter (not merged), the input of its base layer only, as the 8-bit layer sees
    it (the adapter's delta takes the unquantized input)."""
    if fmt.activations is None:
        return
    for name, module in model.named_modules():
        projection = name.removesuffix(".base_layer").rpartition(".")[2]
        if isinstance(module, torch.nn.Linear) and projection in QUANTIZED_LAYERS:
            module.register_forward_pre_hook(
                lambda _, args: (fake_quantize_activation(args[0], fmt),)
            )


def add_expert_activation_quantization(model: torch.nn.Module, fmt: Format) -> int:
    """Fake-quantize the inputs of every expert's gate/up and down in a Transformers model's
    mixtures (modules holding stacked `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]):
    their forward replaced by Transformers' eager loop with both inputs quantized. Returns
    how many mixtures it changed."""
    if fmt.activations is None:
        return 0
    mixtures = [
        module
        for module in model.modules()
        if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter)
    ]
    for module in mixtures:
        module.forward = _quantized_experts_forward(module, fmt)
    return len(mixtures)


def _quantized_experts_forward(experts: torch.nn.Module, fmt: Format):
    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, choice = torch.where(top_k_index == expert)
            x = fake_quantize_activation(hidden_states[token], fmt)
            gate, up = F.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
            hidden = fake_quantize_activation(experts.act_fn(gate) * up, fmt)
            y = F.linear(hidden, experts.down_proj[expert]) * top_k_weights[token, choice, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    return forward


def write_w8a8_checkpoint(
    source: Path,
    quantized: Path,
    dequantized: Path,
    fmt: Format,
    quantized_layers: tuple[str, ...] = QUANTIZED_LAYERS,
) -> int:
    """Quantize the decoder projections of the fp32 model in `source` (those named in
    `quantized_layers`): `quantized` gets the 8-bit checkpoint, `dequantized` the same model
    with `reference_dequantize`'s weights. Returns the quantized layers' tensor bytes."""
    return write_quantized_checkpoint(
        source,
        quantized,
        dequantized,
        lambda weight, _: quantize_weight(weight, fmt),
        lambda tensors: reference_dequantize(tensors, fmt),
        fmt.quantization_config(),
        quantized_layers=quantized_layers,
    )
