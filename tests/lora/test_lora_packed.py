"""LoRA on a checkpoint stored packed (GPTQ here; AWQ and compressed-tensors load into the
same layers): the adapters' deltas run in fp32 beside the packed kernel layers, on a fused
q/k/v and gate/up of one layer (one input order) and on one layer per part (act-order, an
order each). Greedy tokens equal Transformers + PEFT with each adapter merged into the
dequantized model (ties counted; the kernels' 16-bit activations are the only difference,
~1e-5 in logprobs), and the adapters change the answers."""

from __future__ import annotations

import pytest
from gptq_writer import Scheme, write_gptq_checkpoint
from lora_utils import make_peft_adapter, merged_model
from model_utils import compare_greedy, hf_greedy, make_tiny_model, model_runner

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.model.layers import LoRALinear
from pagedllm.model.layers.gguf_linear import GGUFConcatLinear
from pagedllm.model.layers.gptq_linear import GPTQLinear

# Inputs of whole groups of 128 (o_proj: 4 heads x 64).
SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64)
PROMPTS = [[5, 6, 7, 8] * 5, list(range(100, 130)), [3, 200, 7, 90, 45, 300, 12, 8]]
MAX_TOKENS = 12
TIE_TOLERANCE = 1e-3
ADAPTERS = [
    {"rank": 8, "target_modules": None},
    {"rank": 4, "target_modules": ["v_proj", "down_proj"]},
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), **SHAPE)


@pytest.mark.parametrize(
    "scheme", [Scheme(128, desc_act=False, sym=True), Scheme(64, desc_act=True, sym=False)], ids=str
)
def test_packed_base_with_adapters_equals_peft_on_the_dequantized_model(
    tiny_llama, tmp_path, report_ties, scheme
):
    quantized, dequantized = tmp_path / "gptq", tmp_path / "dequantized"
    write_gptq_checkpoint(tiny_llama, quantized, dequantized, scheme)
    adapters = [
        make_peft_adapter(dequantized, tmp_path / f"a{i}", seed=i + 1, std=0.3, **settings)
        for i, settings in enumerate(ADAPTERS)
    ]
    loras = [None, *(LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters))]
    llm = LLM(
        str(quantized), max_model_len=128, kv_cache_memory="8MiB", enable_lora=True, max_loras=2
    )
    wrapped = [m for m in model_runner(llm).model.modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 2 * 4  # qkv, o, gate_up, down of each layer, on packed bases
    assert all(isinstance(m.base, GPTQLinear | GGUFConcatLinear) for m in wrapped)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in PROMPTS for _ in loras]
    requests = [lora for _ in PROMPTS for lora in loras]
    outputs = llm.generate(batch, params, use_tqdm=False, lora_request=requests)
    answers = [list(o.outputs[0].token_ids) for o in outputs]
    ties = 0
    for a, adapter in enumerate([None, *adapters]):
        model = merged_model(dequantized, adapter)
        for p, prompt in enumerate(PROMPTS):
            reference = hf_greedy(model, prompt, MAX_TOKENS)
            ties += compare_greedy(answers[p * len(loras) + a], reference, TIE_TOLERANCE)
    report_ties(ties, len(answers))
    # The adapters move the answers (a wrapper that dropped its deltas would not).
    for p in range(len(PROMPTS)):
        base, *adapted = answers[p * len(loras) : (p + 1) * len(loras)]
        assert all(answer != base for answer in adapted)
