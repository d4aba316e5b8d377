"""Checkpoints stored quantized on every dense architecture pagedllm serves besides Llama:
Mistral, Qwen2 (q/k/v biases, made random here), Qwen3 (q/k norms), Gemma 3 (its head tied
to the embedding, which no format quantizes; sliding windows, soft-capped logits, q/k
norms) and Phi-3, whose checkpoints store q/k/v and gate/up fused and whose quantized
checkpoints quantize those fused modules as they are.

Each architecture is written in a rotation of the formats (tests/quantized_formats.py) so
that it gets at least two and each format is on at least two architectures: the engine's
greedy tokens are Transformers' on the dequantized model (with the 8-bit formats' activation
quantization), ties counted, every decoder projection runs on a quantized layer holding the
checkpoint's bytes within 10%, and no fp32 copy of a quantized weight is left. A fused
projection stored whole is split into its shards' rows, and over tensor-parallel ranks each
rank keeps its rows of each shard (one process, ranks built one after another). What cannot
be served (a quantized embedding, tied to Gemma 3's head) is refused naming the
architecture and the scheme.
"""

from __future__ import annotations

import pytest
import torch
from gptq_writer import QUANTIZED_LAYERS
from model_utils import compare_greedy, hf_greedy, make_tiny_model, model_runner
from quantized_formats import FORMATS, CheckpointFormat
from quantized_llama import SHAPE, once_per_scheme
from rank_columns import outlier_input, switch_rank
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.gguf_linear import GGUFConcatLinear
from pagedllm.model.layers.gptq_linear import GPTQLinear
from pagedllm.model.layers.parallel_linear import QKVParallelLinear
from pagedllm.model.layers.w8a8_linear import Int8W8A8Linear, TiledDequantLinear
from pagedllm.model.models.llama import fused_param_name
from pagedllm.runner.model_building import KEEP_PACKED_WEIGHTS

# Each architecture's formats: each format on at least two of them.
CASES = [
    ("MistralForCausalLM", "gptq-g128"),
    ("MistralForCausalLM", "fp8-block"),
    ("Qwen2ForCausalLM", "gptq-g32-act-order"),
    ("Qwen2ForCausalLM", "awq-g128"),
    ("Qwen3ForCausalLM", "awq-g128"),
    ("Qwen3ForCausalLM", "w4a16-g128"),
    ("Gemma3ForCausalLM", "w4a16-g128"),
    ("Gemma3ForCausalLM", "w8a8-int8"),
    # Phi-3's fused modules stored whole: every format's layout of the output axis.
    ("Phi3ForCausalLM", "gptq-g32-act-order"),
    ("Phi3ForCausalLM", "awq-g128"),
    ("Phi3ForCausalLM", "w4a16-g128"),
    ("Phi3ForCausalLM", "w8a8-int8"),
    ("Phi3ForCausalLM", "fp8-dynamic"),
    ("Phi3ForCausalLM", "fp8-block"),
]
TIE_TOLERANCE = 1e-4
MAX_NEW_TOKENS = 12
LAYER_CLASSES = (GPTQLinear, Int8W8A8Linear, TiledDequantLinear)  # quantized layers
# make_tiny_model's head sharpening (x20); Gemma 3's tied head takes it from its final norm.
HEAD_SHARPENING = 20.0


def _random_biases(directory) -> None:
    """Qwen2's q/k/v biases, initialised to zero: made random, so that a lost one shows."""
    state = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(6)
    for name in [n for n in state if n.endswith("_proj.bias")]:
        state[name] = torch.randn(state[name].shape, generator=generator)
    save_file(state, directory / "model.safetensors")


def _tied_gemma3(directory):
    """A Gemma 3 whose head is its embedding: the head is sharpened by the final norm (Gemma's
    x * (1 + w)), not by scaling the shared matrix, whose large rows would drown what the
    layers add to the residual stream (tests/model/test_gemma3.py does the same)."""
    from transformers import AutoModelForCausalLM

    make_tiny_model("Gemma3ForCausalLM", directory, tie_word_embeddings=True, **SHAPE)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.div_(HEAD_SHARPENING)
        model.model.norm.weight.add_(HEAD_SHARPENING - 1)
    model.save_pretrained(directory)


def _source(architecture: str, directory):
    if architecture == "Gemma3ForCausalLM":
        _tied_gemma3(directory)
    else:
        make_tiny_model(architecture, directory, **SHAPE)
    if architecture == "Qwen2ForCausalLM":
        _random_biases(directory)
    return directory


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """architecture -> its tiny fp32 model (inputs and outputs whole groups of 128)."""
    return once_per_scheme(
        lambda architecture: _source(architecture, tmp_path_factory.mktemp(architecture))
    )


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (5, 19, 33)]


def _transformers_greedy(dequantized, fmt: CheckpointFormat, prompts):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    fmt.add_activation_quantization(hf_model)
    return [hf_greedy(hf_model, prompt, MAX_NEW_TOKENS) for prompt in prompts]


def _check_layers(model, checkpoint_bytes: int, label: str) -> None:
    """Every decoder projection on a quantized layer holding the checkpoint's bytes within
    10%; the layers keep no 2-D fp32 weight; a tied head stays the (fp32) embedding."""
    for layer in model.model.own_layers():
        attention, mlp = layer.self_attn, layer.mlp
        for projection in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert isinstance(projection, (*LAYER_CLASSES, GGUFConcatLinear)), projection
    quantized = [m for m in model.modules() if isinstance(m, LAYER_CLASSES)]
    held = sum(layer.weight_bytes() for layer in quantized)
    ratio = held / checkpoint_bytes
    print(f"{label}: checkpoint {checkpoint_bytes} bytes, held {held} ({ratio:.3f}x)")
    assert 0.9 <= ratio <= 1.1
    assert all(p.dim() == 1 for n, p in model.named_parameters() if ".layers." in n)
    if model.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize(("architecture", "fmt_name"), CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_greedy_tokens_are_transformers_on_the_dequantized_model(
    source, tmp_path, architecture, fmt_name, report_ties
):
    fmt = FORMATS[fmt_name]
    quantized, dequantized = tmp_path / "quantized", tmp_path / "dequantized"
    checkpoint_bytes = fmt.write(source(architecture), quantized, dequantized)
    prompts = _prompts()
    references = _transformers_greedy(dequantized, fmt, prompts)
    llm = LLM(str(quantized), max_model_len=128, kv_cache_memory="8MiB")
    assert llm.llm_engine.model_config.quantization == fmt.method
    _check_layers(model_runner(llm).model, checkpoint_bytes, f"{architecture} {fmt}")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ties = sum(
        compare_greedy(out.outputs[0].token_ids, reference, TIE_TOLERANCE)
        for out, reference in zip(outputs, references, strict=True)
    )
    report_ties(ties, len(prompts))


def test_a_quantized_embedding_tied_to_the_head_is_refused_naming_the_architecture(
    source, tmp_path
):
    """No format quantizes Gemma 3's embedding (its head): a checkpoint that does is refused
    at start-up, naming the architecture, the scheme and the layer."""
    fmt = FORMATS["gptq-g128"]
    quantized, dequantized = tmp_path / "quantized", tmp_path / "dequantized"
    layers = (*QUANTIZED_LAYERS, "embed_tokens")
    fmt.write(source("Gemma3ForCausalLM"), quantized, dequantized, layers)
    with pytest.raises(
        ValueError, match=r"gptq \(gptq 4-bit group 128.*'model\.embed_tokens'.*Gemma3ForCausalLM"
    ):
        LLM(str(quantized), max_model_len=128, kv_cache_memory="8MiB")


# ---- a fused projection stored whole, over tensor-parallel ranks ---------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 32  # q 128 rows, k 64, v 64: v starts
# inside a 128-row FP8 block, and a rank's 64 q rows too
SHARD_OFFSETS = {"q": 0, "k": HEADS * HEAD_DIM, "v": (HEADS + KV_HEADS) * HEAD_DIM}


class _Attention(torch.nn.Module):
    """A model of one fused q/k/v projection, named as Phi-3's checkpoints name it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, False, torch.float32)

    def checkpoint_target(self, name: str):
        return fused_param_name(name)


def _stored_qkv(directory, fmt: CheckpointFormat, rows: int) -> torch.Tensor:
    """A whole q/k/v layer of `rows` outputs written in `fmt` to `directory`; its dequantized
    weight."""
    weight = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(8)) * 0.05
    tensors = fmt.quantize(weight, torch.Generator().manual_seed(9))
    directory.mkdir(exist_ok=True)
    save_file({f"qkv_proj.{n}": t for n, t in tensors.items()}, directory / "model.safetensors")
    return fmt.dequantize(tensors)


def _swapped(directory, fmt: CheckpointFormat) -> torch.nn.Module:
    model = _Attention()
    KEEP_PACKED_WEIGHTS[fmt.method](model, str(directory), fmt.config)
    return model.qkv_proj


def _rank_columns(whole: torch.Tensor, module: QKVParallelLinear) -> torch.Tensor:
    """The columns of one rank's q, k and v in the whole layer's output."""
    pieces = []
    for shard, piece in module.shard_slices.items():
        first = SHARD_OFFSETS[shard] + module.shard_sources[shard][0]
        pieces.append(whole[:, first : first + piece.stop - piece.start])
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("fmt_name", ["gptq-g32-act-order", "awq-g128", "w4a16-g128", "fp8-block"])
def test_a_fused_projection_stored_whole_is_split_by_its_shards_rows(
    tmp_path, monkeypatch, fmt_name
):
    """One rank: the layer computes the stored weight's product (the reference math, the
    8-bit formats' activation quantization included). Two ranks: each rank's output is its
    q, k and v columns of one rank's, bit for bit (each column is computed from its own
    row and the whole input)."""
    fmt = FORMATS[fmt_name]
    weight = _stored_qkv(tmp_path, fmt, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    x = outlier_input(5, HIDDEN) * 0.3
    switch_rank(monkeypatch, 0, 1)
    whole = _swapped(tmp_path, fmt)(x)
    activation = x
    if fmt.activations is not None:
        from w8a8_writer import fake_quantize_activation

        activation = fake_quantize_activation(x, fmt.activations)
    torch.testing.assert_close(whole, activation @ weight.T, rtol=1e-4, atol=2e-3)
    for rank in range(2):
        switch_rank(monkeypatch, rank, 2)
        layer = _swapped(tmp_path, fmt)
        module = _Attention().qkv_proj  # the rank's shards, as the swap saw them
        expected = _rank_columns(whole, module)
        if fmt.activations is None:
            assert torch.equal(layer(x), expected)
        else:  # where torch.mm multiplies the dequantized rows, its sums follow the shapes
            torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)


def test_a_fused_layer_stored_with_other_rows_than_the_config_is_refused(tmp_path, monkeypatch):
    fmt = FORMATS["gptq-g128"]
    _stored_qkv(tmp_path, fmt, 248)
    switch_rank(monkeypatch, 0, 1)
    with pytest.raises(
        ValueError,
        match=r"'qkv_proj'.*stores 248 output rows; the config's fused projection has 256 "
        r"\(q 128, k 64, v 64\)",
    ):
        _swapped(tmp_path, fmt)
