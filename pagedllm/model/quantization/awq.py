"""AutoAWQ checkpoints (`quant_method` "awq"): detected and refused, naming the scheme."""

from __future__ import annotations

from typing import Any

from pagedllm.model.quantization.method import CheckpointMethod


class AWQMethod(CheckpointMethod):
    name = "awq"

    def scheme(self, config: dict[str, Any]) -> str:
        version = config.get("version", "gemm")
        return (
            f"awq {config.get('bits', config.get('w_bit', '?'))}-bit, group size "
            f"{config.get('group_size', config.get('q_group_size', '?'))}, {version} packing"
        )
