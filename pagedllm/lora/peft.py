"""Reading a PEFT LoRA adapter and checking it against the model, before any of it runs.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` (or
`adapter_model.bin`). Its tensors are named `base_model.model.<module>.lora_A.weight` ([r,
in]) and `...lora_B.weight` ([out, r]); the module is one of the model's attention and MLP
projections (`model.layers.<i>.self_attn.q_proj` ... `mlp.down_proj`). What the engine
cannot apply exactly is refused with a `LoRAAdapterError` naming it: DoRA, LoRA biases,
`fan_in_fan_out`, per-module rank or alpha patterns, `modules_to_save`, embedding or head
adapters (extra vocabulary), a rank above `max_lora_rank`, and shapes that do not fit.
The frontend reads every adapter once before a request may use it (so a bad one is a 400 or
a `ValueError`), and the model runner reads it again where it runs.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from pagedllm.config import ModelConfig
from pagedllm.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
MAX_CONFIG_BYTES = 1 << 20
# Largest |value| of an adapter's A or scaled B that is served. Trained adapters hold values
# around 1e-2 to 1 (B after an alpha/r of up to ~100); at 1e4 a hidden state of 1e3 over a
# 16k-wide projection still gives x·A·B far inside fp32, so no adapter within it can turn a
# request's logits into inf or NaN.
MAX_SERVED_MAGNITUDE = 1e4
_TENSOR_NAME = re.compile(
    r"base_model\.model\.(?P<module>.+)\.lora_(?P<kind>[AB])(\.default)?\.weight"
)
# Projections of a Llama-style decoder layer, by checkpoint name, and where they sit.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Config keys that change what an adapter computes, and the values the engine applies.
_REFUSED_SETTINGS = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "layer_replication": (None, []),
    "trainable_token_indices": (None, [], {}),
}


class LoRAAdapterError(ValueError):
    """The adapter cannot be served; the message names the problem."""


class LoRAAdapterFileError(LoRAAdapterError):
    """The adapter's directory or files are missing or unreadable. Kept apart from problems
    with what the files hold: the server answers a runtime load that fails this way with one
    message for every cause, so that its answers cannot map the server's files."""


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One projection's adapter: delta(x) = x A^T B^T, the scaling folded into B."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]


@dataclass(frozen=True)
class LoRAAdapter:
    request: LoRARequest
    rank: int
    scaling: float
    # Checkpoint module name (model.layers.3.self_attn.q_proj) -> its weights.
    modules: dict[str, LoRAModuleWeights]

    @property
    def num_bytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.modules.values())


def projection_shapes(model_config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Checkpoint module name -> (in_features, out_features) of every projection a LoRA
    adapter may target in this model."""
    hf = model_config.hf_config
    hidden, head_dim = hf.hidden_size, model_config.head_dim
    q_size = hf.num_attention_heads * head_dim
    kv_size = model_config.num_kv_heads * head_dim
    intermediate = getattr(hf, "intermediate_size", None)
    per_layer = {
        "self_attn.q_proj": (hidden, q_size),
        "self_attn.k_proj": (hidden, kv_size),
        "self_attn.v_proj": (hidden, kv_size),
        "self_attn.o_proj": (q_size, hidden),
    }
    if isinstance(intermediate, int):
        per_layer |= {
            "mlp.gate_proj": (hidden, intermediate),
            "mlp.up_proj": (hidden, intermediate),
            "mlp.down_proj": (intermediate, hidden),
        }
    return {
        f"model.layers.{i}.{name}": shape
        for i in range(model_config.num_layers)
        for name, shape in per_layer.items()
    }


def max_weight_bytes(shapes: dict[str, tuple[int, int]], max_rank: int) -> int:
    """The largest weight file an adapter of rank <= max_rank can need (fp32, every
    projection targeted), plus room for the file's own header."""
    return sum((i + o) * max_rank * 4 for i, o in shapes.values()) + (1 << 20)


def read_adapter(
    request: LoRARequest, shapes: dict[str, tuple[int, int]], max_rank: int
) -> LoRAAdapter:
    """The adapter at `request.lora_path`, checked against the model's projection shapes."""
    path = request.lora_path
    if not os.path.isdir(path):
        raise LoRAAdapterFileError(f"LoRA adapter {request.lora_name!r}: no directory at {path!r}")
    settings = _read_config(request)
    rank, alpha = _rank_and_alpha(request, settings, max_rank)
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = _read_weights(request, max_weight_bytes(shapes, max_rank))
    modules = _modules(request, tensors, shapes, rank, scaling)
    return LoRAAdapter(request, rank, scaling, modules)


def _fail(request: LoRARequest, problem: str, files: bool = False) -> LoRAAdapterError:
    """`files`: the problem is a missing or unreadable file (`LoRAAdapterFileError`)."""
    error_class = LoRAAdapterFileError if files else LoRAAdapterError
    return error_class(f"LoRA adapter {request.lora_name!r}: {problem}")


def _read_config(request: LoRARequest) -> dict:
    config_path = os.path.join(request.lora_path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise _fail(request, f"{CONFIG_FILE} is missing from {request.lora_path!r}", files=True)
    if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
        raise _fail(request, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        with open(config_path, encoding="utf-8") as file:
            settings = json.load(file)
    except OSError as error:
        raise _fail(request, f"cannot read {CONFIG_FILE} ({error.strerror})", files=True) from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise _fail(request, f"{CONFIG_FILE} is not valid JSON ({error})") from None
    if not isinstance(settings, dict):
        raise _fail(request, f"{CONFIG_FILE} must hold a JSON object")
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(request, f"peft_type {peft_type!r} is not supported; only 'LORA'")
    for key, accepted in _REFUSED_SETTINGS.items():
        if settings.get(key, accepted[0]) not in accepted:
            raise _fail(
                request,
                f"{key}={settings[key]!r} is not supported (extra vocabulary, embedding and "
                "head adapters, DoRA, LoRA biases and per-module ranks cannot be served)",
            )
    return settings


def _rank_and_alpha(request: LoRARequest, settings: dict, max_rank: int) -> tuple[int, float]:
    rank, alpha = settings.get("r", 8), settings.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(request, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _fail(request, f"rank r={rank} is larger than this engine's max_lora_rank={max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _fail(request, f"lora_alpha must be a finite number, got {alpha!r}")
    return rank, float(alpha)


def _read_weights(request: LoRARequest, max_bytes: int) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file_path = os.path.join(request.lora_path, name)
        if os.path.isfile(file_path):
            break
    else:
        raise _fail(request, f"no weights: expected one of {list(WEIGHT_FILES)}", files=True)
    size = os.path.getsize(file_path)
    if size > max_bytes:
        raise _fail(
            request,
            f"{name} holds {size} bytes; an adapter of rank <= max_lora_rank for this "
            f"model needs at most {max_bytes}",
        )
    try:
        if name.endswith(".safetensors"):
            tensors = _load_safetensors(file_path, max_bytes)
        else:
            tensors = torch.load(file_path, map_location="cpu", weights_only=True)
    except OSError as error:  # unreadable, not truncated
        raise _fail(request, f"cannot read {name} ({error.strerror})", files=True) from None
    except Exception as error:  # a truncated or foreign file: the adapter's problem alone
        raise _fail(request, f"cannot read {name}: {type(error).__name__}: {error}") from None
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
    ):
        raise _fail(request, f"{name} must map tensor names to tensors")
    return tensors


def _load_safetensors(file_path: str, max_bytes: int) -> dict[str, torch.Tensor]:
    """The file's tensors, deserialized from its bytes (at most `max_bytes` + 1 read: one that
    grew past the limit since its size was checked fails to parse). Not `load_file`:
    safetensors' `safe_open` keeps ~28 bytes of every tensor it hands out for good (0.8.0),
    a leak in the API process and the engine core at every runtime adapter load."""
    from safetensors.torch import load

    with open(file_path, "rb") as file:
        return load(file.read(max_bytes + 1))


def _modules(
    request: LoRARequest,
    tensors: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, int]],
    rank: int,
    scaling: float,
) -> dict[str, LoRAModuleWeights]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise _fail(request, f"tensor {name!r} is not a LoRA A or B weight of a projection")
        module = match["module"]
        if module not in shapes:
            supported = ", ".join(ATTENTION_PROJECTIONS + MLP_PROJECTIONS)
            raise _fail(
                request,
                f"module {module!r} cannot carry a LoRA adapter in this model "
                f"(supported: the decoder layers' {supported})",
            )
        halves.setdefault(module, {})[match["kind"]] = tensor
    if not halves:
        raise _fail(request, "the weights hold no LoRA tensors")
    modules = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise _fail(request, f"module {module!r} has lora_{next(iter(pair))} only")
        in_features, out_features = shapes[module]
        lora_a, lora_b = pair["A"], pair["B"]
        for kind, tensor, expected in (
            ("A", lora_a, (rank, in_features)),
            ("B", lora_b, (out_features, rank)),
        ):
            if tuple(tensor.shape) != expected:
                raise _fail(
                    request,
                    f"{module}.lora_{kind} has shape {tuple(tensor.shape)}, expected "
                    f"{expected} (rank {rank})",
                )
            if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
                raise _fail(request, f"{module}.lora_{kind} must hold finite floats")
        served_a = lora_a.to(torch.float32).contiguous()
        served_b = (lora_b.to(torch.float32) * scaling).contiguous()
        _check_magnitude(request, f"{module}.lora_A", served_a, "")
        _check_magnitude(request, f"{module}.lora_B", served_b, f" times lora_alpha/r={scaling:g}")
        modules[module] = LoRAModuleWeights(served_a, served_b)
    return modules


def _check_magnitude(request: LoRARequest, name: str, served: torch.Tensor, scaled: str) -> None:
    """The weights as served (fp32, B scaled) within ±MAX_SERVED_MAGNITUDE: finite in the file
    is not enough, since a lora_alpha of 1e300 or weights of 1e30 overflow fp32 in the
    scaling or in x·A·B and turn every token's logits into NaN."""
    largest = served.abs().max().item() if served.numel() else 0.0
    if not largest <= MAX_SERVED_MAGNITUDE:  # also catches inf and NaN from the scaling
        raise _fail(
            request,
            f"{name}{scaled} reaches {largest:g}; served adapter weights must stay within "
            f"±{MAX_SERVED_MAGNITUDE:g}",
        )
