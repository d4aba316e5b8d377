"""Every pair of features one process can serve, on a tiny Llama: speculative decoding,
LoRA, a host-memory KV tier, int8 quantization, the fair policy with three tenants, n > 1
and structured output. Each pair runs in a pool small enough to preempt and with prompts
prefilled in chunks, and its greedy tokens (every sample's) equal those of a roomy engine
with only the pair's features that define the answer (LoRA, int8, a grammar); ties are
counted, as everywhere (int8's ties are wider: INT8_TIE_TOLERANCE). The matrix is printed
in docs/architecture.md ("Feature combinations"); tensor and pipeline parallelism are in
tests/distributed."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
from lora_utils import make_peft_adapter
from model_utils import MIXED_PROMPTS, compare_to_reference_engine, run_tenants

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.model.layers.quantization import reduce_range
from pagedllm.sampling_params import StructuredOutputsParams

PROMPTS = MIXED_PROMPTS
MAX_TOKENS = 16
ROOMY = {"max_model_len": 256, "kv_cache_memory": "8MiB"}
# Chunks of 16 tokens and a pool of 9 blocks of 16 tokens for six requests of up to 56
# tokens (two samples each under n > 1): preemption is certain.
TIGHT = {"max_num_batched_tokens": 16, "max_model_len": 96, "kv_cache_memory": 10 * 8192}


@dataclass(frozen=True)
class Feature:
    engine: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    defines_output: bool = False  # it changes the greedy answer (the reference has it)
    tenants: bool = False
    adapters: bool = False


FEATURES = {
    "spec": Feature({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}),
    "lora": Feature({"enable_lora": True, "max_loras": 2}, defines_output=True, adapters=True),
    "offload": Feature({"kv_offload_memory": "1MiB"}),
    "int8": Feature({"quantization": "int8"}, defines_output=True),
    "fair": Feature({"scheduling_policy": "fair"}, tenants=True),
    "n": Feature(params={"n": 2}),
    "grammar": Feature(
        params={"structured_outputs": StructuredOutputsParams(regex=r"[a-z ]{4,200}")},
        defines_output=True,
    ),
}
# int8 quantizes activations with one range per batch (each row rescaled first, so a row's
# error is bounded but not independent of its neighbours): a different batch moves a logit
# by a little, so with int8 a "tie" is a gap within int8's batch noise (twice as coarse
# with fbgemm's 7-bit activations, on CPUs without VNNI).
INT8_TIE_TOLERANCE = 0.05 * (2 if reduce_range() else 1)
# Under int8 a grammar forces one answer: the raw logprobs reported cannot tell a near-tie
# among the tokens a free grammar allows from a real difference.
FORCED_GRAMMAR = StructuredOutputsParams(regex="the quick brown fox jumps over the lazy dog")
PAIRS = list(itertools.combinations(FEATURES, 2))


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("matrix-adapters")
    return [
        LoRARequest(f"adapter{i}", i + 1, str(make_peft_adapter(tiny_llama, root / f"a{i}", i + 1)))
        for i in range(2)
    ]


def run(model, names: tuple[str, ...], adapters, layout: dict) -> list:
    """Every sample's completion of PROMPTS on an engine with the named features."""
    features = [FEATURES[name] for name in names]
    engine_args = {key: value for f in features for key, value in f.engine.items()}
    llm = LLM(str(model), **layout, **engine_args)
    settings = {key: value for f in features for key, value in f.params.items()}
    if {"int8", "grammar"} <= set(names):
        settings["structured_outputs"] = FORCED_GRAMMAR
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, **settings
    )
    tenants = ["a", "b", "c"] if any(f.tenants for f in features) else [None]
    loras = [*adapters, None] if any(f.adapters for f in features) else [None]
    requests = [
        (f"r{i}", tenants[i % len(tenants)], prompt, params, loras[i % len(loras)])
        for i, prompt in enumerate(PROMPTS)
    ]
    outputs = run_tenants(llm, requests, samples=True)
    core = llm.llm_engine.engine_core
    core.check_integrity()
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks
    return outputs, core.get_stats()


_REFERENCES: dict[tuple[str, ...], list] = {}


def reference(model, names: tuple[str, ...], adapters) -> list:
    """The roomy engine with the pair's answer-defining features (computed once each)."""
    defining = tuple(name for name in names if FEATURES[name].defines_output)
    if defining not in _REFERENCES:
        _REFERENCES[defining] = run(model, defining, adapters, ROOMY)[0]
    return _REFERENCES[defining]


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(pair) for pair in PAIRS])
def test_each_pair_equals_its_features_alone(tiny_llama, adapters, report_ties, pair):
    actual, stats = run(tiny_llama, pair, adapters, TIGHT)
    expected = reference(tiny_llama, pair, adapters)
    tolerance = INT8_TIE_TOLERANCE if "int8" in pair else 1e-4
    ties = 0
    for samples, want in zip(actual, expected, strict=True):
        assert len(samples) == (2 if "n" in pair else 1)
        for sample in samples:
            ties += compare_to_reference_engine([want[0]], [sample], tolerance)[0]
    report_ties(ties, len(actual))
    assert stats.num_preemptions > 0
    if "spec" in pair:
        assert stats.spec_decode.num_drafts > 0
