"""benchmarks.random_gguf: a tiny random-weight file has llama.cpp's tensor types, weights with
a trained model's spread, the size its tensors add up to, the right config and SmolLM2's
tokenizer, and pagedllm runs it."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from benchmarks import random_gguf
from benchmarks.random_gguf import FILE_TYPES, TINY
from pagedllm.model.gguf.reader import open_gguf
from pagedllm.model.gguf.tensor_table import read_gguf_tensors
from pagedllm.model.gguf_loader import load_gguf_config, load_gguf_tokenizer

SMOLLM2_VOCAB = 49152


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("random_gguf")
    files = {}
    for name in ("Q4_K_M", "Q8_0"):
        files[name] = directory / f"tiny-{name}.gguf"
        random_gguf.write_random_gguf(files[name], TINY, FILE_TYPES[name], seed=0)
    return files


@pytest.fixture(scope="module")
def tables(tiny_files) -> dict[str, tuple[list, dict]]:
    # The tensor table alone: a full GGUFReader parse of the 49k-token metadata costs
    # seconds per file.
    return {name: read_gguf_tensors(str(path)) for name, path in tiny_files.items()}


def expected_type(name: str, file_type: str) -> Q:
    if not name.endswith(".weight") or "norm" in name or name == "rope_freqs.weight":
        return Q.F32
    if file_type == "Q8_0":
        return Q.Q8_0
    # Q4_K_M: of two layers use_more_bits picks only the last (i >= 7n/8).
    if name in ("output.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight"):
        return Q.Q6_K
    return Q.Q4_K


def test_use_more_bits_matches_llama_cpp():
    picked = [i for i in range(16) if random_gguf.use_more_bits(i, 16)]
    assert picked == [0, 1, 4, 7, 10, 13, 14, 15]


def test_tied_embedding_takes_the_output_type():
    types = {
        spec.name: spec.qtype
        for spec in random_gguf.tensor_plan(random_gguf.LLAMA_3_2_1B, FILE_TYPES["Q4_K_M"])
    }
    assert "output.weight" not in types
    assert types["token_embd.weight"] == Q.Q6_K  # llama.cpp quantizes it as the output
    assert types["blk.2.attn_q.weight"] == Q.Q4_K


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q8_0"])
def test_tensors_have_the_rule_types_and_a_trained_spread(tables, file_type):
    table, metadata = tables[file_type]
    assert metadata["general.file_type"] == FILE_TYPES[file_type]
    tensors = {tensor.name: tensor for tensor in table}
    assert len(tensors) == 2 + 9 * TINY.num_layers + 2  # rope, embedding, blocks, norm, head
    for name, tensor in tensors.items():
        assert tensor.tensor_type == expected_type(name, file_type), name
        if tensor.tensor_type == Q.F32:
            continue
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        rows = TINY.vocab_size if name in ("token_embd.weight", "output.weight") else None
        assert rows is None or weights.shape == (rows, TINY.hidden_size), name
        assert np.isfinite(weights).all(), name
        assert 0.017 < weights.std() < 0.023, (name, weights.std())
        assert abs(weights.mean()) < 0.002, (name, weights.mean())


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q8_0"])
def test_file_is_header_plus_tensor_bytes(tiny_files, tables, file_type):
    table, _ = tables[file_type]
    plan = random_gguf.tensor_plan(TINY, FILE_TYPES[file_type])
    assert [(t.name, t.data.nbytes) for t in table] == [(s.name, s.nbytes) for s in plan]
    size, data_start = os.path.getsize(tiny_files[file_type]), table[0].data_offset
    assert size == random_gguf.file_size(data_start, plan)
    assert size - data_start - sum(s.nbytes for s in plan) < 32 * len(plan)  # padding


def test_same_seed_same_bytes(tiny_files, tmp_path):
    again = tmp_path / "again.gguf"
    random_gguf.write_random_gguf(again, TINY, FILE_TYPES["Q8_0"], seed=0)
    assert again.read_bytes() == tiny_files["Q8_0"].read_bytes()


@pytest.mark.slow  # long (~9 s on two busy cores)
def test_config_and_tokenizer_load_in_pagedllm(tiny_files):
    # The file is new, so this converts it (into the default cache, where the LLM below finds
    # it: another cache directory would rebuild pagedllm's CPU extension too).
    path = str(tiny_files["Q8_0"])
    config = load_gguf_config(path)
    assert (config.hidden_size, config.intermediate_size) == (256, 512)
    assert (config.num_hidden_layers, config.num_attention_heads) == (2, 4)
    assert (config.num_key_value_heads, config.vocab_size) == (2, TINY.vocab_size)
    assert not config.tie_word_embeddings
    assert config.rope_parameters["rope_type"] == "llama3"

    reader = open_gguf(path)  # the loader's own parse, shared with the tokenizer below
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    token_types = reader.get_field("tokenizer.ggml.token_type").contents()
    assert len(tokens) == len(token_types) == TINY.vocab_size
    assert tokens[-1] == f"<|reserved_{TINY.vocab_size - SMOLLM2_VOCAB - 1}|>"
    assert set(token_types[SMOLLM2_VOCAB:]) == {gguf.TokenType.UNUSED}

    tokenizer = load_gguf_tokenizer(path)
    assert len(tokenizer) == TINY.vocab_size
    ids = tokenizer("Hello world, how are you?").input_ids
    assert 1 < len(ids) < 10 and max(ids) < SMOLLM2_VOCAB  # BPE pieces, not bytes or fillers
    assert tokenizer.decode(ids) == "Hello world, how are you?"
    assert "<|im_start|>" in tokenizer.chat_template


def test_pagedllm_generates_from_the_file(tiny_files):
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=str(tiny_files["Q8_0"]), max_model_len=256)
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
    assert len(outputs[0].outputs[0].token_ids) == 4
