"""AutoAWQ checkpoints (`quant_method` "awq"): which are served.

Served: AutoAWQ's GEMM packing (`version` "gemm"), 4-bit with zero points, groups of
32 * 2^n input rows (128 is AWQ's default) or one per output channel (-1), the head and
`modules_to_not_convert` unquantized. Refused by name: the GEMV / GEMV-fast / Marlin /
ExLlama / IPEX packings, other bit widths, AWQ without zero points.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.model.quantization.gptq import PER_CHANNEL, is_served_group_size
from pagedllm.model.quantization.method import CheckpointMethod, config_int

SERVED_BITS = (4,)
SERVED_VERSIONS = ("gemm",)


@dataclass(frozen=True)
class AWQConfig:
    bits: int
    group_size: int  # input rows per scale; -1: one scale per output channel
    zero_point: bool
    version: str  # the packing: "gemm", "gemv", ...

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> AWQConfig:
        """Transformers' names (`bits`, `group_size`) or AutoAWQ's own (`w_bit`,
        `q_group_size`), as vLLM reads them."""
        return cls(
            bits=config_int(config, ("bits", "w_bit"), 4),
            group_size=config_int(config, ("group_size", "q_group_size"), 128),
            zero_point=bool(config.get("zero_point", True)),
            version=str(config.get("version") or "gemm").lower(),
        )

    def describe(self) -> str:
        per_channel = self.group_size == PER_CHANNEL
        groups = "per channel" if per_channel else f"group size {self.group_size}"
        return (
            f"awq {self.bits}-bit, {groups}, zero_point={self.zero_point}, {self.version} packing"
        )


class AWQMethod(CheckpointMethod):
    name = "awq"
    served = "awq 4-bit gemm packing with zero points, group size -1 or 32 * 2^n, head unquantized"

    def scheme(self, config: dict[str, Any]) -> str:
        return AWQConfig.from_dict(config).describe()

    def refusal(self, config: dict[str, Any]) -> str | None:
        parsed = AWQConfig.from_dict(config)
        if parsed.version not in SERVED_VERSIONS:
            return f"AWQ's {parsed.version} packing is not read (gemm is)"
        if parsed.bits not in SERVED_BITS:
            return f"{parsed.bits}-bit AWQ weights have no kernel yet"
        if not parsed.zero_point:
            return "AWQ without zero points is not read"
        if not is_served_group_size(parsed.group_size):
            return f"AWQ group size {parsed.group_size} is not -1 or 32 * 2^n"
        return None
