"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method` "gptq"): which are served.

Served: 4-bit weights, groups of 32 * 2^n input rows or one per output channel
(`group_size` -1), with or without act-order (`desc_act`), symmetric or not, in the
"gptq" (v1: zero points stored minus 1) or "gptq_v2" (stored as they are) layout, the head
unquantized. Refused by name: 2-, 3- and 8-bit, other group sizes, a quantized head,
GPTQModel's per-module `dynamic` overrides and other packings (marlin, bitblas, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.model.quantization.method import CheckpointMethod, config_int

SERVED_BITS = (4,)
# The kernel's block is 32 inputs; a group spans 2^n blocks (it finds a block's scale by a
# shift) or the whole input row.
MIN_GROUP_SIZE = 32
PER_CHANNEL = -1
# checkpoint_format -> the number added to a stored zero point to get the zero point.
ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}


@dataclass(frozen=True)
class GPTQConfig:
    bits: int
    group_size: int  # input rows per scale; -1: one scale per output channel
    desc_act: bool  # act-order: g_idx assigns input rows to groups out of order
    sym: bool
    checkpoint_format: str = "gptq"

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> GPTQConfig:
        return cls(
            bits=config_int(config, ("bits",), 4),
            group_size=config_int(config, ("group_size",), 128),
            desc_act=bool(config.get("desc_act", False)),
            sym=bool(config.get("sym", True)),
            checkpoint_format=str(config.get("checkpoint_format") or "gptq"),
        )

    @property
    def zero_offset(self) -> int:
        return ZERO_OFFSETS[self.checkpoint_format]

    def describe(self) -> str:
        groups = "per channel" if self.group_size == PER_CHANNEL else f"group {self.group_size}"
        return (
            f"gptq {self.bits}-bit {groups}, desc_act={self.desc_act}, sym={self.sym}, "
            f"format {self.checkpoint_format}"
        )


def is_served_group_size(group_size: int) -> bool:
    if group_size == PER_CHANNEL:
        return True
    blocks, remainder = divmod(group_size, MIN_GROUP_SIZE)
    return remainder == 0 and blocks > 0 and blocks & (blocks - 1) == 0


class GPTQMethod(CheckpointMethod):
    name = "gptq"
    served = (
        "gptq 4-bit, group size -1 or 32 * 2^n (32, 64, 128, ...), desc_act and sym either "
        "way, checkpoint_format gptq or gptq_v2, head unquantized"
    )

    def scheme(self, config: dict[str, Any]) -> str:
        return GPTQConfig.from_dict(config).describe()

    def refusal(self, config: dict[str, Any]) -> str | None:
        parsed = GPTQConfig.from_dict(config)
        if parsed.bits not in SERVED_BITS:
            return f"{parsed.bits}-bit GPTQ weights have no kernel yet"
        if not is_served_group_size(parsed.group_size):
            return f"GPTQ group size {parsed.group_size} is not -1 or 32 * 2^n"
        if parsed.checkpoint_format not in ZERO_OFFSETS:
            return f"GPTQ checkpoint_format {parsed.checkpoint_format!r} is not read"
        if config.get("lm_head"):
            return "a GPTQ-quantized lm_head is not read"
        if config.get("dynamic"):
            return "GPTQModel's per-module 'dynamic' overrides are not read"
        return None
