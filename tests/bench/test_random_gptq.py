"""`benchmarks.random_gptq` writes GPTQ, AWQ and compressed-tensors W4A16 checkpoints the
engine detects and serves on their packed weights, every projection of every layer
quantized."""

from __future__ import annotations

import pytest

from benchmarks.parallel_memory import LlamaShape
from benchmarks.random_gptq import FORMATS, write_random_packed
from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.gptq_linear import GPTQLinear

SHAPE = LlamaShape("tiny", 256, 512, 2, 4, 2, 512, tie_word_embeddings=True)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_random_checkpoint_is_served_packed(tmp_path, fmt):
    directory = write_random_packed(tmp_path / fmt, SHAPE, fmt)
    llm = LLM(str(directory), max_model_len=64, kv_cache_memory="8MiB", skip_tokenizer_init=True)
    method = FORMATS[fmt][1]["quant_method"]
    assert llm.llm_engine.model_config.quantization == method
    layers = [m for m in llm.model_runner.model.modules() if isinstance(m, GPTQLinear)]
    assert len(layers) == SHAPE.num_layers * 4  # qkv, o, gate_up, down
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 4
