"""Structured output on the default model at temperature 1.0: every sample of 20 JSON schemas
validates, regex / choice / EBNF outputs all match, constrained requests leave unconstrained
ones in the same batch untouched, and a bad spec is refused before anything runs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.structured_output.schemas import PERSON, SCHEMAS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=128)


def sampled(spec: StructuredOutputsParams, seed: int, n: int = 5, max_tokens: int = 400):
    return SamplingParams(
        temperature=1.0, n=n, seed=seed, max_tokens=max_tokens, structured_outputs=spec
    )


def test_twenty_json_schemas_five_samples_each_all_validate(llm):
    assert len(SCHEMAS) == 20
    conversations = [
        [{"role": "user", "content": f"Reply with JSON matching this schema: {json.dumps(s)}"}]
        for s in SCHEMAS
    ]
    params = [sampled(StructuredOutputsParams(json=s), seed=i) for i, s in enumerate(SCHEMAS)]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    for schema, output in zip(SCHEMAS, outputs, strict=True):
        assert len(output.outputs) == 5
        for sample in output.outputs:
            assert sample.finish_reason == "stop", (schema, sample.text)
            jsonschema.validate(json.loads(sample.text), schema)


REGEXES = {
    "date": r"\d{4}-\d{2}-\d{2}",
    "email": r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
}
GRAMMAR = """root ::= answer " " number " " color
answer ::= "I like" | "I hate"
number ::= [1-9] | [1-9] [0-9]
color ::= "red" | "green" | "blue"
"""
GRAMMAR_PATTERN = r"I (like|hate) [1-9][0-9]? (red|green|blue)"


def test_regex_choice_and_grammar_outputs_always_match(llm):
    choices = ["positive", "negative", "neutral"]
    cases = [(StructuredOutputsParams(regex=r), r) for r in REGEXES.values()]
    cases.append((StructuredOutputsParams(choice=choices), "|".join(choices)))
    cases.append((StructuredOutputsParams(grammar=GRAMMAR), GRAMMAR_PATTERN))
    prompts = ["Write one example:"] * len(cases)
    params = [sampled(spec, seed=i, n=8, max_tokens=64) for i, (spec, _) in enumerate(cases)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for (_, pattern), output in zip(cases, outputs, strict=True):
        for sample in output.outputs:
            assert re.fullmatch(pattern, sample.text), (pattern, sample.text)


def test_unconstrained_requests_are_untouched_by_constrained_neighbours(llm):
    prompts = ["The capital of France is", "List three fruits:", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    constrained = sampled(StructuredOutputsParams(json=PERSON), seed=3, n=2, max_tokens=64)
    mixed = llm.generate(
        [prompts[0], "Describe a person:", prompts[1], "Another person:", prompts[2]],
        [greedy, constrained, greedy, constrained, greedy],
        use_tqdm=False,
    )
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    for i in (1, 3):
        for sample in mixed[i].outputs:
            jsonschema.validate(json.loads(sample.text), PERSON)


@pytest.mark.parametrize(
    "spec,message",
    [
        (StructuredOutputsParams(json={"type": "objekt"}), "invalid JSON schema"),
        (StructuredOutputsParams(json="{not json"), "not JSON"),
        (StructuredOutputsParams(regex="[a-"), "invalid regex"),
        (StructuredOutputsParams(grammar="root ::= missing"), "invalid grammar"),
    ],
)
def test_bad_specs_are_refused_before_running(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("x", SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
