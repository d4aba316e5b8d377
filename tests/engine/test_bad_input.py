"""Bad input gets a ValueError that names the field; nothing is left queued after it."""

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import parse_memory_size


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
