"""What the speculative-decoding engine tests share: their prompts, their engine's settings,
and the checks that speculation leaves greedy and seeded output as the plain engine's."""

from __future__ import annotations

import re

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

# A repeated pattern (n-gram and suffix proposals find it) and plain prompts, mixed.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11] * 5,
    [40, 41, 42, 43] * 6 + [17, 18],
    list(range(100, 130)),
    [3, 200, 7, 90, 45, 300, 12, 8],
    [70, 71, 72, 73, 74, 75] * 4,
    list(range(250, 262)),
]


def engine(directory, speculative_config=None, **engine_args) -> LLM:
    settings = {"max_model_len": 256, "kv_cache_memory": "8MiB", **engine_args}
    return LLM(str(directory), speculative_config=speculative_config, **settings)


def assert_same_outputs(plain: LLM, spec: LLM, prompts: list, params: SamplingParams) -> None:
    """Every sample of every prompt: the same tokens with speculation as without."""
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]


def assert_seeded_sample_alone_as_batched(spec: LLM, max_tokens: int) -> None:
    """A seeded request samples the same tokens alone as between a sampling and a greedy
    request."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens, seed=11)
    alone = spec.generate({"prompt_token_ids": PROMPTS[1]}, seeded, use_tqdm=False)
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    greedy = SamplingParams(max_tokens=5)
    batch = spec.generate(
        [{"prompt_token_ids": p} for p in PROMPTS[:3]], [sampling, seeded, greedy], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def assert_structured_output_as_plain(plain: LLM, spec: LLM) -> None:
    """Under a grammar (no digits) greedy output is the plain engine's and matches it, with
    drafts proposed (those the grammar forbids cut, the others verified)."""
    pattern = r"[^0-9]{10,40}"
    params = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    prompts = ["No digits: ", "Still none 12"]
    drafts_before = spec.get_stats().spec_decode.num_drafts
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert re.fullmatch(pattern, b.outputs[0].text), b.outputs[0].text
    assert spec.get_stats().spec_decode.num_drafts > drafts_before
