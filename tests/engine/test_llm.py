"""The offline `LLM` API on a tiny model: output order, stops, seeds, chat, and no leaked blocks."""

import random

import pytest

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=256, max_num_batched_tokens=48, block_size=8)


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    kv = llm.llm_engine.engine_core.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks
    assert not llm.llm_engine.has_unfinished_requests()


def random_prompts(count, seed=0):
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randint(1, 90))]}
        for _ in range(count)
    ]


def test_outputs_come_back_in_input_order_with_their_prompts(llm):
    prompts = random_prompts(6)
    lengths = [1, 9, 3, 20, 2, 5]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outputs)
    assert all(o.outputs[0].cumulative_logprob is None for o in outputs)  # not asked for


def test_text_prompt_is_tokenized_and_output_decoded(llm):
    output = llm.generate(
        "The quick brown fox",
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )[0]
    tokenizer = llm.get_tokenizer()
    assert output.prompt == "The quick brown fox"
    assert output.prompt_token_ids == tokenizer.encode("The quick brown fox")
    assert output.outputs[0].text == tokenizer.decode(
        output.outputs[0].token_ids, skip_special_tokens=True
    )


def test_stop_token_ids_and_eos(llm):
    prompt = random_prompts(1, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    stopped = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids == tokens[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at


def test_eos_stops_unless_ignored(tiny_llama):
    # Make the first greedy token the EOS id, by declaring it so.
    probe = LLM(str(tiny_llama), max_model_len=64)
    prompt = {"prompt_token_ids": [7, 8, 9]}
    first = (
        probe.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        .outputs[0]
        .token_ids[0]
    )
    probe.llm_engine.model_config.__dict__["eos_token_ids"] = frozenset({first})
    stopped = probe.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[
        0
    ].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert stopped.stop_reason is None
    ignored = probe.generate(
        prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(ignored.token_ids) == 8 and ignored.finish_reason == "length"


def test_seeded_sampling_ignores_the_rest_of_the_batch(llm):
    target = random_prompts(1, seed=11)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(7, seed=12)
    noise = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    crowded = llm.generate(
        [*others[:3], target, *others[3:]], [noise] * 3 + [seeded] + [noise] * 4, use_tqdm=False
    )
    assert crowded[3].outputs[0].token_ids == alone
    other_seed = SamplingParams(
        temperature=1.0, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True
    )
    assert llm.generate(target, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(llm):
    prompts = random_prompts(5, seed=5)
    greedy = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    top1 = llm.generate(
        prompts,
        SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in top1] == [o.outputs[0].token_ids for o in greedy]


def test_chat_renders_the_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )[0]
    tokenizer = llm.get_tokenizer()
    expected = tokenizer.encode(
        "<s>user: What is the capital of France?</s><s>assistant:", add_special_tokens=False
    )
    assert output.prompt_token_ids == expected
    two = llm.chat(
        [messages, messages],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in two] == [output.outputs[0].token_ids] * 2


def test_max_tokens_none_runs_to_max_model_len(tiny_llama):
    small = LLM(str(tiny_llama), max_model_len=32)
    output = small.generate(
        {"prompt_token_ids": [5] * 20},
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(output.token_ids) == 12 and output.finish_reason == "length"


def test_request_metrics_are_ordered(llm):
    outputs = llm.generate(
        random_prompts(3, seed=8),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    for output in outputs:
        metrics = output.metrics
        assert metrics.arrival_time <= metrics.first_token_time <= metrics.finished_time
        assert metrics.time_to_first_token >= 0
