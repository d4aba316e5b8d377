"""The tiny Llama the quantization tests (GPTQ, AWQ, compressed-tensors, W8A8) write their
checkpoints from, and the once-per-scheme cache their module fixtures keep checkpoints and
engines in (writing one, or starting an engine on it, is most of a test's time)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from model_utils import make_tiny_model

# Inputs and outputs of whole groups of 128; head_dim 64 so that o_proj has 256 inputs.
SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64)

T = TypeVar("T")


def make_quantizable_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), **SHAPE)


def once_per_scheme(make: Callable[[Any], T]) -> Callable[[Any], T]:
    """`make(scheme)`, run once for each scheme (told apart by their names)."""
    made: dict[str, T] = {}

    def get(scheme: Any) -> T:
        if str(scheme) not in made:
            made[str(scheme)] = make(scheme)
        return made[str(scheme)]

    return get
