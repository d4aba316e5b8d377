"""Gemma 3 (text) on tiny random models: its RMSNorm is Transformers' bit for bit, configs it
cannot compute are refused, and greedy tokens equal Transformers' with trained-like norm
weights (not the zero offsets a fresh model has) from safetensors (a prefix longer than the
window served from the prefix cache, in chunks of an odd block size) and from a GGUF file
written as llama.cpp writes one (norms stored plus one, Gemma's tensor names, the layer
pattern and both RoPEs in the metadata); the file's blocks kept (quantization="gguf") give
the fp32 engine's tokens."""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import add_tensor, finish, stored_names
from model_utils import (
    TINY_CONFIGS,
    compare_greedy,
    compare_to_reference_engine,
    greedy_with_logprobs,
    hf_greedy,
    make_tiny_model,
    model_runner,
)
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.gguf_files import add_model_shape
from pagedllm import LLM, SamplingParams
from pagedllm.model.gguf_loader import iter_gguf_weights, load_gguf_config
from pagedllm.model.layers.gemma_norm import GemmaRMSNorm
from pagedllm.model.layers.gguf_embedding import GGUFEmbedding
from pagedllm.model.models.gemma3 import check_gemma3_config, layer_rope_parameters
from pagedllm.ops.kernel_selection import KernelSelection

ARCHITECTURE = "Gemma3ForCausalLM"
WINDOW = TINY_CONFIGS[ARCHITECTURE]["sliding_window"]
HEAD_DIM = TINY_CONFIGS[ARCHITECTURE]["head_dim"]
TIE_TOLERANCE = 1e-4
MAX_NEW_TOKENS = 24
HEAD_SHARPENING = 20.0  # make_tiny_model's factor on the head
# Transformers' logprobs against the engine's: fp32 sums in other orders differ by ~1e-6.
LOGPROB_TOLERANCE = 2e-5
# A local RoPE base unlike the default, so a file whose base is not read gives other tokens;
# llama.cpp scales scores by head_dim ** -0.5 (a GGUF file has no query_pre_attn_scalar).
OVERRIDES = dict(
    query_pre_attn_scalar=HEAD_DIM,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
    },
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(directory, Transformers' model): a tiny Gemma 3 with its head tied to the embedding
    and random norm weights. The head is sharpened by the final norm, not by scaling the
    shared matrix: a large embedding would dominate the residual stream, and the tokens
    would no longer depend on attention (its window, its RoPE) at all."""
    directory = make_tiny_model(
        ARCHITECTURE, tmp_path_factory.mktemp("gemma3"), tie_word_embeddings=True, **OVERRIDES
    )
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.model.embed_tokens.weight.div_(HEAD_SHARPENING)  # make_tiny_model's
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        model.model.norm.weight.add_(HEAD_SHARPENING - 1)
    model.save_pretrained(directory)
    return directory, model.eval()


def _write_metadata(writer: gguf.GGUFWriter, config) -> None:
    """The keys llama.cpp's converter writes for Gemma 3, and the optional ones it reads."""
    add_model_shape(writer, config, "tiny gemma 3")
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    full, local = (config.rope_parameters[k] for k in ("full_attention", "sliding_attention"))
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base_swa(local["rope_theta"])
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_tokenizer_model("llama")
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)


def write_gemma3_gguf(path, model, matrix_type: Q) -> str:
    """`model` as llama.cpp's converter writes it: a tied head dropped, norms plus one."""
    writer = gguf.GGUFWriter(str(path), "gemma3")
    _write_metadata(writer, model.config)
    names = stored_names(model, "gemma3")
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            array = array + 1.0
        (gguf_name,) = names[name]
        add_tensor(writer, gguf_name, array, matrix_type if array.ndim == 2 else Q.F32)
    finish(writer)
    return str(path)


@pytest.fixture(scope="module")
def gemma_gguf(gemma, tmp_path_factory) -> str:
    """The tiny model in an fp32 GGUF file: exactly its weights, up to the norms' +1 - 1."""
    return write_gemma3_gguf(tmp_path_factory.mktemp("gemma3-gguf") / "f32.gguf", gemma[1], Q.F32)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _compare(llm, hf_model, prompts, report_ties) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ties = sum(
        compare_greedy(
            o.outputs[0].token_ids, hf_greedy(hf_model, p, MAX_NEW_TOKENS), TIE_TOLERANCE
        )
        for o, p in zip(outputs, prompts, strict=True)
    )
    report_ties(ties, len(prompts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_is_transformers_bit_for_bit(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, generator=generator)
    theirs = Gemma3RMSNorm(64, eps=1e-6)
    theirs.weight.data.copy_(weight)
    theirs.to(dtype)
    ours = GemmaRMSNorm(64, 1e-6, dtype)
    ours.weight.data.copy_(weight.to(dtype))
    x, residual = (torch.randn(5, 64, generator=generator).mul(3).to(dtype) for _ in range(2))
    assert torch.equal(ours(x)[0], theirs(x))
    normed, stream = ours(x, residual)
    assert torch.equal(stream, residual + x)
    assert torch.equal(normed, theirs(residual + x))


def test_fused_norm_follows_every_write_to_its_weight():
    """The fused kernel reads the weight at every call (adding its one as it reads): a weight
    written in place (as loading does) or replaced (as moving it to huge pages does) is seen
    at once."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    generator = torch.Generator().manual_seed(1)
    kernels = KernelSelection(attention="cpu", fused_ops=True, sampler_draw=False)
    ours = GemmaRMSNorm(64, 1e-6, torch.float32, kernels)
    theirs = Gemma3RMSNorm(64, eps=1e-6)
    x = torch.randn(5, 64, generator=generator)
    # The kernel sums in another order than Transformers: equal to float32 rounding.
    assert torch.allclose(ours(x)[0], theirs(x), rtol=1e-6, atol=1e-6)  # the zero offset
    for write in ("in place", "replaced"):
        weight = torch.randn(64, generator=generator)
        with torch.no_grad():
            if write == "in place":
                ours.weight.copy_(weight)
            else:
                ours.weight.data = weight.clone()
            theirs.weight.copy_(weight)
        with torch.inference_mode():
            normed = ours(x)[0]
        assert torch.allclose(normed, theirs(x), rtol=1e-6, atol=1e-6), write


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0 is not supported.*None"),
        ("use_bidirectional_attention", True, "supported: causal attention"),
        ("hidden_activation", "gelu_python_tanh", "supported: gelu_pytorch_tanh"),
    ],
)
def test_what_it_cannot_compute_is_refused(field, value, message):
    config = AutoConfig.for_model("gemma3_text", **{field: value})
    with pytest.raises(ValueError, match=message):
        check_gemma3_config(config)


def test_an_attention_softcap_is_refused_at_load(tmp_path):
    directory = make_tiny_model(ARCHITECTURE, tmp_path, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        LLM(str(directory), max_model_len=64, kv_cache_memory="1MiB")


def test_rope_types_other_than_default_and_linear_are_refused():
    config = AutoConfig.for_model(
        "gemma3_text",
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    assert layer_rope_parameters(config, "sliding_attention")["rope_theta"] == 1e4
    with pytest.raises(ValueError, match=r"'yarn'.*supported: default, linear"):
        layer_rope_parameters(config, "full_attention")


@pytest.mark.slow  # long (~14 s on two busy cores)
def test_greedy_with_prefix_cache_hits_matches_transformers(gemma, report_ties):
    directory, hf_model = gemma
    # A shared prefix of several windows, then each its own tail; one unrelated prompt.
    prefix = _prompts(0, [3 * WINDOW + 5])[0]
    prompts = [prefix + tail for tail in _prompts(1, [1, 9, 30])] + _prompts(2, [100])
    llm = LLM(str(directory), max_model_len=256, block_size=7, max_num_batched_tokens=32)
    _compare(llm, hf_model, prompts[:1], report_ties)
    _compare(llm, hf_model, prompts[1:], report_ties)  # the prefix's blocks are cached
    assert llm.get_stats().prefix_cache_hits >= 3 * WINDOW


def test_logprobs_match_transformers(gemma):
    """Soft-capping never changes the argmax and GELU's tanh approximation hardly does;
    the logprobs show both."""
    directory, hf_model = gemma
    prompts = _prompts(5, [4, 60])
    llm = LLM(str(directory), max_model_len=128, block_size=7)
    for prompt, output in zip(prompts, greedy_with_logprobs(llm, prompts, 8), strict=True):
        sequence = torch.tensor([prompt + list(output.token_ids)])
        with torch.no_grad():
            logits = hf_model(sequence).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float(), dim=-1)
        for step, token in enumerate(output.token_ids):
            got = output.logprobs[step][token].logprob
            assert abs(got - float(expected[step, token])) < LOGPROB_TOLERANCE, step


def test_gguf_config_and_weights_are_the_checkpoints(gemma, gemma_gguf):
    _, hf_model = gemma
    config = load_gguf_config(gemma_gguf)
    assert config.architectures == [ARCHITECTURE]
    for field in ("layer_types", "sliding_window", "rope_parameters", "head_dim",
                  "query_pre_attn_scalar", "final_logit_softcapping", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "tie_word_embeddings"):  # fmt: skip
        assert getattr(config, field) == getattr(hf_model.config, field), field
    weights = dict(iter_gguf_weights(gemma_gguf, config))
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight":
            continue
        got = weights.pop(name)
        if name.endswith("norm.weight"):  # (w + 1) - 1 in fp32 rounds w to 2^-23
            torch.testing.assert_close(got, tensor, rtol=0, atol=2.5e-7)
        else:
            assert torch.equal(got, tensor), name
    assert not weights, sorted(weights)


@pytest.mark.parametrize(
    "num_layers, hidden_size, heads, expected_scalar",
    [(7, 64, 4, HEAD_DIM), (62, 96, 3, 32)],  # 62 layers: llama.cpp's 27B rule
)
def test_gguf_defaults_are_llama_cpps(tmp_path, num_layers, hidden_size, heads, expected_scalar):
    """Without a pattern or a local RoPE base in the file: every sixth layer global, the
    others at base 10000, as llama.cpp and Transformers assume."""
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "gemma3")
    for add, value in [
        (writer.add_context_length, 512), (writer.add_embedding_length, hidden_size),
        (writer.add_block_count, num_layers), (writer.add_feed_forward_length, 128),
        (writer.add_head_count, heads), (writer.add_head_count_kv, 1),
        (writer.add_key_length, HEAD_DIM), (writer.add_value_length, HEAD_DIM),
        (writer.add_sliding_window, 32), (writer.add_vocab_size, 300),
        (writer.add_rope_freq_base, 1e6), (writer.add_layer_norm_rms_eps, 1e-6),
    ]:  # fmt: skip
        add(value)
    finish(writer)
    config = load_gguf_config(str(tmp_path / "bare.gguf"))
    expected = AutoConfig.for_model("gemma3_text", num_hidden_layers=num_layers)
    assert config.layer_types == expected.layer_types
    assert config.rope_parameters == {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert config.query_pre_attn_scalar == expected_scalar
    assert config.sliding_window == 32 and config.final_logit_softcapping is None


def test_greedy_from_gguf_matches_transformers(gemma, gemma_gguf, report_ties):
    _, hf_model = gemma
    llm = LLM(
        gemma_gguf,
        skip_tokenizer_init=True,
        max_model_len=256,
        block_size=7,
        max_num_batched_tokens=32,
    )
    _compare(llm, hf_model, _prompts(3, [2, 30, 90]), report_ties)


def test_gguf_blocks_give_the_fp32_engines_tokens(gemma, tmp_path):
    """Q8_0 projections and a Q8_0 tied embedding, computed on their blocks: the embedding
    the model scales is then a GGUFEmbedding."""
    path = write_gemma3_gguf(tmp_path / "q8_0.gguf", gemma[1], Q.Q8_0)
    prompts = _prompts(4, [3, 40, 70])
    engines = [
        LLM(path, skip_tokenizer_init=True, max_model_len=128, quantization=q)
        for q in (None, "gguf")
    ]
    model = model_runner(engines[1]).model
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    fp32, quantized = (greedy_with_logprobs(llm, prompts, 16) for llm in engines)
    ties, largest = compare_to_reference_engine(fp32, quantized, 1e-3)
    print(f"ties: {ties}; largest logprob difference: {largest:.2e}")
    assert largest < 1e-3


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_matches_one_process(gemma):
    """Two ranks: half the heads each (one KV head), the vocabulary-parallel embedding the
    model scales and the head tied to it."""
    directory, _ = gemma
    prompts = _prompts(6, [5, 50])
    single, parallel = (
        greedy_with_logprobs(LLM(str(directory), max_model_len=128, **layout), prompts, 12)
        for layout in ({}, {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"})
    )
    ties, largest = compare_to_reference_engine(single, parallel, TIE_TOLERANCE)
    print(f"ties: {ties}; largest logprob difference: {largest:.2e}")
    assert largest < LOGPROB_TOLERANCE
