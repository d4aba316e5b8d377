"""`dtype`: "auto" follows vLLM's rule (the checkpoint's dtype; bf16 on the CPU only where it
has bf16 arithmetic), and a bf16 engine stays on the fp32 engine's greedy tokens on the
default model's prompts above a stated floor (reported)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from model_utils import greedy_with_logprobs

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.engine import engine_config
from pagedllm.ops.cpu_features import CpuFeatures

AVX2 = CpuFeatures.from_flags({"avx2", "fma", "f16c"})
AMX = CpuFeatures.from_flags({"avx2", "fma", "f16c", "avx512f", "amx_tile", "amx_bf16"})
ZEN4 = CpuFeatures.from_flags({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"})


def _auto(stored, features, monkeypatch, **kwargs) -> torch.dtype:
    monkeypatch.setattr(engine_config, "cpu_features", lambda: features)
    args = EngineArgs(**kwargs)
    return engine_config.model_dtype(args, SimpleNamespace(dtype=stored), is_gguf=False)


@pytest.mark.parametrize(
    ("stored", "features", "expected"),
    [
        (torch.float32, AMX, torch.float32),  # the checkpoint's
        (torch.bfloat16, AMX, torch.bfloat16),  # bf16 arithmetic: bf16
        (torch.bfloat16, ZEN4, torch.bfloat16),
        (torch.bfloat16, AVX2, torch.float32),  # bf16 would be converted to fp32 anyway
        ("bfloat16", AVX2, torch.float32),  # configs may store the name
        (torch.float16, AMX, torch.float32),  # the CPU kernels take no fp16; fp32 is exact
        (None, AMX, torch.float32),  # unknown: fp32
    ],
)
def test_auto_follows_the_checkpoint_and_the_cpu(stored, features, expected, monkeypatch):
    assert _auto(stored, features, monkeypatch) == expected


def test_auto_is_float32_for_quantized_and_gguf_models(monkeypatch):
    assert _auto(torch.bfloat16, AMX, monkeypatch, quantization="int8") == torch.float32
    config = SimpleNamespace(dtype=torch.bfloat16)
    assert engine_config.model_dtype(EngineArgs(), config, is_gguf=True) == torch.float32


def test_an_explicit_dtype_is_kept(monkeypatch):
    assert _auto(torch.float32, AVX2, monkeypatch, dtype="bfloat16") == torch.bfloat16


# Greedy agreement of bf16 with fp32: the share of generated tokens equal position by
# position, up to each sequence's first difference. Measured 0.80 (154 of 192) on these
# prompts (AVX2 EPYC, 2026-11-26): bf16 weights and activations keep 8 bits of mantissa,
# so on some prompts the 135M model's greedy path leaves fp32's after a dozen tokens.
AGREEMENT_FLOOR = 0.6
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "List three uses of a paper clip.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
]


@pytest.mark.slow
def test_bf16_keeps_fp32s_greedy_tokens_above_the_floor():
    engines = [
        LLM(dtype=d, max_model_len=256, kv_cache_memory="64MiB") for d in ("float32", "bfloat16")
    ]
    tokenizer = engines[0].get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True,
            return_dict=False,
        )
        for q in QUESTIONS
    ]  # fmt: skip
    fp32, bf16 = (
        [list(o.token_ids) for o in greedy_with_logprobs(e, prompts, 32)] for e in engines
    )
    same = total = 0
    for a, b in zip(fp32, bf16, strict=True):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same, total = same + prefix, total + len(a)
    print(f"bf16 greedy agreement with fp32: {same}/{total} = {same / total:.2f}")
    assert same / total >= AGREEMENT_FLOOR
