"""`kv_cache_dtype`: a 16-bit KV cache under a float32 model holds twice the tokens in the
same memory and keeps greedy output on fp32's tokens up to ties (both attention backends)."""

from __future__ import annotations

import pytest
import torch
from model_utils import (
    compare_to_reference_engine,
    greedy_with_logprobs,
    model_runner,
    small_engine,
)

from pagedllm.config import EngineArgs

NUM_PROMPTS, MAX_TOKENS = 8, 24
# Rounding K/V moved the tiny model's logprobs by at most 5.9e-4 in fp16 and 6.4e-3 in bf16
# (measured, see the test's print); a top-2 gap below 1e-2 is a tie at that precision.
TIE_TOLERANCE = 1e-2


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_cache_keeps_fp32_greedy_output(tiny_model_factory, backend, dtype):
    directory = tiny_model_factory("LlamaForCausalLM")
    fp32 = small_engine(directory, attention_backend=backend)
    half = small_engine(directory, attention_backend=backend, kv_cache_dtype=dtype)
    assert model_runner(half).kv_caches[0][0].dtype == getattr(torch, dtype)
    assert (
        model_runner(half).kv_caches[0][0].shape[0]
        == 2 * model_runner(fp32).kv_caches[0][0].shape[0]
    )
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in range(5, 45, 5)]
    ties, largest = compare_to_reference_engine(
        greedy_with_logprobs(fp32, prompts, MAX_TOKENS),
        greedy_with_logprobs(half, prompts, MAX_TOKENS),
        TIE_TOLERANCE,
    )
    print(f"{dtype}/{backend}: ties {ties}, largest logprob difference {largest:.1e}")
    assert largest < (2e-3 if dtype == "float16" else 2e-2)


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="fp8")
