"""What the AWQ and compressed-tensors tests check of an engine on a checkpoint stored
packed (tests/awq_writer.py, tests/ct_writer.py): its greedy tokens are Transformers' on the
same model with the dequantized weights (ties counted), the log-probabilities of its tokens
are Transformers' within a tolerance, and what its packed layers hold."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from model_utils import compare_greedy, greedy_with_logprobs, hf_greedy, model_runner

PROMPT_LENGTHS = (5, 19, 33)
MAX_NEW_TOKENS = 12
TIE_TOLERANCE = 1e-3
# The kernel's two int8 digits per activation block (~15 bits) are the only difference
# from Transformers' fp32 product on the same weights.
LOGPROB_TOLERANCE = 2e-3


@dataclass(frozen=True)
class EngineCheck:
    ties: int  # sequences that met a numerical tie before their end
    largest_logprob_error: float  # |engine - Transformers| of the engine's chosen tokens
    packed_layers: int  # GPTQLinear modules (parts of fused layers counted apiece)
    held_bytes: int  # their kernel tables' bytes
    largest_layer_parameter: int  # elements of the largest parameter left in the layers


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _transformers_logprobs(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Transformers' log-probability of each of `tokens` following `prompt` (teacher forced)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def check_engine(quantized: Path, dequantized: Path, method: str) -> EngineCheck:
    """Run the engine on `quantized` against Transformers on `dequantized` (see the module
    docstring); asserts the tokens and returns the measurements."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM
    from pagedllm.model.layers.gptq_linear import GPTQLinear

    prompts = _prompts()
    hf_model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    references = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    llm = LLM(str(quantized), max_model_len=128, kv_cache_memory="8MiB")
    assert llm.llm_engine.model_config.quantization == method
    outputs = greedy_with_logprobs(llm, prompts, MAX_NEW_TOKENS)
    ties = sum(
        compare_greedy(out.token_ids, ref, TIE_TOLERANCE)
        for out, ref in zip(outputs, references, strict=True)
    )
    errors = []
    for prompt, out in zip(prompts, outputs, strict=True):
        theirs = _transformers_logprobs(hf_model, prompt, list(out.token_ids))
        ours = torch.tensor(
            [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        )
        errors.append(float((ours - theirs).abs().max()))
    model = model_runner(llm).model
    layers = [m for m in model.modules() if isinstance(m, GPTQLinear)]
    return EngineCheck(
        ties,
        max(errors),
        len(layers),
        sum(layer.weight_bytes() for layer in layers),
        max(p.numel() for n, p in model.named_parameters() if "layers" in n),
    )


def dummy_and_checkpoint_layers(quantized: Path, shapes: Path) -> dict[str, list]:
    """The packed layers ((description, weight bytes) each) of an engine on the checkpoint
    `quantized` and of one on `load_format="dummy"` from its config.json alone (written to
    `shapes`); asserts the dummy model generates finite log-probabilities."""
    import json
    import math

    from pagedllm import LLM, SamplingParams
    from pagedllm.model.layers.gptq_linear import GPTQLinear
    from pagedllm.model.loader import write_config_dir

    config = json.loads((quantized / "config.json").read_text())
    dummy = LLM(
        write_config_dir(str(shapes), config), max_model_len=128, kv_cache_memory="8MiB",
        load_format="dummy", skip_tokenizer_init=True,
    )  # fmt: skip
    held = {}
    for name, llm in (
        ("checkpoint", LLM(str(quantized), max_model_len=128, kv_cache_memory="8MiB")),
        ("dummy", dummy),
    ):
        layers = [m for m in model_runner(llm).model.modules() if isinstance(m, GPTQLinear)]
        held[name] = [(layer.extra_repr(), layer.weight_bytes()) for layer in layers]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    (output,) = dummy.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8
    logprobs = [lp.logprob for step in output.outputs[0].logprobs for lp in step.values()]
    assert all(math.isfinite(lp) for lp in logprobs)
    return held
