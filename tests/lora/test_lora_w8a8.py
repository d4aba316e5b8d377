"""LoRA on an 8-bit checkpoint (int8 W8A8, FP8): the adapters' deltas run in fp32 beside
the 8-bit layers, on the unquantized input. Greedy tokens equal Transformers + PEFT on the
dequantized model (ties counted): with the adapter merged into it for weight-only int8;
with activations quantized, PEFT's unmerged forward with the same fake-quantization on its
base layers' input only, which is what the engine computes (a merged adapter would see the
quantized input). The adapters change the answers."""

from __future__ import annotations

import pytest
from lora_utils import make_peft_adapter, merged_model, peft_model
from model_utils import compare_greedy, hf_greedy, model_runner
from quantized_llama import make_quantizable_llama
from w8a8_writer import add_activation_quantization, format_named, write_w8a8_checkpoint

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.model.layers import LoRALinear
from pagedllm.model.layers.w8a8_linear import Int8W8A8Linear, TiledDequantLinear

PROMPTS = [[5, 6, 7, 8] * 5, list(range(100, 130)), [3, 200, 7, 90, 45, 300, 12, 8]]
MAX_TOKENS = 12
TIE_TOLERANCE = 1e-3
ADAPTERS = [
    {"rank": 8, "target_modules": None},
    {"rank": 4, "target_modules": ["v_proj", "down_proj"]},
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_quantizable_llama(tmp_path_factory)


def _reference(dequantized, adapter, fmt):
    if fmt.activations is None:
        return merged_model(dequantized, adapter)
    model = peft_model(dequantized, adapter)
    add_activation_quantization(model, fmt)
    return model


@pytest.mark.parametrize(
    "name", ["ct-int8-weight-only", "ct-int8-token", "fp8-block"], ids=lambda n: n
)
def test_8_bit_base_with_adapters_equals_peft_on_the_dequantized_model(
    tiny_llama, tmp_path, report_ties, name
):
    fmt = format_named(name)
    quantized, dequantized = tmp_path / "w8a8", tmp_path / "dequantized"
    write_w8a8_checkpoint(tiny_llama, quantized, dequantized, fmt)
    adapters = [
        make_peft_adapter(dequantized, tmp_path / f"a{i}", seed=i + 1, std=0.3, **settings)
        for i, settings in enumerate(ADAPTERS)
    ]
    loras = [None, *(LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters))]
    llm = LLM(
        str(quantized), max_model_len=128, kv_cache_memory="8MiB", enable_lora=True, max_loras=2
    )
    wrapped = [m for m in model_runner(llm).model.modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 2 * 4  # qkv, o, gate_up, down of each layer, on 8-bit bases
    assert all(isinstance(m.base, Int8W8A8Linear | TiledDequantLinear) for m in wrapped)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in PROMPTS for _ in loras]
    requests = [lora for _ in PROMPTS for lora in loras]
    outputs = llm.generate(batch, params, use_tqdm=False, lora_request=requests)
    answers = [list(o.outputs[0].token_ids) for o in outputs]
    ties = 0
    for a, adapter in enumerate([None, *adapters]):
        model = _reference(dequantized, adapter, fmt)
        for p, prompt in enumerate(PROMPTS):
            reference = hf_greedy(model, prompt, MAX_TOKENS)
            ties += compare_greedy(answers[p * len(loras) + a], reference, TIE_TOLERANCE)
    report_ties(ties, len(answers))
    # The adapters move the answers (a wrapper that dropped its deltas would not).
    for p in range(len(PROMPTS)):
        base, *adapted = answers[p * len(loras) : (p + 1) * len(loras)]
        assert all(answer != base for answer in adapted)
