"""Greedy output equals Transformers' token for token on tiny random models of each architecture,
in one batch forced through chunked prefill, preemption and an odd block size, and alone."""

import random

import pytest
import torch
from model_utils import compare_greedy, hf_greedy
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.utils import cdiv

PROMPT_LENGTHS = (1, 5, 17, 33, 64, 100, 150, 310)  # block size 7 divides none of them
MAX_NEW_TOKENS = 40
TIE_TOLERANCE = 1e-4
# Tokens of KV the engine gets: too few for the batch, so it preempts. A model whose every
# layer has a window holds at most ~window tokens per request, so it gets fewer.
# The fast tier (tests/tiers.py) keeps plain Llama, Qwen2's two KV cache groups and Gemma 3;
# the other variants (3-8 s each on two busy cores) run in `make test`.
LONG = pytest.mark.slow
KV_TOKENS = {"Gemma3ForCausalLM": 400, "MistralForCausalLM:window24": 200}


@pytest.mark.parametrize(
    "variant",
    [
        "LlamaForCausalLM",
        pytest.param("LlamaForCausalLM:llama3", marks=LONG),
        pytest.param("LlamaForCausalLM:tied-bias", marks=LONG),
        pytest.param("Qwen2ForCausalLM", marks=LONG),
        pytest.param("MistralForCausalLM", marks=LONG),
        pytest.param("MistralForCausalLM:window24", marks=LONG),
        "Qwen2ForCausalLM:hybrid24",
        pytest.param("Qwen3ForCausalLM", marks=LONG),
        "Gemma3ForCausalLM",
        pytest.param("Phi3ForCausalLM", marks=LONG),
        pytest.param("Phi3ForCausalLM:longrope", marks=LONG),
        pytest.param("MixtralForCausalLM", marks=LONG),
        pytest.param("Qwen3MoeForCausalLM", marks=LONG),
    ],
)
def test_greedy_matches_transformers(variant, tiny_model_factory, report_ties):
    directory = tiny_model_factory(variant)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]
    references = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)

    llm = LLM(
        str(directory),
        max_model_len=400,
        block_size=7,
        max_num_batched_tokens=64,
        kv_cache_memory=_bytes_for_tokens(directory, KV_TOKENS.get(variant, 600), 7),
    )
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.num_preemptions > 0, "the KV budget should force preemption"
    ties = sum(
        compare_greedy(out.outputs[0].token_ids, ref, TIE_TOLERANCE)
        for out, ref in zip(batch, references, strict=True)
    )
    alone = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
    ties += sum(
        compare_greedy(out.outputs[0].token_ids, ref, TIE_TOLERANCE)
        for out, ref in zip(alone, references, strict=True)
    )
    report_ties(ties, 2 * len(prompts))
    kv = llm.llm_engine.engine_core.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


def _bytes_for_tokens(directory, num_tokens: int, block_size: int) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    num_blocks = cdiv(num_tokens, block_size) + 1
    return num_blocks * block_size * per_token
