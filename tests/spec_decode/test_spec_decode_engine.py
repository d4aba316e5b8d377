"""Speculative decoding end to end on tiny random models: greedy output equals the engine
without speculation for every method, under chunked prefill, preemption and mixed batches;
stops inside accepted runs are exact; the KV cache stays sound (PAGEDLLM_DEBUG checks every
step, tests/conftest.py)."""

from __future__ import annotations

import pytest
from model_utils import compare_to_reference_engine, greedy_with_logprobs, model_runner
from spec_checks import PROMPTS, assert_seeded_sample_alone_as_batched, engine

from pagedllm import SamplingParams

MAX_TOKENS = 40


def method_configs(tiny_model_factory) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
        "suffix": {"method": "suffix", "num_speculative_tokens": 5},
        # Another architecture of the same vocabulary: a poor draft, many rejections.
        "draft_model": {
            "method": "draft_model",
            "model": str(tiny_model_factory("Qwen2ForCausalLM")),
            "num_speculative_tokens": 3,
        },
        "self_quantized": {
            "method": "self_quantized",
            "quantization": "int8",
            "num_speculative_tokens": 3,
        },
    }


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = engine(tiny_llama)
    return greedy_with_logprobs(llm, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "self_quantized"])
@pytest.mark.parametrize(
    "layout",
    [
        {},
        # Prompts prefilled in chunks, drafts clipped by the budget, and a pool of 13
        # blocks of 8 KiB (208 tokens; a draft model's KV halves it) for six requests of up
        # to 75 tokens: preemption.
        {"max_num_batched_tokens": 16, "max_model_len": 96, "kv_cache_memory": 14 * 8192},
    ],
    ids=["plain", "chunked-preempted"],
)
def test_greedy_equals_no_speculation(
    tiny_llama, tiny_model_factory, reference, report_ties, method, layout
):
    config = method_configs(tiny_model_factory)[method]
    llm = engine(tiny_llama, config, **layout)
    actual = greedy_with_logprobs(llm, PROMPTS, MAX_TOKENS)
    ties, _ = compare_to_reference_engine(reference, actual, tie_tolerance=1e-4)
    report_ties(ties, len(PROMPTS))
    stats = llm.get_stats()
    assert stats.spec_decode is not None and stats.spec_decode.num_drafts > 0
    if layout:
        assert stats.num_preemptions > 0
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks  # every block came back


def test_self_draft_accepts_everything(tiny_llama, reference):
    """The target as its own draft model: every draft is accepted, and the per-position
    counts say so."""
    config = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 4}
    llm = engine(tiny_llama, config)
    actual = greedy_with_logprobs(llm, PROMPTS, MAX_TOKENS)
    compare_to_reference_engine(reference, actual, tie_tolerance=1e-4)
    counts = llm.get_stats().spec_decode
    assert counts.num_accepted_tokens == counts.num_draft_tokens > 0
    assert counts.num_accepted_tokens_per_pos[0] == counts.num_drafts


def test_max_tokens_and_stops_inside_an_accepted_run(tiny_llama):
    """A request that stops in the middle of a run of accepted drafts ends exactly where it
    would have without speculation: at max_tokens, at a stop token id."""
    prompt = {"prompt_token_ids": PROMPTS[0]}
    config = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 5}
    plain, spec = engine(tiny_llama), engine(tiny_llama, config)
    full = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    tokens = full[0].outputs[0].token_ids
    for max_tokens in (1, 2, 3, 7, 11):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == tokens[:max_tokens]
        assert got.finish_reason == "length"
    stop_at = next(i for i in range(8, 30) if tokens[i] not in tokens[:i])
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[stop_at]])
    got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == tokens[: stop_at + 1]
    assert got.finish_reason == "stop" and got.stop_reason == tokens[stop_at]


@pytest.mark.slow  # long (~13 s on two busy cores)
def test_logprobs_penalties_and_n_with_speculation(tiny_llama):
    """Logprobs of the emitted tokens come from the target at their positions; penalties see
    the accepted drafts before each position; parallel samples each speculate."""
    config = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    plain, spec = engine(tiny_llama), engine(tiny_llama, config)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    for params in (
        SamplingParams(temperature=0, max_tokens=24, logprobs=3),
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=24, frequency_penalty=0.7, min_tokens=20),
        SamplingParams(temperature=0, max_tokens=16, n=3),
    ):
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        for a, b in zip(want, got, strict=True):
            assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
            if params.logprobs:
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                    assert x.keys() == y.keys()
                    for token in x:
                        assert y[token].logprob == pytest.approx(x[token].logprob, abs=1e-4)
                        assert y[token].rank == x[token].rank
    assert spec.get_stats().spec_decode.num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible_with_speculation(tiny_llama):
    """A seeded request samples the same tokens whatever else is in the batch."""
    config = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    assert_seeded_sample_alone_as_batched(engine(tiny_llama, config), max_tokens=24)


def test_disable_by_batch_size_stops_speculating(tiny_llama):
    config = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "disable_by_batch_size": 2,
    }
    llm = engine(tiny_llama, config)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert llm.get_stats().spec_decode.num_drafts == 0
    llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    assert llm.get_stats().spec_decode.num_drafts > 0


def test_draft_model_keeps_its_own_cache_in_step(tiny_llama):
    """The draft's KV pool holds the same blocks as the target's, and its KV counts in the
    memory the pool was given (fewer blocks for the same kv_cache_memory)."""
    config = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 2}
    plain, spec = engine(tiny_llama), engine(tiny_llama, config)
    runner = model_runner(spec)
    assert len(runner.draft_kv_pool) == 2
    assert runner.draft_kv_pool[0][0].shape == runner.kv_cache_pool[0][0].shape
    plain_blocks = plain.llm_engine.engine_core.kv_cache_manager.block_pool.num_blocks
    spec_blocks = spec.llm_engine.engine_core.kv_cache_manager.block_pool.num_blocks
    assert spec_blocks == plain_blocks // 2


def test_parallel_samples_fork_in_a_step_that_verifies_drafts(tiny_llama):
    """A request with n > 1 finishes its prompt (and forks its samples) in a step where
    another request verifies drafts: every sample gets its first token from its parent."""
    config = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    prompts = [{"prompt_token_ids": PROMPTS[0][:8]}, {"prompt_token_ids": list(range(100, 180))}]
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, n=3, ignore_eos=True),
    ]
    plain = engine(tiny_llama, max_num_batched_tokens=16)
    spec = engine(tiny_llama, config, max_num_batched_tokens=16)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert spec.get_stats().spec_decode.num_accepted_tokens > 0


def test_a_faulty_request_fails_alone_in_a_step_that_verifies_drafts(tiny_llama, monkeypatch):
    """A request whose logits stage raises (an injected fault) while others verify drafts
    ends with an error; the others answer as without speculation."""
    monkeypatch.setenv("PAGEDLLM_INJECT_FAULT_SEED", "4242")
    config = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    prompts = [{"prompt_token_ids": p} for p in (PROMPTS[0], PROMPTS[4], list(range(100, 180)))]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    faulty = SamplingParams(temperature=0.5, max_tokens=24, seed=4242)
    spec = engine(tiny_llama, config, max_num_batched_tokens=16)
    got = spec.generate(prompts, [greedy, greedy, faulty], use_tqdm=False)
    assert got[2].outputs[0].finish_reason == "error"
    assert "injected fault" in got[2].outputs[0].error
    monkeypatch.delenv("PAGEDLLM_INJECT_FAULT_SEED")
    want = engine(tiny_llama).generate(prompts[:2], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got[:2]] == [o.outputs[0].token_ids for o in want]
    assert spec.get_stats().spec_decode.num_accepted_tokens > 0
