"""n > 1: the prompt is computed once, children share its blocks (copy-on-write for the
partial last block), each seeded child is reproducible, and every block comes back."""

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.request import child_request_id

PROMPT = {"prompt_token_ids": [(7 * i) % 500 + 3 for i in range(21)]}  # 21: a partial block


def sampled(seed, n=1, **kwargs):
    return SamplingParams(
        temperature=1.0, top_p=0.95, seed=seed, n=n, max_tokens=12, ignore_eos=True, **kwargs
    )


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=128, block_size=8)


def completions(output):
    return [c.token_ids for c in output.outputs]


def test_each_child_equals_a_single_request_with_seed_plus_index(llm):
    (parallel,) = llm.generate(PROMPT, sampled(seed=100, n=4), use_tqdm=False)
    assert [c.index for c in parallel.outputs] == [0, 1, 2, 3]
    singles = [llm.generate(PROMPT, sampled(seed=100 + i), use_tqdm=False)[0] for i in range(4)]
    assert completions(parallel) == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(c) for c in completions(parallel)}) > 1  # they really differ
    (again,) = llm.generate(PROMPT, sampled(seed=100, n=4), use_tqdm=False)
    assert completions(again) == completions(parallel)
    llm.llm_engine.engine_core.check_integrity()


def test_prompt_is_computed_once(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, block_size=8, enable_prefix_caching=False)
    llm.generate(PROMPT, sampled(seed=1, n=4), use_tqdm=False)
    assert llm.get_stats().num_computed_prompt_tokens == len(PROMPT["prompt_token_ids"])


def test_children_share_full_blocks_and_copy_the_partial_one(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, block_size=8, enable_prefix_caching=False)
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    engine.add_request("p", PROMPT, sampled(seed=5, n=4))
    engine.step()  # prefill, first tokens, fork
    kv = core.kv_cache_manager
    tables = [kv.get_block_ids(child_request_id("p", i)) for i in range(4)]
    assert tables[0] == tables[1] == tables[2] == tables[3] and len(tables[0]) == 3
    assert [kv.block_pool.blocks[b].ref_cnt for b in tables[0]] == [4, 4, 4]
    engine.step()  # every child writes into the shared partial block: three copies
    tables = [kv.get_block_ids(child_request_id("p", i)) for i in range(4)]
    assert len({t[2] for t in tables}) == 4  # own last block each
    assert all(t[:2] == tables[0][:2] for t in tables)  # full blocks still shared
    while engine.has_unfinished_requests():
        engine.step()
    core.check_integrity()


def test_parallel_and_single_requests_in_one_batch(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    others = [{"prompt_token_ids": [11 + i] * (5 + i)} for i in range(3)]
    alone = [o.outputs[0].token_ids for o in llm.generate(others, greedy, use_tqdm=False)]
    mixed = llm.generate(
        [others[0], PROMPT, others[1], others[2]],
        [greedy, sampled(seed=9, n=3), greedy, greedy],
        use_tqdm=False,
    )
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 3)] == alone
    assert len(mixed[1].outputs) == 3


def test_greedy_children_are_identical(llm):
    params = SamplingParams(temperature=0, n=3, max_tokens=8, ignore_eos=True)
    (output,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert completions(output)[0] == completions(output)[1] == completions(output)[2]


def test_preemption_keeps_children_exact(tiny_llama):
    # 12 usable blocks of 4 tokens (512 bytes a token): 3 requests x 4 children cannot fit.
    small = LLM(str(tiny_llama), max_model_len=32, block_size=4, kv_cache_memory=512 * 4 * 13)
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(10)]} for _ in range(3)]
    outputs = small.generate(prompts, [sampled(seed=20 + i, n=4) for i in range(3)], use_tqdm=False)
    assert small.get_stats().num_preemptions > 0
    roomy = LLM(str(tiny_llama), max_model_len=32, block_size=4)
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        singles = [
            roomy.generate(prompt, sampled(seed=20 + i + j), use_tqdm=False)[0] for j in range(4)
        ]
        assert completions(output) == [s.outputs[0].token_ids for s in singles]
    small.llm_engine.engine_core.check_integrity()


def test_abort_of_the_parent_aborts_every_child(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, block_size=8)
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=40, ignore_eos=True)
    engine.add_request("p", PROMPT, params)
    engine.step()
    engine.step()
    assert len(core.scheduler.running) == 3
    engine.abort_request(["p"])
    assert not core.has_unfinished_requests()
    core.check_integrity()


def test_streamed_deltas_name_their_completion(llm):
    from pagedllm.sampling_params import RequestOutputKind

    params = sampled(seed=3, n=2, output_kind=RequestOutputKind.DELTA)
    outputs = list(llm.llm_engine.stream(PROMPT, params))
    by_index = {0: [], 1: []}
    for output in outputs:
        (completion,) = output.outputs
        by_index[completion.index] += completion.token_ids
    (final,) = llm.generate(PROMPT, sampled(seed=3, n=2), use_tqdm=False)
    assert [by_index[0], by_index[1]] == completions(final)
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
