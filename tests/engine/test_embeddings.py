"""Embeddings (`runner="pooling"`, `LLM.embed`): each prompt's final hidden states pooled
(last, mean or cls) and normalized equal Transformers' `hidden_states[-1]` pooled the same
way, for every decoder architecture we load, batched with mixed lengths and chunked
prefills; no KV block outlives its request."""

from __future__ import annotations

import pytest
import torch
from model_utils import TINY_CONFIGS

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.pooling_params import PoolerConfig
from pagedllm.runner.pooler import Pooler

TOLERANCE = 1e-4
# Mixed lengths: one token, under a block, several blocks, longer than one step's budget.
TOKEN_PROMPTS = [list(range(3, 3 + n)) for n in (1, 5, 37, 70)]
STEP_BUDGET = 32  # below the longest prompt: its prefill spans several steps


def hf_pooled(model, token_ids: list[int], pooling_type: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0]
    pooled = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling_type]
    return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled


def max_difference(outputs, references) -> float:
    return max(
        (torch.tensor(output.outputs.embedding) - reference).abs().max().item()
        for output, reference in zip(outputs, references, strict=True)
    )


def pooling_engine(model_dir, pooling_type: str, normalize: bool = True) -> LLM:
    return LLM(
        str(model_dir),
        runner="pooling",
        pooler_config={"pooling_type": pooling_type, "normalize": normalize},
        max_num_batched_tokens=STEP_BUDGET,
        max_num_seqs=4,
    )


def assert_no_kv_kept(llm: LLM) -> None:
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


@pytest.mark.parametrize("architecture", sorted(TINY_CONFIGS))
def test_last_token_pooling_equals_transformers(tiny_model_factory, architecture):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory(architecture)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llm = pooling_engine(model_dir, "last")
    outputs = llm.embed([{"prompt_token_ids": p} for p in TOKEN_PROMPTS], use_tqdm=False)
    references = [hf_pooled(hf_model, p, "last", True) for p in TOKEN_PROMPTS]
    assert [o.prompt_token_ids for o in outputs] == TOKEN_PROMPTS
    assert max_difference(outputs, references) < TOLERANCE
    assert_no_kv_kept(llm)


@pytest.mark.parametrize(("pooling_type", "normalize"), [("mean", True), ("cls", False)])
def test_mean_and_cls_pooling_equal_transformers(tiny_llama, pooling_type, normalize):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    llm = pooling_engine(tiny_llama, pooling_type, normalize)
    outputs = llm.embed(TOKEN_PROMPTS, use_tqdm=False)  # lists of token ids
    references = [hf_pooled(hf_model, p, pooling_type, normalize) for p in TOKEN_PROMPTS]
    assert max_difference(outputs, references) < TOLERANCE
    norms = [torch.tensor(o.outputs.embedding).norm().item() for o in outputs]
    assert normalize == all(abs(n - 1) < 1e-5 for n in norms)
    assert_no_kv_kept(llm)


def test_request_overrides_normalize(tiny_llama):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    llm = LLM(
        str(tiny_llama),
        runner="pooling",
        pooler_config='{"pooling_type": "MEAN"}',  # vLLM's upper case is taken
        max_num_batched_tokens=STEP_BUDGET,
    )
    prompts = [list(range(3 + i, 60 + i)) for i in range(4)]
    raw = PoolingParams(normalize=False)
    outputs = llm.embed(prompts, [raw, PoolingParams(), raw, PoolingParams()], use_tqdm=False)
    references = [hf_pooled(hf_model, p, "mean", i % 2 == 1) for i, p in enumerate(prompts)]
    assert max_difference(outputs, references) < TOLERANCE


@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls"])
def test_pooler_over_chunks_and_a_restart(pooling_type):
    """Chunks of one prompt pool to the whole prompt's vector; a chunk at position 0 again
    (a recompute after preemption) starts over instead of adding to what came before."""
    hidden = torch.randn(10, 8)
    whole = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling_type]
    pooler = Pooler(PoolerConfig(pooling_type, normalize=False))
    pooler.add_request("a", None, 10)
    assert pooler.pool(["a"], [0], [4], hidden[:4]) == {}
    assert pooler.pool(["a"], [0], [6], hidden[:6]) == {}  # preempted, recomputed
    pooled = pooler.pool(["a"], [6], [4], hidden[6:])["a"]
    assert torch.allclose(torch.tensor(pooled), whole, atol=1e-6)
    pooler.add_request("b", PoolingParams(normalize=True), 3)
    rows = torch.cat([hidden[:2], hidden[:3]])  # "a" again from 0 (2 tokens), then "b" whole
    pooled = pooler.pool(["a", "b"], [0, 0], [2, 3], rows)
    assert set(pooled) == {"b"} and abs(torch.tensor(pooled["b"]).norm().item() - 1) < 1e-6


def test_runner_and_request_mismatches_are_refused(tiny_llama):
    llm = pooling_engine(tiny_llama, "last")
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions: this model's embeddings have 64"):
        llm.embed([5, 6], PoolingParams(dimensions=8), use_tqdm=False)
    assert len(llm.embed([5, 6], PoolingParams(dimensions=64), use_tqdm=False)) == 1
    generator = LLM(str(tiny_llama), max_num_seqs=2)
    with pytest.raises(ValueError, match="runner='generate'"):
        generator.embed([5, 6], use_tqdm=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"runner": "embed"}, "runner must be one of"),
        ({"runner": "pooling", "pooler_config": '{"pooling_type": "max"}'}, "pooling_type"),
        ({"runner": "pooling", "pooler_config": '{"normalise": true}'}, "normalise"),
        ({"runner": "pooling", "pooler_config": "{"}, "pooler_config is not valid JSON"),
        ({"pooler_config": {"pooling_type": "mean"}}, "pooler_config needs runner='pooling'"),
        ({"runner": "pooling", "preemption_mode": "swap"}, "keeps no KV"),
        (
            {
                "runner": "pooling",
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
            },
            "speculative_config does not apply",
        ),
    ],
)
def test_bad_pooling_engine_arguments_name_the_field(args, message):
    from pagedllm import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(**args)


@pytest.mark.slow
def test_default_model_embeddings_equal_transformers(hf_default_model):
    hf_model = hf_default_model
    llm = LLM(runner="pooling", max_num_batched_tokens=64, max_model_len=512)
    tokenizer = llm.get_tokenizer()
    texts = ["Hi", "Paged attention keeps keys and values in blocks. " * 12, "Paris"]
    outputs = llm.embed(texts, use_tqdm=False)
    references = [hf_pooled(hf_model, tokenizer.encode(t), "last", True) for t in texts]
    assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(t) for t in texts]
    assert max_difference(outputs, references) < TOLERANCE
    assert_no_kv_kept(llm)
