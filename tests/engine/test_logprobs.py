"""Sample and prompt logprobs equal log_softmax of Transformers' logits on the same weights."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of Transformers' logits at every position of `token_ids`."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_position(position_logprobs, chosen: int, expected: torch.Tensor, num_top: int):
    assert position_logprobs[chosen].logprob == pytest.approx(
        float(expected[chosen]), abs=TOLERANCE
    )
    assert position_logprobs[chosen].rank == int((expected > expected[chosen]).sum()) + 1
    top_values, top_ids = expected.topk(num_top)
    for token_id, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
        assert position_logprobs[token_id].logprob == pytest.approx(value, abs=TOLERANCE)
    assert set(position_logprobs) <= set(top_ids.tolist()) | {chosen}


def test_logprobs_match_transformers_in_a_mixed_batch(tiny_llama, hf_model):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 40, 75, 9)]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=3),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(
            temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0
        ),
    ]
    # A small budget splits the 75-token prompt (and its prompt logprobs) over several steps.
    llm = LLM(str(tiny_llama), max_model_len=128, max_num_batched_tokens=32, block_size=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, param, output in zip(prompts, params, outputs, strict=True):
        completion = output.outputs[0]
        expected = hf_logprobs(hf_model, prompt + completion.token_ids)
        if param.logprobs is None:
            assert completion.logprobs is None and completion.cumulative_logprob is None
        else:
            assert len(completion.logprobs) == len(completion.token_ids)
            for i, token_id in enumerate(completion.token_ids):
                row = expected[len(prompt) - 1 + i]
                check_position(completion.logprobs[i], token_id, row, param.logprobs)
            total = sum(
                p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids, strict=True)
            )
            assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)
        if param.prompt_logprobs is None:
            assert output.prompt_logprobs is None
        else:
            assert output.prompt_logprobs[0] is None
            assert len(output.prompt_logprobs) == len(prompt)
            for index in range(1, len(prompt)):
                check_position(
                    output.prompt_logprobs[index],
                    prompt[index],
                    expected[index - 1],
                    param.prompt_logprobs,
                )


def test_decoded_tokens_are_attached(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64)
    output = llm.generate(
        "The quick brown",
        SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True),
        use_tqdm=False,
    )[0]
    tokenizer = llm.get_tokenizer()
    for position in output.outputs[0].logprobs:
        for token_id, logprob in position.items():
            assert logprob.decoded_token == tokenizer.decode([token_id])


def test_logprobs_above_max_logprobs_are_refused(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64, max_logprobs=4)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field}=5 is above max_logprobs=4"):
            llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(**{field: 5}), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
