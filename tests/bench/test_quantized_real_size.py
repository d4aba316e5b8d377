"""`benchmarks.quantized_real_size`'s pieces on a tiny shape: every format's checkpoint is
written, detected and served on its stored weights, and the bytes held are counted against
the bytes the checkpoint stores."""

from __future__ import annotations

import pytest

from benchmarks.parallel_memory import LlamaShape
from benchmarks.quantized_checkpoints import (
    DENSE,
    EIGHT_BIT,
    GGUF,
    PACKED,
    checkpoint_tensor_bytes,
    dense_format,
    dense_parameters,
    held_projection_bytes,
    held_weight_bytes,
    write_checkpoint,
)
from benchmarks.quantized_real_size import default_formats, engine_options
from pagedllm import LLM, SamplingParams

SHAPE = LlamaShape("tiny", 256, 512, 2, 4, 2, 512, tie_word_embeddings=True)
METHODS = {
    "gptq-g128": "gptq",
    "awq-g128": "awq",
    "w4a16-g128": "compressed-tensors",
    "w8a8-int8": "compressed-tensors",
    "fp8-dynamic": "compressed-tensors",
    "fp8-block": "fp8",
    "fp32": None,
}
WEIGHTS_PER_BYTE = {**dict.fromkeys(PACKED, 2.0), **dict.fromkeys(EIGHT_BIT, 1.0), "fp32": 0.25}


def _served(tmp_path, fmt: str) -> tuple[LLM, dict[str, int]]:
    path = write_checkpoint(tmp_path / fmt, SHAPE, fmt)
    llm = LLM(
        str(path), max_model_len=64, kv_cache_memory="8MiB", skip_tokenizer_init=True,
        **engine_options(str(path), fmt),
    )  # fmt: skip
    return llm, checkpoint_tensor_bytes(path, SHAPE, fmt)


@pytest.mark.parametrize("fmt", list(METHODS))
def test_each_format_is_served_on_the_weights_it_stores(tmp_path, fmt):
    llm, stored = _served(tmp_path, fmt)
    assert llm.llm_engine.model_config.quantization == METHODS[fmt]
    model = llm.model_runner.model
    # q and o 256 x 256, k and v 256 x 128 (2 of 4 heads), gate, up and down 256 x 512
    projections = SHAPE.num_layers * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512)
    # The checkpoint stores about the format's bytes a weight (scales beside them) ...
    per_weight = stored["projections"] * WEIGHTS_PER_BYTE[fmt] / projections
    assert 1.0 <= per_weight <= 1.1
    # ... and the engine holds them as stored, within the 10% the issue allows.
    held = held_projection_bytes(model)
    assert 0.9 * stored["projections"] <= held <= 1.1 * stored["projections"]
    assert stored["projections"] < stored["all"] and held < held_weight_bytes(model)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 4


def test_the_dense_checkpoint_counts_what_its_safetensors_would_store():
    assert checkpoint_tensor_bytes(None, SHAPE, "bf16")["all"] == 2 * dense_parameters(SHAPE)
    untied = LlamaShape("untied", 256, 512, 2, 4, 2, 512)
    extra_head = dense_parameters(untied) - dense_parameters(SHAPE)
    assert extra_head == 512 * 256


def test_one_dense_row_in_the_dtype_the_cpu_multiplies():
    assert dense_format({"avx2", "avx512_bf16"}) == "bf16"
    assert dense_format({"avx2", "amx_bf16"}) == "bf16"
    assert dense_format({"avx2", "avx512f"}) == "fp32"
    formats = default_formats({"avx2"})
    assert formats[-1] == "fp32" and "bf16" not in formats and GGUF in formats
    assert set(formats) - set(DENSE) == set(PACKED) | set(EIGHT_BIT) | {GGUF}
