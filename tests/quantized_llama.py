"""The tiny Llama the quantization tests (GPTQ, AWQ, compressed-tensors, W8A8) write their
checkpoints from, and the once-per-scheme cache their module fixtures keep checkpoints and
engines in (writing one, or starting an engine on it, is most of a test's time), and the run
of a checkpoint drafting for the fp32 model it was dequantized into."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from model_utils import (
    compare_to_reference_engine,
    greedy_with_logprobs,
    make_tiny_model,
    model_runner,
)
from torch import nn

from pagedllm import LLM

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


def draft_for_the_dequantized_model(
    quantized: Path, dequantized: Path, check_draft: Callable[[nn.Module], None], tolerance: float
) -> tuple[LLM, int]:
    """`quantized` drafting 3 tokens for `dequantized`: `check_draft` is handed the draft's
    model (the layers it runs on), the target must stay fp32 and give its own greedy tokens
    (ties within `tolerance` counted). (the engine, for its drafts' counts; the ties)."""
    prompts = [[5, 6, 7, 8] * 5, list(range(100, 130)), [3, 200, 7, 90, 45, 300, 12, 8]]
    common = dict(max_model_len=128, kv_cache_memory="8MiB")
    expected = greedy_with_logprobs(LLM(str(dequantized), **common), prompts, 24)
    draft = {"method": "draft_model", "model": str(quantized), "num_speculative_tokens": 3}
    llm = LLM(str(dequantized), speculative_config=draft, **common)
    assert llm.llm_engine.model_config.quantization is None  # the target stays fp32
    check_draft(model_runner(llm).proposer.model)
    actual = greedy_with_logprobs(llm, prompts, 24)
    ties, _ = compare_to_reference_engine(expected, actual, tolerance)
    return llm, ties
