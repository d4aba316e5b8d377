"""LoRA on a GGUF base kept in its blocks (`quantization="gguf"`): the adapters' deltas run
in fp32 beside the block kernels, fused q/k/v of one type and of mixed types alike. Greedy
tokens equal the same file's dequantized fp32 model with the same adapters (the kernels'
16-bit activations move logprobs by ~1e-5: ties within 1e-3, as in
tests/model/test_gguf_quantization.py), and the adapters change the answer."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_writer import tiny_model, write_model_gguf
from lora_utils import make_peft_adapter
from model_utils import compare_to_reference_engine

from pagedllm import LLM, LoRARequest, SamplingParams

TIE_TOLERANCE = 1e-3
PROMPTS = [[5, 6, 7, 8] * 5, list(range(100, 130)), [3, 200, 7, 90, 45, 300, 12, 8]]


def _qtype(gguf_name: str) -> Q:
    """Layer 0 one type per projection; layer 1's q/k/v of mixed types (a concatenation)."""
    if gguf_name.startswith("token_embd"):
        return Q.Q8_0
    layer, part = gguf_name.split(".")[1:3]
    if layer == "1" and part == "attn_k":
        return Q.Q8_0
    return Q.Q4_0


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gguf")
    model = tiny_model(
        "llama",
        vocab_size=320,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model.save_pretrained(root / "hf")
    write_model_gguf(root / "tiny.gguf", model, "llama", _qtype)
    adapters = [
        LoRARequest(
            f"a{i}", i + 1, str(make_peft_adapter(root / "hf", root / f"a{i}", i + 1, std=0.3))
        )
        for i in range(2)
    ]
    return root / "tiny.gguf", adapters


def generate(llm: LLM, loras) -> list:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    batch = [{"prompt_token_ids": prompt} for prompt in PROMPTS for _ in loras]
    requests = [lora for _ in PROMPTS for lora in loras]
    outputs = llm.generate(batch, params, use_tqdm=False, lora_request=requests)
    return [output.outputs[0] for output in outputs]


def test_gguf_base_with_adapters_equals_the_dequantized_model(base, report_ties):
    path, adapters = base
    common = dict(max_model_len=256, skip_tokenizer_init=True, enable_lora=True, max_loras=2)
    loras = [None, *adapters]
    expected = generate(LLM(str(path), **common), loras)
    actual = generate(LLM(str(path), quantization="gguf", **common), loras)
    ties, largest = compare_to_reference_engine(expected, actual, TIE_TOLERANCE)
    report_ties(ties, len(actual))
    assert largest < TIE_TOLERANCE  # the chosen tokens' logprobs, adapters included
    # Each adapter moves the answer's logprobs far more than the kernels do.
    first = [output.logprobs[0][output.token_ids[0]].logprob for output in expected[:3]]
    assert min(abs(first[0] - first[1]), abs(first[0] - first[2])) > 100 * TIE_TOLERANCE
