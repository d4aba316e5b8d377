"""`benchmarks.random_gptq` writes a GPTQ checkpoint the engine detects and serves on its
packed weights, every projection of every layer quantized."""

from __future__ import annotations

from benchmarks.parallel_memory import LlamaShape
from benchmarks.random_gptq import write_random_gptq
from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.gptq_linear import GPTQLinear

SHAPE = LlamaShape("tiny", 256, 512, 2, 4, 2, 512, tie_word_embeddings=True)


def test_the_random_checkpoint_is_served_as_gptq(tmp_path):
    directory = write_random_gptq(tmp_path / "gptq", SHAPE)
    llm = LLM(str(directory), max_model_len=64, kv_cache_memory="8MiB", skip_tokenizer_init=True)
    assert llm.llm_engine.model_config.quantization == "gptq"
    layers = [m for m in llm.model_runner.model.modules() if isinstance(m, GPTQLinear)]
    assert len(layers) == SHAPE.num_layers * 4  # qkv, o, gate_up, down
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 4
