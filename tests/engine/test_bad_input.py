"""Bad input gets a ValueError that names the field; nothing is left queued after it."""

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import parse_memory_size
from pagedllm.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=64)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_edge_values_are_accepted():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=0.0, max_tokens=1)
    SamplingParams(top_k=1, top_p=1e-6, min_p=1.0)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt: empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt: empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)


def test_prompt_longer_than_max_model_len(llm):
    match = r"prompt: 65 input tokens is more than the context window of max_model_len=64"
    with pytest.raises(ValueError, match=match):
        llm.generate({"prompt_token_ids": [5] * 65}, use_tqdm=False)


def test_out_of_vocabulary_token_id(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [1, 10_000]}, use_tqdm=False)


def test_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_wrong_number_of_sampling_params(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)


def test_unknown_engine_argument(tiny_llama):
    with pytest.raises(ValueError, match=r"unknown engine argument.*max_num_seq\b"):
        LLM(str(tiny_llama), max_num_seq=4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_model_len": 5000}, "max_model_len"),
        ({"dtype": "float64"}, "dtype"),
        ({"block_size": 0}, "block_size"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
        ({"kv_cache_memory": "10KiB"}, "kv_cache_memory"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"attention_backend": "flash"}, "attention_backend"),
    ],
)
def test_bad_engine_arguments(tiny_llama, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_llama), **kwargs)


def test_memory_sizes_parse():
    assert parse_memory_size("4GiB") == 4 * 1024**3
    assert parse_memory_size("512MiB") == 512 * 1024**2
    assert parse_memory_size("2G") == 2 * 10**9
    assert parse_memory_size("1.5 KiB") == 1536
    assert parse_memory_size(1000) == 1000


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "n_layer": 1,
            }
        )
    )
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        LLM(str(tmp_path))


def test_corrupt_files(tmp_path, tiny_llama):
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a valid GGUF"):
        LLM(str(bad_gguf))
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny_llama.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(broken))
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json"):
        LLM(str(broken))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"], "detokenize": False}, "detokenize"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**64 - 2, "n": 3}, "seed"),  # completion 2 would be seeded 2**64
    ],
)
def test_bad_output_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_out_of_vocabulary_bias_is_refused(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("a", SamplingParams(logit_bias={10_000: 1.0}), use_tqdm=False)


def test_out_of_vocabulary_stop_token_is_refused_and_the_engine_goes_on(llm):
    vocab_size = llm.llm_engine.model_config.vocab_size
    # With min_tokens the stop id indexes the logits: once an IndexError inside a step.
    bad = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[vocab_size])
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("a", bad, use_tqdm=False)
    top_seed = SamplingParams(n=2, seed=2**64 - 2, max_tokens=2, temperature=1.0)
    (output,) = llm.generate("a", top_seed, use_tqdm=False)
    assert [len(c.token_ids) for c in output.outputs] == [2, 2]


# ---- validation at the edge: ints within int64, finite floats, valid Unicode, bounded specs --
HUGE = 2**70  # wider than any engine integer


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"logit_bias": {HUGE: 1.0}}, "logit_bias"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"n": HUGE}, "n"),
        ({"top_k": HUGE}, "top_k"),
        ({"max_tokens": HUGE}, "max_tokens"),
        ({"min_tokens": -HUGE}, "min_tokens"),
        ({"logprobs": HUGE}, "logprobs"),
        ({"prompt_logprobs": HUGE}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": HUGE}, "truncate_prompt_tokens"),
        ({"stop_token_ids": [HUGE]}, "stop_token_ids"),
        ({"allowed_token_ids": [HUGE]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1.5]}, "allowed_token_ids"),
        ({"seed": HUGE}, "seed"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop": ["a\ud800"]}, "stop"),
        ({"bad_words": ["\udc00"]}, "bad_words"),
    ],
)
def test_values_beyond_the_engines_types_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_checked_values_are_stored_as_plain_numbers():
    import numpy as np

    params = SamplingParams(n=np.int64(2), max_tokens=np.int32(5), temperature=np.float32(0.5))
    assert (type(params.n), type(params.max_tokens), type(params.temperature)) == (
        int,
        int,
        float,
    )
    assert SamplingParams(top_k=2**63 - 1).top_k == 2**63 - 1  # int64's top is fine


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"regex": "a\ud800"}, "regex"),
        ({"grammar": 'root ::= "\udfff"'}, "grammar"),
        ({"choice": ["ok", "\ud800"]}, "choice"),
        ({"json": '{"type": "string", "title": "\ud800"}'}, "json"),
        ({"json": ["not", "a", "schema"]}, "json"),
        ({"choice": "yes"}, "choice"),
    ],
)
def test_structured_output_text_must_be_valid(spec, field):
    with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
        StructuredOutputsParams(**spec)


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # ~120 levels was a RecursionError inside jsonschema's checks.
        (StructuredOutputsParams(json=nested_schema(120)), "nested more than 64 levels"),
        (StructuredOutputsParams(json=json.dumps(nested_schema(120))), "nested more than 64"),
        # Under the size limit, but json.loads would recurse past Python's limit.
        (StructuredOutputsParams(json="[" * 30_000 + "]" * 30_000), "nested more than 64"),
        (StructuredOutputsParams(json={"type": "number", "maximum": float("nan")}), "finite"),
        (StructuredOutputsParams(json={"type": "integer", "maximum": HUGE}), "64-bit"),
        (StructuredOutputsParams(json={"enum": ["x" * 70_000]}), "at most 65536"),
        (StructuredOutputsParams(regex="a" * 70_000), "at most 65536"),
        (StructuredOutputsParams(grammar='root ::= "' + "a" * 70_000 + '"'), "at most 65536"),
        (StructuredOutputsParams(choice=["c" * 1000] * 70), "at most 65536"),
        (StructuredOutputsParams(regex="(" * 5000 + "a" + ")" * 5000), "invalid regex"),
    ],
)
def test_oversized_specs_are_refused_and_the_engine_goes_on(llm, spec, message):
    params = SamplingParams(max_tokens=2, structured_outputs=spec)
    with pytest.raises(ValueError, match=message) as raised:
        llm.generate("a", params, use_tqdm=False)
    assert "structured_outputs" in str(raised.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_specs_at_the_limits_are_accepted():
    from pagedllm.structured_output.validation import (
        MAX_SCHEMA_DEPTH,
        validate_structured_outputs,
    )
    from pagedllm.value_checks import check_json_value

    schema = nested_schema(MAX_SCHEMA_DEPTH // 2 - 1)
    assert check_json_value(schema, 10**6) <= MAX_SCHEMA_DEPTH
    validate_structured_outputs(StructuredOutputsParams(json=schema), "structured_outputs")
    arrays: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        arrays = {"type": "array", "items": arrays}
    validate_structured_outputs(StructuredOutputsParams(json=arrays), "structured_outputs")


def test_bad_prompts_and_priorities_are_refused_and_the_engine_goes_on(llm):
    vocab_size = llm.llm_engine.model_config.vocab_size
    bad = [
        ("a\ud800b", "prompt"),  # tokenizers raise TypeError on a lone surrogate
        ({"prompt_token_ids": [1, HUGE]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, vocab_size]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -1]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 2.0]}, "prompt_token_ids"),
        ({"prompt_token_ids": "12"}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 2], "cache_salt": "\ud800"}, "cache_salt"),
        ({"prompt_token_ids": [1, 2], "prompt": "\udc00"}, "prompt"),
    ]
    for prompt, field in bad:
        with pytest.raises(ValueError, match=field):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    for name in ("allowed_token_ids", "stop_token_ids"):
        with pytest.raises(ValueError, match=name):
            llm.generate("a", SamplingParams(**{name: [vocab_size]}), use_tqdm=False)
    with pytest.raises(ValueError, match="priority"):
        llm.generate("a", SamplingParams(max_tokens=2), use_tqdm=False, priority=[HUGE])
    assert not llm.llm_engine.has_unfinished_requests()
    (output,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3))
    assert len(output.outputs[0].token_ids) == 3


def test_request_ids_cannot_collide_with_forked_samples(llm):
    engine = llm.llm_engine
    for request_id in ("a#1", "", 7):
        with pytest.raises(ValueError, match="request_id"):
            engine.add_request(request_id, "a", SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()
