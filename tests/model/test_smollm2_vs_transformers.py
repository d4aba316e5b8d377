"""The real default model (SmolLM2-135M-Instruct, from its GGUF): greedy tokens equal Transformers'
loading the same file, in one batch under chunking, preemption and an odd block size, and alone."""

import pytest
from model_utils import cached_hf_greedy, compare_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.model.loader import default_model_path

MAX_NEW_TOKENS = 32
TIE_TOLERANCE = 1e-4
BLOCK_SIZE = 13
SENTENCE = "Paged attention stores keys and values in fixed-size blocks of memory. "
RAW_PROMPTS = ["Hi", "The capital of France is"]  # sent as plain text: 1 and 5 tokens
QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "Summarize this text: " + SENTENCE * 4,
    "Summarize this text: " + SENTENCE * 16,
    "Summarize this text: " + SENTENCE * 24,
]


@pytest.fixture(scope="module")
def prompts_and_references(request):
    llm = LLM(
        max_model_len=512,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=96,
        kv_cache_memory=46080 * 700,
    )
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in RAW_PROMPTS] + [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        for q in QUESTIONS
    ]

    # Transformers' model is loaded only when the references are not in the cache yet.
    def load():
        return request.getfixturevalue("hf_default_model")

    references = cached_hf_greedy(default_model_path(), prompts, MAX_NEW_TOKENS, load)
    return llm, prompts, references


@pytest.mark.slow
def test_prompt_lengths_cover_the_range(prompts_and_references):
    _, prompts, _ = prompts_and_references
    lengths = [len(p) for p in prompts]
    assert len(prompts) >= 8 and min(lengths) == 1 and max(lengths) > 300
    assert all(n % BLOCK_SIZE for n in lengths), lengths


@pytest.mark.slow
def test_batch_with_chunking_and_preemption_matches_transformers(
    prompts_and_references, report_ties
):
    llm, prompts, references = prompts_and_references
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    ties = sum(
        compare_greedy(o.outputs[0].token_ids, r, TIE_TOLERANCE)
        for o, r in zip(outputs, references, strict=True)
    )
    report_ties(ties, len(prompts))
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


@pytest.mark.slow
def test_each_request_alone_matches_transformers(prompts_and_references, report_ties):
    llm, prompts, references = prompts_and_references
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    ties = 0
    for prompt, reference in zip(prompts, references, strict=True):
        output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        ties += compare_greedy(output.outputs[0].token_ids, reference, TIE_TOLERANCE)
    report_ties(ties, len(prompts))


@pytest.mark.slow
def test_chat_answers_the_capital_of_france(prompts_and_references):
    llm, _, _ = prompts_and_references
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"
