"""Speculative decoding on the default model: greedy output token for token equal to decoding
without it for every method, on a copy-heavy prompt and chat prompts in one batch; and
structured output that still always validates when drafts run past what the grammar allows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.model.loader import default_model_path
from pagedllm.sampling_params import StructuredOutputsParams
from tests.structured_output.schemas import SCHEMAS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "self_quantized": {
        "method": "self_quantized",
        "quantization": "gguf",
        "num_speculative_tokens": 4,
    },
    # No smaller model shares its tokenizer here: the model drafts for itself.
    "draft_model": {
        "method": "draft_model",
        "model": default_model_path(),
        "num_speculative_tokens": 3,
    },
}


def prompts(tokenizer) -> list[str]:
    source = (ROOT / "pagedllm/core/block_pool.py").read_text()
    listing = source[source.index("\nclass ") + 1 :][:700]
    copy = [{"role": "user", "content": f"Repeat this code exactly:\n```python\n{listing}\n```"}]
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Count from one to twenty in words."}],
    ]
    rendered = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
        for c in (copy, *chats)
    ]
    rendered[0] += "```python\n"
    return rendered


@pytest.fixture(scope="module")
def plain_llm():
    return LLM(max_model_len=1024, kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def reference(plain_llm):
    texts = prompts(plain_llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=96, logprobs=2)
    return texts, plain_llm.generate(texts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def self_draft_llm():
    config = METHODS["self_quantized"]
    return LLM(max_model_len=1024, kv_cache_memory="256MiB", speculative_config=config)


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_equals_decoding_without_speculation(reference, report_ties, self_draft_llm, method):
    texts, want = reference
    llm = (
        self_draft_llm
        if method == "self_quantized"
        else LLM(max_model_len=1024, kv_cache_memory="256MiB", speculative_config=METHODS[method])
    )
    params = SamplingParams(temperature=0, max_tokens=96, logprobs=2)
    got = llm.generate(texts, params, use_tqdm=False)
    ties = 0
    for a, b in zip(want, got, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        for position, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
            if x != y:  # only where the reference's top two logprobs tie
                top = sorted(a.logprobs[position].values(), key=lambda lp: -lp.logprob)
                assert top[0].logprob - top[1].logprob <= 1e-4, (method, position)
                ties += 1
                break
        else:
            assert a.token_ids == b.token_ids
    report_ties(ties, len(texts))
    counts = llm.get_stats().spec_decode
    assert counts.num_accepted_tokens > 0
    assert counts.mean_acceptance_length > 1.2  # the copy prompt is made for guessing


def test_stop_strings_inside_an_accepted_run(plain_llm, self_draft_llm, reference):
    """The quantized self-draft's runs are accepted whole; a stop string that ends inside
    one cuts the text exactly where decoding without speculation cuts it."""
    texts, want = reference
    full = want[0].outputs[0].text
    for stop in (full[10:14], full[31:36], full[52:55]):
        params = SamplingParams(temperature=0, max_tokens=96, stop=[stop])
        a = plain_llm.generate(texts[0], params, use_tqdm=False)[0].outputs[0]
        b = self_draft_llm.generate(texts[0], params, use_tqdm=False)[0].outputs[0]
        assert (b.text, b.finish_reason, b.stop_reason) == (a.text, "stop", stop)
        assert b.token_ids == a.token_ids
    assert self_draft_llm.get_stats().spec_decode.mean_acceptance_length > 2


@pytest.fixture(scope="module")
def speculating_llm():
    config = {"method": "suffix", "num_speculative_tokens": 8}
    return LLM(max_num_seqs=64, speculative_config=config)


def test_structured_output_with_speculation_always_validates(speculating_llm):
    """Drafts from the suffix tree (which knows nothing of the grammar) are cut at the first
    token the grammar forbids; sampled and greedy outputs all validate."""
    schemas = SCHEMAS[:6]
    conversations = [
        [{"role": "user", "content": f"Reply with JSON matching this schema: {json.dumps(s)}"}]
        for s in schemas
    ]
    for temperature in (0.0, 1.0):
        params = [
            SamplingParams(
                temperature=temperature,
                n=1 if temperature == 0 else 3,
                seed=i,
                max_tokens=300,
                structured_outputs=StructuredOutputsParams(json=s),
            )
            for i, s in enumerate(schemas)
        ]
        outputs = speculating_llm.chat(conversations, params, use_tqdm=False)
        for schema, output in zip(schemas, outputs, strict=True):
            for sample in output.outputs:
                assert sample.finish_reason == "stop", (schema, sample.text)
                jsonschema.validate(json.loads(sample.text), schema)
    pattern = r"(\d{3}-){3}\d{3}"  # repetitive: the tree proposes what it saw
    params = SamplingParams(
        temperature=0.8,
        n=4,
        seed=3,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(regex=pattern),
    )
    for output in speculating_llm.generate(["Numbers: 123-456-789-012"] * 3, params):
        for sample in output.outputs:
            assert re.fullmatch(pattern, sample.text), sample.text
    assert speculating_llm.get_stats().spec_decode.num_accepted_tokens > 0
