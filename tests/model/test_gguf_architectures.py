"""GGUF files of Qwen3, Phi-3 (with a window; with LongRoPE), Mixtral, Qwen3-MoE and Mistral
(with a window), written as llama.cpp's converter writes them from tiny random Transformers
models: the config read back is the checkpoint's, every weight is Transformers' tensor bit for
bit (F32 files; experts stacked as Transformers holds them), and greedy tokens served from the
file equal Transformers' on the original model. A Q8_0 Qwen3 file gives the tokens (and the
dequantized weights) Transformers gives reading that same file; Q8_0 experts (Mixtral,
Qwen3-MoE) give Transformers' tokens on the weights they dequantize to; Phi-3's fused tensors
and Mixtral's and Qwen3-MoE's experts compute on the file's blocks under quantization="gguf"
(in about the file's expert bytes, with the fp32 engine's tokens). Files of architectures the engine
does not serve, or that lost what it needs, are refused, naming what is supported."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import (
    converted_writer,
    finish,
    write_converted_gguf,
    write_converted_tensors,
)
from model_utils import (
    assert_bit_equal_to_reference,
    compare_greedy,
    compare_to_reference_engine,
    greedy_with_logprobs,
    hf_greedy,
    make_tiny_model,
    model_runner,
)
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.model.gguf.tensor_table import read_gguf_tensors
from pagedllm.model.gguf_loader import iter_gguf_weights, load_gguf_config
from pagedllm.model.layers.fused_moe import FusedMoE
from pagedllm.model.layers.gguf_experts import GGUFGroupedExperts
from pagedllm.model.layers.gguf_linear import GGUFMergedLinear

TIE_TOLERANCE = 1e-4
MAX_NEW_TOKENS = 16
# Every prompt longer than the windows and than LongRoPE's original context (32), so that
# Transformers, which picks LongRoPE's factors per call, uses the long ones throughout, as
# the engine does (its max_model_len is above 32).
PROMPT_LENGTHS = (33, 60, 100)
WINDOW = 24
LONGROPE = dict(
    partial_rotary_factor=0.75,  # Phi-4-mini's share: 12 of 16 dimensions rotate
    original_max_position_embeddings=32,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 4.0],
        "long_factor": [2.0, 3.0, 4.5, 6.0, 8.0, 12.0],
    },
)
# What the engine builds its network from (head_dim: Phi-3's is hidden_size / heads).
CONFIG_FIELDS = (
    "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
    "max_position_embeddings", "original_max_position_embeddings", "partial_rotary_factor",
    "sliding_window", "use_sliding_window", "layer_types", "tie_word_embeddings",
    "attention_bias", "intermediate_size", "num_local_experts", "num_experts_per_tok",
    "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step",
)  # fmt: skip


@dataclass(frozen=True)
class Variant:
    architecture: str  # Transformers' class
    gguf_arch: str  # llama.cpp's architecture name
    overrides: dict = field(default_factory=dict)
    name: str = "tiny"  # general.name: llama.cpp tells Mistral from Llama by it
    # llama.cpp's converter writes no window for a llama file; this one records it.
    record_window: bool = False


VARIANTS = {
    "qwen3": Variant("Qwen3ForCausalLM", "qwen3"),
    "phi3-window": Variant("Phi3ForCausalLM", "phi3", {"sliding_window": WINDOW}),
    "phi3-longrope": Variant("Phi3ForCausalLM", "phi3", LONGROPE),
    "mixtral": Variant("MixtralForCausalLM", "llama", name="Mixtral-tiny"),
    "qwen3-moe": Variant("Qwen3MoeForCausalLM", "qwen3moe"),
    "mistral-window": Variant(
        "MistralForCausalLM", "llama", {"sliding_window": WINDOW}, "Mistral-7B-v0.1", True
    ),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """variant -> (Transformers' model, path of its F32 GGUF file), each built once."""
    built: dict[str, tuple[torch.nn.Module, str]] = {}

    def build(key: str) -> tuple[torch.nn.Module, str]:
        if key not in built:
            variant = VARIANTS[key]
            directory = tmp_path_factory.mktemp(key)
            make_tiny_model(variant.architecture, directory, **variant.overrides)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            built[key] = model, _write(directory / f"{key}.gguf", model, variant)
        return built[key]

    return build


def _write(path: Path, model: torch.nn.Module, variant: Variant) -> str:
    writer = converted_writer(path, model, variant.gguf_arch, variant.name)
    if variant.record_window:
        writer.add_sliding_window(model.config.sliding_window)
    write_converted_tensors(writer, model, variant.gguf_arch)
    finish(writer)
    return str(path)


def _field(config, name: str):
    if name == "head_dim" and getattr(config, "head_dim", None) is None:
        return config.hidden_size // config.num_attention_heads
    return getattr(config, name, None)


def _prompts(seed: str) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


def _greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(
        path,
        skip_tokenizer_init=True,
        max_model_len=256,
        block_size=7,
        max_num_batched_tokens=32,  # chunked prefill
        kv_cache_memory="8MiB",
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _compare(tokens: list[list[int]], hf_model, prompts, report_ties) -> None:
    ties = sum(
        compare_greedy(got, hf_greedy(hf_model, prompt, MAX_NEW_TOKENS), TIE_TOLERANCE)
        for got, prompt in zip(tokens, prompts, strict=True)
    )
    report_ties(ties, len(prompts))


# --------------------------------------------------------------------------- F32 files


@pytest.mark.parametrize("key", list(VARIANTS))
def test_config_and_weights_are_the_checkpoints(converted, key):
    model, path = converted(key)
    config = load_gguf_config(path)
    for name in CONFIG_FIELDS:
        assert _field(config, name) == _field(model.config, name), name
    weights = dict(iter_gguf_weights(path, config))
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("key", list(VARIANTS))
def test_greedy_from_gguf_matches_transformers(converted, key, report_ties):
    model, path = converted(key)
    prompts = _prompts(key)
    _compare(_greedy(path, prompts), model, prompts, report_ties)


@pytest.mark.parametrize(
    "key, name, value",
    [
        ("mistral-window", "sliding_window", None),
        ("phi3-window", "sliding_window", None),
        ("phi3-longrope", "rope_parameters", {**LONGROPE["rope_parameters"], "long_factor":
                                              LONGROPE["rope_parameters"]["short_factor"]}),
    ],
)  # fmt: skip
def test_the_comparison_tells_a_misread_window_or_factor_set(converted, key, name, value):
    """Without its window, or with the short factors for the long, the model gives other
    tokens on the greedy test's prompts: that test checks what the file said."""
    model, _ = converted(key)
    config = copy.deepcopy(model.config)
    if name == "rope_parameters":
        value = {**config.rope_parameters, **value}
    setattr(config, name, value)
    other = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    other.load_state_dict(model.state_dict())
    prompts = _prompts(key)
    assert [hf_greedy(other, p, MAX_NEW_TOKENS).token_ids for p in prompts] != [
        hf_greedy(model, p, MAX_NEW_TOKENS).token_ids for p in prompts
    ]


# --------------------------------------------------------------------------- a quantized file


def test_q8_0_file_matches_transformers_reading_it(tmp_path, report_ties):
    """Transformers' own GGUF loader reads Qwen3 files (its config mapping has no head_dim
    key for them: the tiny model has Qwen3's default, 128). Its dequantized weights and config
    are ours, and so are the greedy tokens."""
    directory = make_tiny_model("Qwen3ForCausalLM", tmp_path, head_dim=128)
    original = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    path = write_converted_gguf(tmp_path / "q8_0.gguf", original, "qwen3", Q.Q8_0)
    theirs = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="q8_0.gguf", dtype=torch.float32
    ).eval()
    config = load_gguf_config(path)
    for name in CONFIG_FIELDS[1:]:  # Transformers' GGUF configs name no architectures
        if name == "rms_norm_eps":  # Transformers keeps the stored float32, we its decimal
            assert config.rms_norm_eps == pytest.approx(theirs.config.rms_norm_eps, rel=1e-7)
        else:
            assert _field(config, name) == _field(theirs.config, name), name
    weights = dict(iter_gguf_weights(path, config))
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[q_proj], original.state_dict()[q_proj])  # quantized
    prompts = _prompts("q8_0")
    _compare(_greedy(path, prompts), theirs, prompts, report_ties)


@pytest.mark.slow  # long (8-10 s each on two busy cores)
@pytest.mark.parametrize("key", ["mixtral", "qwen3-moe"])
def test_quantized_experts_give_transformers_tokens_on_the_dequantized_weights(
    converted, key, tmp_path, report_ties
):
    """Q8_0 experts (Transformers' GGUF loader reads neither Mixtral files, which it takes for
    Llama, nor Qwen3-MoE's expert width and dense layers): Transformers on the weights the
    file dequantizes to gives the engine's greedy tokens."""
    model, _ = converted(key)
    path = write_converted_gguf(
        tmp_path / f"{key}-q8_0.gguf", model, VARIANTS[key].gguf_arch, Q.Q8_0
    )
    dequantized = copy.deepcopy(model)
    dequantized.load_state_dict(dict(iter_gguf_weights(path)))
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(dequantized.state_dict()[experts], model.state_dict()[experts])
    prompts = _prompts(f"{key}-q8_0")
    _compare(_greedy(path, prompts), dequantized, prompts, report_ties)


def test_phi3_fused_tensors_compute_on_the_files_blocks(converted, tmp_path):
    """quantization="gguf": Phi-3's fused q/k/v and gate/up tensors come as their
    projections' row ranges of Q8_0 blocks, so those layers compute on the file's blocks too,
    with the fp32 engine's tokens."""
    model, _ = converted("phi3-window")
    path = write_converted_gguf(tmp_path / "phi3-q8_0.gguf", model, "phi3", Q.Q8_0)
    engines = [
        LLM(path, skip_tokenizer_init=True, max_model_len=128, kv_cache_memory="8MiB",
            quantization=quantization)
        for quantization in (None, "gguf")
    ]  # fmt: skip
    layer = model_runner(engines[1]).model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, GGUFMergedLinear)
    assert isinstance(layer.mlp.gate_up_proj, GGUFMergedLinear)
    prompts = _prompts("phi3-q8_0")
    fp32, blocks = (greedy_with_logprobs(llm, prompts, MAX_NEW_TOKENS) for llm in engines)
    ties, largest = compare_to_reference_engine(fp32, blocks, 1e-3)
    print(f"ties: {ties}; largest logprob difference: {largest:.2e}")
    assert largest < 1e-3


@pytest.mark.parametrize(("key", "qtype"), [("mixtral", Q.Q8_0), ("qwen3-moe", Q.Q4_0)])
def test_experts_compute_on_the_files_blocks(
    converted, key, qtype, tmp_path, monkeypatch, report_ties
):
    """quantization="gguf": each expert's gate/up and down compute on its slice of the file's
    stacked blocks, holding about the file's expert bytes, with the tokens (and, within the
    kernels' activation quantization, the logprobs) of the engine that dequantizes them; its
    decode steps, compiled by default, give the eager engine's bits."""
    model, _ = converted(key)
    path = write_converted_gguf(tmp_path / f"{key}.gguf", model, VARIANTS[key].gguf_arch, qtype)
    engines = [
        LLM(path, skip_tokenizer_init=True, max_model_len=128, kv_cache_memory="8MiB",
            quantization=quantization)
        for quantization in (None, "gguf")
    ]  # fmt: skip
    layers = model_runner(engines[1]).model.model.layers
    blocks = [(i, layer.mlp) for i, layer in enumerate(layers) if isinstance(layer.mlp, FusedMoE)]
    assert blocks
    tensors, _ = read_gguf_tensors(path)
    for index, block in blocks:
        assert isinstance(block.experts, GGUFGroupedExperts)
        file_bytes = sum(
            t.data.nbytes for t in tensors if t.name.startswith(f"blk.{index}.ffn_")
            and t.name.endswith("_exps.weight")
        )  # fmt: skip
        # The kernel keeps each block's fp16 scale as fp32: Q4_0 5 bits a weight to the
        # file's 4.5, Q8_0 9 (q + 128, no min table) to 8.5.
        assert file_bytes <= block.experts.weight_bytes() <= 1.12 * file_bytes
    prompts = _prompts(f"{key}-experts")
    fp32, on_blocks = (greedy_with_logprobs(llm, prompts, MAX_NEW_TOKENS) for llm in engines)
    ties, largest = compare_to_reference_engine(fp32, on_blocks, 1e-3)
    print(f"ties: {ties}; largest logprob difference: {largest:.2e}")
    assert largest < 1e-3
    monkeypatch.delenv("PAGEDLLM_COMPILE")  # the suite's: the engine's own choice here
    compiled = LLM(path, skip_tokenizer_init=True, max_model_len=128, kv_cache_memory="8MiB",
                   quantization="gguf")  # fmt: skip
    assert model_runner(compiled).compiled_decode is not None
    got = greedy_with_logprobs(compiled, prompts, MAX_NEW_TOKENS)
    assert_bit_equal_to_reference(on_blocks, got, report_ties)


# --------------------------------------------------------------------------- refused files


def _bare_file(path: Path, arch: str, keys: dict, tensors: dict[str, np.ndarray]) -> str:
    """A file of `arch` with a tiny model's hyper-parameters, `keys` ({key after the
    architecture: value}) and `tensors`."""
    writer = gguf.GGUFWriter(str(path), arch)
    base = {
        "context_length": 256, "embedding_length": 64, "block_count": 1,
        "feed_forward_length": 96, "attention.head_count": 4, "attention.head_count_kv": 2,
        "vocab_size": 512,
    }  # fmt: skip
    adders = {str: writer.add_string, bool: writer.add_bool, float: writer.add_float32}
    for key, value in {**base, **keys}.items():
        adders.get(type(value), writer.add_uint32)(f"{arch}.{key}", value)
    for name, array in tensors.items():
        writer.add_tensor(name, array.astype(np.float32))
    finish(writer)
    return str(path)


@pytest.mark.parametrize("arch", ["qwen2moe", "phi2", "gpt2"])
def test_other_architectures_are_refused_naming_the_supported(tmp_path, arch):
    path = _bare_file(tmp_path / f"{arch}.gguf", arch, {}, {})
    message = rf"unsupported GGUF architecture '{arch}'; supported: gemma3, llama .*qwen3moe"
    with pytest.raises(ValueError, match=message):
        load_gguf_config(path)
    with pytest.raises(ValueError, match=message):
        LLM(path, skip_tokenizer_init=True, max_model_len=64, kv_cache_memory="1MiB")


FACTORS = np.ones(8)  # one per frequency of a 16-dimension head
MOE = {"expert_count": 4, "expert_used_count": 2}


@pytest.mark.parametrize(
    "arch, keys, tensors, message",
    [
        # Without the original context, which factor set serves which lengths is unknown.
        ("phi3", {}, {"rope_factors_long.weight": FACTORS, "rope_factors_short.weight": FACTORS},
         "without phi3.rope.scaling.original_context_length"),
        ("phi3", {"rope.scaling.original_context_length": 32},
         {"rope_factors_long.weight": FACTORS}, "needs both"),
        ("phi3", {"rope.scaling.original_context_length": 32, "rope.dimension_count": 12},
         {"rope_factors_long.weight": FACTORS, "rope_factors_short.weight": FACTORS},
         "12 rotated dimensions per head need 6 of each"),
        ("phi3", {"rope.scaling.type": "longrope", "rope.scaling.original_context_length": 32},
         {}, "without rope_factors_long/short"),
        # A 128k Phi-3 converted before llama.cpp kept LongRoPE's factors.
        ("phi3", {"rope.scaling.original_context_length": 32}, {}, "the conversion lost them"),
        ("qwen3", {"rope.scaling.type": "longrope"}, {}, "phi3 files only"),
        ("qwen3moe", {"expert_used_count": 2}, {}, "missing .* 'qwen3moe.expert_count'"),
    ],
)  # fmt: skip
def test_configs_that_lost_what_the_engine_needs_are_refused(
    tmp_path, arch, keys, tensors, message
):
    path = _bare_file(tmp_path / "lossy.gguf", arch, keys, tensors)
    with pytest.raises(ValueError, match=message):
        load_gguf_config(path)


def test_half_of_a_stacked_expert_tensor_is_refused(tmp_path):
    experts = np.zeros((4, 32, 64))
    path = _bare_file(
        tmp_path / "half.gguf",
        "qwen3moe",
        MOE,
        {"blk.0.ffn_gate_inp.weight": np.zeros((4, 64)),  # a router: the layer is a mixture
         "blk.0.ffn_gate_exps.weight": experts, "blk.0.ffn_down_exps.weight": experts},
    )  # fmt: skip
    needs = r"gate_up_proj needs \('blk\.0\.ffn_gate_exps\.weight', 'blk\.0\.ffn_up_exps\.weight'\)"
    with pytest.raises(ValueError, match=needs):
        iter_gguf_weights(path, load_gguf_config(path))


def test_keys_the_converters_leave_out_have_llama_cpps_meaning(tmp_path):
    """Qwen3-MoE without expert_feed_forward_length: the experts' width from their tensors;
    renormalized unless expert_weights_norm says not; a layer without a router is dense.
    Phi-3 with a LongRoPE scale other than the default: the file's."""
    moe = _bare_file(
        tmp_path / "moe.gguf",
        "qwen3moe",
        {**MOE, "block_count": 2},
        {"blk.0.ffn_gate_inp.weight": np.zeros((4, 64)),
         "blk.0.ffn_gate_exps.weight": np.zeros((4, 40, 64))},
    )  # fmt: skip
    config = load_gguf_config(moe)
    assert (config.moe_intermediate_size, config.intermediate_size) == (40, 96)
    assert config.norm_topk_prob is True and config.mlp_only_layers == [1]
    raw = _bare_file(tmp_path / "raw.gguf", "qwen3moe", {**MOE, "expert_weights_norm": False}, {})
    assert load_gguf_config(raw).norm_topk_prob is False
    phi3 = _bare_file(
        tmp_path / "phi3.gguf",
        "phi3",
        {"rope.scaling.original_context_length": 32, "rope.scaling.attn_factor": 1.25},
        {"rope_factors_long.weight": FACTORS * 2, "rope_factors_short.weight": FACTORS},
    )
    rope = load_gguf_config(phi3).rope_parameters
    assert rope["attention_factor"] == 1.25 and rope["long_factor"] == [2.0] * 8
