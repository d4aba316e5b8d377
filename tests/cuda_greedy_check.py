"""Greedy tokens on a CUDA device equal Transformers' (fp32, on the CPU) for a tiny random model
of every architecture, under chunked prefill, preemption, prefix caching and block size 7.

Not collected by pytest (CI has no GPU): run it where a GPU is lent, from the repository root:

    python tests/cuda_greedy_check.py [--variants LlamaForCausalLM,Gemma3ForCausalLM]

It exits 1 if any variant differs from Transformers other than at a numerical tie.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import VARIANTS
from engine.test_greedy_vs_transformers import KV_TOKENS, _bytes_for_tokens
from model_utils import compare_greedy, hf_greedy, make_tiny_model

DEFAULT_VARIANTS = (
    "LlamaForCausalLM,MistralForCausalLM:window24,Qwen2ForCausalLM:hybrid24,Qwen3ForCausalLM,"
    "Gemma3ForCausalLM,Phi3ForCausalLM:longrope,MixtralForCausalLM,Qwen3MoeForCausalLM"
)
PROMPT_LENGTHS = (1, 5, 17, 33, 64, 100, 150)
MAX_NEW_TOKENS = 32
TIE_TOLERANCE = 1e-4


def check(variant: str, root: Path, device: str) -> tuple[int, int]:
    """(ties, preemptions) of one variant; raises AssertionError where it differs."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    architecture, _, extra = variant.partition(":")
    directory = make_tiny_model(architecture, root / variant.replace(":", "-"), **VARIANTS[extra])
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENGTHS]
    references = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    llm = LLM(
        str(directory),
        device=device,
        max_model_len=400,
        block_size=7,
        max_num_batched_tokens=64,
        kv_cache_memory=_bytes_for_tokens(directory, KV_TOKENS.get(variant, 600), 7),
    )
    ties = 0
    for _ in range(2):  # the second pass is served from the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ties += sum(
            compare_greedy(out.outputs[0].token_ids, ref, TIE_TOLERANCE)
            for out, ref in zip(outputs, references, strict=True)
        )
    core = llm.llm_engine.engine_core
    kv = core.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks, "blocks were not returned"
    return ties, core.scheduler.num_preemptions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated")
    parser.add_argument("--device", default="cuda", help="where pagedllm runs")
    args = parser.parse_args()
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    failed = []
    with tempfile.TemporaryDirectory() as root:
        for variant in args.variants.split(","):
            try:
                ties, preemptions = check(variant, Path(root), args.device)
                print(f"{variant}: same tokens ({ties} ties, {preemptions} preemptions)")
            except Exception:
                failed.append(variant)
                print(f"{variant}: FAILED\n{traceback.format_exc()}")
    print(f"{len(failed)} of {len(args.variants.split(','))} variants failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
