"""`benchmarks.random_w8a8` writes 8-bit checkpoints (int8 W8A8, FP8 dynamic, FP8 blocks) the
engine detects and serves on their 8-bit weights, every projection of every layer, and
counts the weights held as about the checkpoint's 8-bit bytes."""

from __future__ import annotations

import pytest

from benchmarks.parallel_memory import LlamaShape
from benchmarks.random_w8a8 import SCHEMES, held_weight_bytes, write_random_w8a8
from pagedllm import LLM, SamplingParams

SHAPE = LlamaShape("tiny", 256, 512, 2, 4, 2, 512, tie_word_embeddings=True)
METHODS = {
    "w8a8-int8": "compressed-tensors",
    "fp8-dynamic": "compressed-tensors",
    "fp8-block": "fp8",
}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_random_checkpoint_is_served_on_8bit_weights(tmp_path, scheme):
    directory = write_random_w8a8(tmp_path / scheme, SHAPE, scheme)
    llm = LLM(str(directory), max_model_len=64, kv_cache_memory="8MiB", skip_tokenizer_init=True)
    assert llm.llm_engine.model_config.quantization == METHODS[scheme]
    model = llm.model_runner.model
    layers = [m for m in model.modules() if hasattr(m, "weight_bytes")]
    assert len(layers) == SHAPE.num_layers * 4  # qkv, o, gate_up, down
    projections = sum(layer.in_features * layer.out_features for layer in layers)
    quantized = sum(layer.weight_bytes() for layer in layers)
    assert projections <= quantized <= 1.1 * projections  # about a byte a weight
    embedding = SHAPE.vocab_size * SHAPE.hidden_size * 4  # fp32, the head tied to it
    assert quantized + embedding <= held_weight_bytes(model) <= quantized + 1.1 * embedding
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 4
