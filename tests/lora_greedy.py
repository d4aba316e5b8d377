"""What the LoRA tests check of an engine with adapters on a quantized base (packed, 8-bit):
the adapters wrap the quantized layers, the greedy tokens of every adapter and of the base
model, in one batch, equal a Transformers + PEFT reference on the dequantized model (ties
counted), and the adapters change the answers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lora_utils import make_peft_adapter
from model_utils import compare_greedy, hf_greedy, model_runner

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.model.layers import LoRALinear

PROMPTS = [[5, 6, 7, 8] * 5, list(range(100, 130)), [3, 200, 7, 90, 45, 300, 12, 8]]
MAX_TOKENS = 12
TIE_TOLERANCE = 1e-3
ADAPTERS = [
    {"rank": 8, "target_modules": None},
    {"rank": 4, "target_modules": ["v_proj", "down_proj"]},
]


def check_adapters_on_quantized_base(
    quantized: Path,
    dequantized: Path,
    adapter_root: Path,
    base_types: tuple[type, ...],
    reference: Callable[[Path | None], object],
    report_ties: Callable[[int, int], None],
) -> None:
    """ADAPTERS made on `dequantized` (under `adapter_root`) served over `quantized`, whose
    LoRA wrappers must all hold a `base_types` layer; `reference(adapter)` is the
    Transformers model an adapter's (None: the base model's) tokens are compared with."""
    adapters = [
        make_peft_adapter(dequantized, adapter_root / f"a{i}", seed=i + 1, std=0.3, **settings)
        for i, settings in enumerate(ADAPTERS)
    ]
    loras = [None, *(LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters))]
    llm = LLM(
        str(quantized), max_model_len=128, kv_cache_memory="8MiB", enable_lora=True, max_loras=2
    )
    wrapped = [m for m in model_runner(llm).model.modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 2 * 4  # qkv, o, gate_up, down of each layer, on quantized bases
    assert all(isinstance(m.base, base_types) for m in wrapped)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in PROMPTS for _ in loras]
    requests = [lora for _ in PROMPTS for lora in loras]
    outputs = llm.generate(batch, params, use_tqdm=False, lora_request=requests)
    answers = [list(o.outputs[0].token_ids) for o in outputs]
    ties = 0
    for a, adapter in enumerate([None, *adapters]):
        model = reference(adapter)
        for p, prompt in enumerate(PROMPTS):
            expected = hf_greedy(model, prompt, MAX_TOKENS)
            ties += compare_greedy(answers[p * len(loras) + a], expected, TIE_TOLERANCE)
    report_ties(ties, len(answers))
    # The adapters move the answers (a wrapper that dropped its deltas would not).
    for p in range(len(PROMPTS)):
        base, *adapted = answers[p * len(loras) : (p + 1) * len(loras)]
        assert all(answer != base for answer in adapted)
