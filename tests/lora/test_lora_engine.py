"""Multi-LoRA end to end on tiny random Llama and Qwen2 models: greedy tokens equal
Transformers + PEFT on the merged model for every adapter, in one mixed batch of four
adapters and the base model, under chunked prefill and preemption, with tenants under the
fair policy, and equal each request run alone; the prefix cache never shares KV between
adapters; `max_loras` bounds the adapters of every step; two tensor-parallel ranks give
PEFT's tokens too; every block returns to the pool (PAGEDLLM_DEBUG checks every step,
tests/conftest.py)."""

from __future__ import annotations

import pytest
from lora_utils import make_peft_adapter, merged_model
from model_utils import compare_greedy, compare_to_reference_engine, hf_greedy, run_tenants

from pagedllm import LLM, LoRARequest, SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11] * 3,
    list(range(100, 140)),
    [3, 200, 7, 90, 45, 300, 12, 8],
]
MAX_TOKENS = 24
# Four adapters of different ranks, targets and scalings (rank <= max_lora_rank = 16).
ADAPTERS = [
    {"rank": 4, "target_modules": None},
    {"rank": 8, "target_modules": ["q_proj", "v_proj"]},
    {"rank": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"], "use_rslora": True},
    {"rank": 16, "target_modules": ["k_proj", "o_proj", "down_proj"], "alpha": 8.0},
]
ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM"]


class Setup:
    """A base model, its adapters, and each (adapter, prompt)'s reference."""

    def __init__(self, base, adapter_dirs, references):
        self.base = base
        self.loras = [
            LoRARequest(f"adapter{i}", i + 1, str(path)) for i, path in enumerate(adapter_dirs)
        ]
        self.references = references  # [adapter index + 1 (0: base)][prompt] -> reference


# Llama's adapters and references in the fast tier; Qwen2's too (~70 s on two busy cores)
# in `make test`.
@pytest.fixture(
    scope="module",
    params=[ARCHITECTURES[0], pytest.param(ARCHITECTURES[1], marks=pytest.mark.slow)],
)
def setup(request, tiny_model_factory, tmp_path_factory) -> Setup:
    base = tiny_model_factory(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapter_dirs = [
        make_peft_adapter(base, root / f"adapter{i}", seed=i + 1, **settings)
        for i, settings in enumerate(ADAPTERS)
    ]
    references = []
    for adapter in [None, *adapter_dirs]:
        model = merged_model(base, adapter)
        references.append([hf_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS])
    return Setup(base, adapter_dirs, references)


def engine(setup: Setup, **engine_args) -> LLM:
    settings = {"max_model_len": 256, "kv_cache_memory": "8MiB", "max_loras": 4}
    return LLM(str(setup.base), enable_lora=True, **(settings | engine_args))


def mixed_batch(setup: Setup) -> tuple[list[list[int]], list[LoRARequest | None], list]:
    """Every prompt under every adapter and the base model, interleaved."""
    prompts, loras, references = [], [], []
    for p, prompt in enumerate(PROMPTS):
        for a, lora in enumerate([None, *setup.loras]):
            prompts.append(prompt)
            loras.append(lora)
            references.append(setup.references[a][p])
    return prompts, loras, references


def generate(llm: LLM, prompts, loras, logprobs: int | None = None):
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs
    )
    batch = [{"prompt_token_ids": prompt} for prompt in prompts]
    outputs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
    return [output.outputs[0] for output in outputs]


def assert_peft_tokens(outputs, references, report_ties) -> None:
    """Every output's greedy tokens are PEFT's (ties counted)."""
    ties = sum(
        compare_greedy(list(output.token_ids), reference, tie_tolerance=1e-4)
        for output, reference in zip(outputs, references, strict=True)
    )
    report_ties(ties, len(outputs))


def assert_pool_whole(llm: LLM) -> None:
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


@pytest.mark.parametrize(
    "layout",
    [
        {},
        # Prompts prefilled in chunks of 16 tokens next to other requests' decodes, and a
        # pool of 20 blocks of 16 tokens for 15 requests of up to 64 tokens: preemption.
        {"max_num_batched_tokens": 16, "max_model_len": 96, "kv_cache_memory": 21 * 4096},
    ],
    ids=["plain", "chunked-preempted"],
)
def test_mixed_batch_equals_peft(setup, report_ties, layout):
    llm = engine(setup, **layout)
    prompts, loras, references = mixed_batch(setup)
    outputs = generate(llm, prompts, loras)
    assert_peft_tokens(outputs, references, report_ties)
    if layout:
        assert llm.get_stats().num_preemptions > 0
    # The adapters change the output: the comparison is not the base model's five times.
    base_tokens = [setup.references[0][p].token_ids for p in range(len(PROMPTS))]
    assert sum(r.token_ids not in base_tokens for r in references) >= len(ADAPTERS)
    assert_pool_whole(llm)


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["LlamaForCausalLM"], indirect=True)  # one suffices
def test_tenants_under_the_fair_policy_equal_peft(setup, report_ties):
    """Three tenants share two adapter slots and a pool that preempts, under "fair"."""
    llm = engine(
        setup,
        scheduling_policy="fair",
        max_loras=2,
        max_num_batched_tokens=16,
        max_model_len=96,
        kv_cache_memory=21 * 4096,
    )
    prompts, loras, references = mixed_batch(setup)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [
        (f"r{i}", f"tenant{i % 3}", prompt, params, lora)
        for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True))
    ]
    outputs = run_tenants(llm, requests)
    assert_peft_tokens(outputs, references, report_ties)
    assert llm.get_stats().num_preemptions > 0
    assert_pool_whole(llm)


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["LlamaForCausalLM"], indirect=True)  # one suffices
def test_an_int8_base_takes_adapters(setup):
    """LoRA on an int8 base: the deltas run in fp32 beside the int8 projections. Fed PEFT's
    fp32 answers (teacher forcing), int8 + adapter ranks PEFT's token first at >= 95% of
    positions, as int8 does for the base model (tests/model/test_int8.py); without its
    adapter int8 agrees far less, so the adapters are applied."""
    llm = engine(setup, quantization="int8")
    prompts, loras, references = mixed_batch(setup)
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def agreement(adapters) -> float:
        forced = [
            {"prompt_token_ids": prompt + reference.token_ids}
            for prompt, reference in zip(prompts, references, strict=True)
        ]
        outputs = llm.generate(forced, score, use_tqdm=False, lora_request=adapters)
        firsts = [
            position[token].rank == 1
            for output, prompt in zip(outputs, prompts, strict=True)
            for position, token in zip(
                output.prompt_logprobs[len(prompt) :],
                output.prompt_token_ids[len(prompt) :],
                strict=True,
            )
        ]
        return sum(firsts) / len(firsts)

    adapted = [lora is not None for lora in loras]
    with_adapters = agreement(loras)
    assert with_adapters >= 0.95
    assert agreement([None] * len(loras)) < with_adapters - 0.2 * sum(adapted) / len(adapted)
    assert_pool_whole(llm)


def test_batched_equals_alone(setup, report_ties):
    llm = engine(setup)
    prompts, loras, _ = mixed_batch(setup)
    batched = generate(llm, prompts, loras, logprobs=2)
    alone = [
        generate(llm, [prompt], [lora], logprobs=2)[0]
        for prompt, lora in zip(prompts, loras, strict=True)
    ]
    ties, _ = compare_to_reference_engine(alone, batched, tie_tolerance=1e-4)
    report_ties(ties, len(prompts))
    assert_pool_whole(llm)


def test_prefix_cache_never_shared_between_adapters(setup):
    llm = engine(setup)
    prompt = list(range(100, 164))  # four full blocks
    computed = []
    answers = []
    for lora in [setup.loras[0], setup.loras[1], setup.loras[0], None]:
        before = llm.get_stats().num_computed_prompt_tokens
        answers.append(generate(llm, [prompt], [lora])[0].token_ids)
        computed.append(llm.get_stats().num_computed_prompt_tokens - before)
    # Each adapter computes the prompt itself; its own second request hits its cache
    # (all but the last token, which is recomputed to sample from); the base model shares
    # nothing with either adapter.
    assert computed == [len(prompt), len(prompt), 1 + (len(prompt) - 1) % 16, len(prompt)]
    assert answers[0] == answers[2] != answers[1]
    for lora_index, answer in ((1, answers[0]), (2, answers[1]), (0, answers[3])):
        model = merged_model(
            setup.base, None if not lora_index else setup.loras[lora_index - 1].lora_path
        )
        assert list(answer) == hf_greedy(model, prompt, MAX_TOKENS).token_ids
    assert_pool_whole(llm)


def test_max_loras_bounds_every_step(setup, report_ties):
    llm = engine(setup, max_loras=2, max_cpu_loras=4)
    scheduler = llm.llm_engine.engine_core.scheduler
    adapters_per_step = []
    schedule = scheduler.schedule

    def recording_schedule():
        output = schedule()
        ids = {scheduler.requests[r].lora_int_id for r in output.num_scheduled_tokens}
        adapters_per_step.append(len(ids - {0}))
        return output

    scheduler.schedule = recording_schedule
    prompts, loras, references = mixed_batch(setup)
    outputs = generate(llm, prompts, loras)
    assert max(adapters_per_step) == 2
    assert_peft_tokens(outputs, references, report_ties)
    assert all(len(output.token_ids) == MAX_TOKENS for output in outputs)
    assert_pool_whole(llm)


def test_chat_and_beam_search_take_an_adapter(setup):
    llm = engine(setup)
    lora = setup.loras[0]
    conversation = [{"role": "user", "content": "The quick brown fox"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with_adapter = llm.chat(conversation, params, use_tqdm=False, lora_request=lora)
    without = llm.chat(conversation, params, use_tqdm=False)
    assert with_adapter[0].outputs[0].token_ids != without[0].outputs[0].token_ids
    from pagedllm import BeamSearchParams

    beams = llm.beam_search(
        [{"prompt_token_ids": PROMPTS[0]}],
        BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True),
        lora_request=[lora],
    )
    generated = beams[0].sequences[0].tokens[len(PROMPTS[0]) :]  # tokens hold the prompt's
    assert generated == setup.references[1][0].token_ids[:6]


def test_bad_adapters_are_refused_and_fail_alone(setup, tmp_path):
    llm = engine(setup)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with pytest.raises(ValueError, match=r"lora_request: .*no directory"):
        llm.generate(prompt, params, lora_request=LoRARequest("gone", 9, str(tmp_path / "x")))
    plain = LLM(str(setup.base), max_model_len=256, kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="started without enable_lora"):
        plain.generate(prompt, params, lora_request=setup.loras[0])
    # An adapter that passed the check and broke before its first step fails its request
    # alone; the others in the batch finish as they would have.
    import shutil

    fragile = shutil.copytree(setup.loras[0].lora_path, tmp_path / "fragile")
    lora = LoRARequest("fragile", 42, str(fragile))
    llm.llm_engine.input_processor.check_lora_request(lora)
    (fragile / "adapter_model.safetensors").write_bytes(b"broken")
    outputs = llm.generate([prompt, prompt], params, use_tqdm=False, lora_request=[lora, None])
    assert outputs[0].outputs[0].finish_reason == "error"
    assert "loading the LoRA adapter failed" in outputs[0].outputs[0].error
    assert outputs[1].outputs[0].token_ids == setup.references[0][0].token_ids[:4]
    assert_pool_whole(llm)


class CountingGraph:
    """The runner's compiled decode step, counting its calls."""

    def __init__(self, graph) -> None:
        self.graph, self.calls = graph, 0
        self.applies = graph.applies

    def __call__(self, *args):
        self.calls += 1
        return self.graph(*args)


@pytest.mark.slow  # long: a compile (tests/engine/test_compiled_decode.py)
def test_compiled_decode_runs_steps_without_adapters(tiny_llama, tmp_path, report_ties):
    """compile=True: steps without adapters take the compiled graph, steps with an adapter
    stay eager; both are exact."""
    adapter = make_peft_adapter(tiny_llama, tmp_path / "adapter", seed=7)
    lora = LoRARequest("adapter", 1, str(adapter))
    llm = LLM(
        str(tiny_llama), max_model_len=256, kv_cache_memory="8MiB", enable_lora=True, compile=True
    )
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    runner.compiled_decode = counting = CountingGraph(runner.compiled_decode)
    base = generate(llm, PROMPTS, [None] * len(PROMPTS))
    assert counting.calls > 0
    calls_before = counting.calls
    with_adapter = generate(llm, PROMPTS, [lora] * len(PROMPTS))
    assert counting.calls == calls_before  # every step ran the adapter: eager
    references = [
        hf_greedy(model, prompt, MAX_TOKENS)
        for model in (merged_model(tiny_llama, None), merged_model(tiny_llama, adapter))
        for prompt in PROMPTS
    ]
    ties = sum(
        compare_greedy(list(output.token_ids), reference, tie_tolerance=1e-4)
        for output, reference in zip([*base, *with_adapter], references, strict=True)
    )
    report_ties(ties, len(references))


@pytest.mark.slow  # two worker processes
@pytest.mark.parametrize("setup", ["LlamaForCausalLM"], indirect=True)  # one suffices
def test_tensor_parallel_ranks_equal_peft(setup, report_ties):
    """Two ranks, each with its cut of the four adapters (rows of B in q/k/v and gate/up,
    columns of A in o and down), in the mixed batch with the base model: PEFT's tokens."""
    llm = engine(setup, tensor_parallel_size=2)
    try:
        prompts, loras, references = mixed_batch(setup)
        outputs = generate(llm, prompts, loras)
        assert_pool_whole(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert_peft_tokens(outputs, references, report_ties)


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["LlamaForCausalLM"], indirect=True)  # one suffices
def test_a_draft_model_proposes_for_adapters(setup, report_ties):
    """The draft model runs without adapters: its proposals are only proposals, and the
    target with each request's adapter verifies them, so the tokens stay PEFT's."""
    draft = {"method": "draft_model", "model": str(setup.base), "num_speculative_tokens": 3}
    llm = engine(setup, speculative_config=draft)
    prompts, loras, references = mixed_batch(setup)
    outputs = generate(llm, prompts, loras)
    assert_peft_tokens(outputs, references, report_ties)
    counts = llm.get_stats().spec_decode
    # The base model's drafts: all accepted for the base model's requests, fewer for the
    # adapters' (the draft does not know them).
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    assert_pool_whole(llm)
