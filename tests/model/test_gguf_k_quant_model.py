"""A K-quant GGUF model (random weights, Q4_K_M's type mix: Q4_K and Q6_K, the q/k/v of mixed
types) runs on its blocks: its weights held in memory are the file's tensor bytes within 10%,
none is a view keeping a larger tensor alive, and it generates the fp32 engine's tokens."""

from __future__ import annotations

import pytest
from model_utils import compare_to_reference_engine, greedy_with_logprobs, model_runner

from benchmarks import random_gguf
from benchmarks.parallel_memory import LlamaShape
from pagedllm import LLM
from pagedllm.model.gguf.tensor_table import read_gguf_tensors
from pagedllm.model.layers.gguf_linear import GGUFConcatLinear, distinct_bytes

# Rows of whole 256-weight super-blocks; 4 layers so that Q4_K_M gives some layers Q6_K for
# attn_v and ffn_down (mixed q/k/v) and others Q4_K; untied, so the head is Q6_K.
SHAPE = LlamaShape("tiny", 256, 512, 4, 4, 2, 49152 + 64)  # the tokenizer's and more
TIE_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("k-quant") / "tiny-q4_k_m.gguf"
    random_gguf.write_random_gguf(path, SHAPE, random_gguf.FILE_TYPES["Q4_K_M"], seed=0)
    return path


def _engine(path, **kwargs) -> LLM:
    return LLM(model=str(path), skip_tokenizer_init=True, max_model_len=128, **kwargs)


def test_weights_in_memory_are_the_files_bytes(k_quant_file):
    llm = _engine(k_quant_file, quantization="gguf")
    model = model_runner(llm).model
    tensors, _ = read_gguf_tensors(str(k_quant_file))
    file_bytes = sum(t.data.nbytes for t in tensors if len(t.shape) == 2)
    held = distinct_bytes(model.buffers())
    print(f"file tensors {file_bytes} bytes, held {held} ({held / file_bytes:.3f}x)")
    assert file_bytes <= held <= 1.10 * file_bytes
    assert all(t._base is None for t in model.buffers())  # no view keeps a base alive
    assert not [n for n, p in model.named_parameters() if p.numel() > SHAPE.hidden_size]
    # Q4_K_M gives layers 2 and 3 a Q6_K attn_v: their q/k/v are two kernel layers.
    mixed = [n for n, m in model.named_modules() if isinstance(m, GGUFConcatLinear)]
    assert mixed == [f"model.layers.{i}.self_attn.qkv_proj" for i in (2, 3)]


@pytest.mark.slow  # long (~14 s on two busy cores)
def test_greedy_tokens_are_the_fp32_engines(k_quant_file):
    prompts = [[1, 5, 9, 200], list(range(3, 40)), [7] * 12]
    fp32, quantized = (
        greedy_with_logprobs(_engine(k_quant_file, **kw), prompts, 16)
        for kw in ({}, {"quantization": "gguf"})
    )
    ties, largest = compare_to_reference_engine(fp32, quantized, TIE_TOLERANCE)
    print(f"ties: {ties}; largest logprob difference: {largest:.2e}")
    assert largest < 1e-3
