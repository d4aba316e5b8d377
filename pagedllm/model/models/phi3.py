"""Phi-3 decoder (Phi-3, Phi-3.5-mini, Phi-4-mini): the Llama decoder without biases, whose
checkpoints store q/k/v and gate/up already fused.

Loading cuts each fused checkpoint tensor into its projections' row ranges and hands them to
the Llama shard loaders, so tensor-parallel ranks still read only their own rows. LongRoPE
and partial rotation are `layers/rotary.py`'s (including its engine-wide choice between the
short and long factors); the sliding window is `layer_sliding_windows`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.model.layers.rotary import rope_parameters
from pagedllm.model.models.llama import LlamaForCausalLM, _head_dim, _num_kv_heads

# Rope types Transformers' Phi-3 accepts (`su` is read as `longrope` by `rope_parameters`).
SUPPORTED_PHI3_ROPE_TYPES = ("default", "longrope")


class CheckpointRows:
    """Rows [start, start + count) of a checkpoint tensor or lazy slice, itself lazy: the shard
    loaders narrow it again, so only this rank's rows are read."""

    def __init__(self, source: Any, start: int, count: int) -> None:
        self.source, self.start = source, start
        self.shape = (count, *tuple(source.shape)[1:])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self.source.narrow(0, self.start + start, length)
        # Column cuts are row-parallel layers' (o, down), which no fused tensor feeds.
        return self.materialize().narrow(dim, start, length)

    def materialize(self) -> torch.Tensor:
        return self.source.narrow(0, self.start, self.shape[0])


def fused_projection_rows(config: Any) -> dict[str, list[tuple[str, int]]]:
    """Checkpoint module name -> its projections, in row order, with their row counts."""
    head_dim = _head_dim(config)
    q_rows = config.num_attention_heads * head_dim
    kv_rows = _num_kv_heads(config) * head_dim
    ffn_rows = config.intermediate_size
    return {
        "qkv_proj": [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)],
        "gate_up_proj": [("gate_proj", ffn_rows), ("up_proj", ffn_rows)],
    }


def split_fused_weights(
    weights: Iterable[tuple[str, Any]], config: Any
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each fused q/k/v and gate/up tensor replaced by its
    projections' rows, named as Llama checkpoints name them."""
    projections = fused_projection_rows(config)
    for name, tensor in weights:
        parts = name.split(".")
        fused = next((i for i, part in enumerate(parts) if part in projections), None)
        if fused is None:
            yield name, tensor
            continue
        rows = projections[parts[fused]]
        _check_rows(name, tensor.shape[0], rows)
        start = 0
        for projection, count in rows:
            split_name = ".".join([*parts[:fused], projection, *parts[fused + 1 :]])
            yield split_name, _rows(tensor, start, count)
            start += count


def _check_rows(name: str, num_rows: int, rows: list[tuple[str, int]]) -> None:
    expected = sum(count for _, count in rows)
    if num_rows != expected:
        layout = ", ".join(f"{projection} {count}" for projection, count in rows)
        raise ValueError(
            f"checkpoint tensor {name!r} has {num_rows} rows; the config gives {expected} "
            f"({layout})"
        )


def _rows(tensor: Any, start: int, count: int) -> Any:
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(0, start, count)
    return CheckpointRows(tensor, start, count)


def check_phi3_config(config: Any) -> None:
    """Refuse what Transformers' Phi-3 does not have or pagedllm does not implement."""
    rope_type = rope_parameters(config)["rope_type"]
    if rope_type not in SUPPORTED_PHI3_ROPE_TYPES:
        raise ValueError(
            f"Phi-3 rope_type {rope_type!r} is not supported; supported: "
            f"{SUPPORTED_PHI3_ROPE_TYPES} (and the legacy name 'su')"
        )
    for field in ("attention_bias", "mlp_bias"):
        if getattr(config, field, False):
            raise ValueError(f"Phi-3 has no biases; {field}=True is not supported")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Serves Phi3ForCausalLM checkpoints: Phi-3 and Phi-3.5-mini (LongRoPE for the 128k
    context), Phi-4-mini (LongRoPE over 3/4 of each head)."""

    check_config = staticmethod(check_phi3_config)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (HF names, fused q/k/v and gate/up) into the parameters."""
        super().load_weights(split_fused_weights(weights, self.config))
