"""compressed-tensors' 8-bit schemes (llm-compressor's `int-quantized` W8A8 and
`float-quantized` FP8, and `naive-quantized` of either): which are served.

Served: every config group the same scheme, with 8-bit weights, symmetric, per output
channel or per tensor (fp8 also in blocks), and activations of the weights' type,
symmetric, dynamic per token (fp8 also per token and group, as FP8_BLOCK writes them) or
static per tensor, or none (weight-only). Refused by name: asymmetric activations or
weights (zero points), other bit widths, weight groups, output activations, a KV cache
scheme, sparsity and transforms, and a config mixing schemes.
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.quantization.w8a8_scheme import (
    FP8,
    INT8,
    PER_GROUP,
    PER_TENSOR,
    PER_TOKEN,
    WEIGHT_BLOCK,
    WEIGHT_CHANNEL,
    WEIGHT_TENSOR,
    ActivationScheme,
    W8A8Scheme,
    positive_ints,
)

SERVED_FORMATS = {
    "int-quantized": (INT8,),
    "float-quantized": (FP8,),
    "naive-quantized": (INT8, FP8),
}
SERVED = (
    "int-quantized W8A8 (int8 weights per channel or tensor, activations dynamic per token "
    "or static per tensor, or none) and float-quantized FP8 (weights per channel, tensor or "
    "block; activations dynamic per token or group, static per tensor, or none)"
)
_ADDED_PARTS = ("sparsity_config", "transform_config", "kv_cache_scheme")


class Refused(ValueError):
    """A compressed-tensors scheme pagedllm does not serve; the message says why."""


def w8a8_scheme(config: dict[str, Any]) -> W8A8Scheme:
    """The one 8-bit scheme of a compressed-tensors config; raises Refused saying why not."""
    for part in _ADDED_PARTS:
        if config.get(part):
            raise Refused(f"{part} is not read")
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise Refused("no config_groups")
    schemes = {_group_scheme(group, config.get("format")) for group in groups}
    if len(schemes) > 1:
        raise Refused("config groups with different schemes are not served together")
    return schemes.pop()


def refusal(config: dict[str, Any]) -> str | None:
    try:
        w8a8_scheme(config)
    except Refused as why:
        return str(why)
    return None


def _group_scheme(group: dict[str, Any], top_format: str | None) -> W8A8Scheme:
    weights = group.get("weights") or {}
    weight_type = str(weights.get("type", INT8))
    fmt = str(group.get("format") or top_format or "?")
    if weight_type not in SERVED_FORMATS.get(fmt, ()):
        raise Refused(f"format {fmt!r} with {weight_type} weights is not read here")
    if group.get("output_activations"):
        raise Refused("quantized output activations are not served")
    _check_eight_bit_symmetric(weights, "weights")
    strategy, block = _weight_strategy(weights, weight_type)
    activations = group.get("input_activations")
    return W8A8Scheme(weight_type, strategy, _activation_scheme(activations, weight_type), block)


def _check_eight_bit_symmetric(args: dict[str, Any], what: str) -> None:
    if int(args.get("num_bits", 8)) != 8:
        raise Refused(f"{args.get('num_bits')}-bit {what} are not 8-bit (W8A8 / FP8 only)")
    if not args.get("symmetric", True):
        raise Refused(f"asymmetric {what} (zero points) are not served")


def _weight_strategy(weights: dict[str, Any], weight_type: str) -> tuple[str, tuple | None]:
    strategy = str(weights.get("strategy", WEIGHT_TENSOR))
    if strategy in (WEIGHT_CHANNEL, WEIGHT_TENSOR):
        return strategy, None
    block = weights.get("block_structure")
    if strategy == WEIGHT_BLOCK and weight_type == FP8 and block:
        sizes = positive_ints(block, 2)
        if sizes is None:
            raise Refused(f"block_structure {block} is not two positive integers")
        return strategy, sizes
    raise Refused(f"{weight_type} weights quantized per {strategy} are not served")


def _group_size(value: Any) -> int:
    sizes = positive_ints([value], 1)
    if sizes is None:
        raise Refused(f"activation group_size {value} is not a positive integer")
    return sizes[0]


def _activation_scheme(args: dict[str, Any] | None, weight_type: str) -> ActivationScheme | None:
    if not args:
        return None
    _check_eight_bit_symmetric(args, "activations")
    if str(args.get("type", INT8)) != weight_type:
        raise Refused(f"{args.get('type')} activations with {weight_type} weights")
    strategy, dynamic = str(args.get("strategy", PER_TENSOR)), args.get("dynamic", False)
    if dynamic is True and strategy in (PER_TOKEN, PER_TENSOR):
        return ActivationScheme(strategy, True)
    if dynamic is True and strategy == PER_GROUP and weight_type == FP8:
        return ActivationScheme(strategy, True, _group_size(args.get("group_size")))
    if dynamic is False and strategy == PER_TENSOR:
        return ActivationScheme(strategy, False)
    kind = {True: "dynamic", False: "static"}.get(dynamic, str(dynamic))
    raise Refused(f"{kind} {weight_type} activations per {strategy} are not served")
