"""What an EAGLE-3 head trained by benchmarks.train_eagle gets per workload, without
running the speculating engine: the target's greedy generations of a workload's prompts
with the states the head reads, then each training-time-test step's top-1 accuracy (fp32,
and under the bf16 autocast training's own evaluation uses), loop.py's estimate from them,
and the acceptance length replayed as greedy verification walks (eagle_train/acceptance.py,
equal to the engine's). Workloads: "held-out" (the training run's held-out prompts, the
same seed: chat about subjects training never saw), "chat" (benchmarks.spec_decode's
chat questions).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.eagle_replay --eagle-head DIR
        [--workloads held-out,chat] [--num-prompts 32] [--seed 0] [--max-tokens 96] [--k 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.eagle_train.acceptance import replayed_acceptance
from benchmarks.eagle_train.capture import generate_with_states
from benchmarks.eagle_train.dataset import make_batches
from benchmarks.eagle_train.export import read_head_dir
from benchmarks.eagle_train.loop import cpu_has_bf16, evaluate, expected_acceptance
from benchmarks.eagle_train.prompts import make_prompts
from benchmarks.spec_decode import DEFAULT_EAGLE_HEAD, chat_prompts
from benchmarks.train_eagle import TargetParts
from pagedllm import LLM


def workload_prompts(name: str, tokenizer, num_prompts: int, seed: int) -> list[str]:
    if name == "chat":
        return chat_prompts(tokenizer)
    return make_prompts(tokenizer, num_prompts, seed, held_out=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eagle-head", type=Path, default=DEFAULT_EAGLE_HEAD)
    parser.add_argument("--workloads", default="held-out,chat")
    parser.add_argument("--num-prompts", type=int, default=32, help="held-out prompts")
    parser.add_argument("--seed", type=int, default=0, help="as the training run")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    args = parser.parse_args()
    llm = LLM(max_model_len=2048, kv_cache_memory="512MiB", enable_prefix_caching=False)
    head, vocab, layers = read_head_dir(args.eagle_head, TargetParts(llm).embedding)
    draft_ids = vocab.draft_ids()
    for name in args.workloads.split(","):
        prompts = workload_prompts(name, llm.get_tokenizer(), args.num_prompts, args.seed)
        sequences = generate_with_states(llm, prompts, layers, args.max_tokens, torch.float32)
        batches = make_batches(sequences, draft_ids, 1024, 1024)
        fp32 = evaluate(head, batches, args.k, bf16=False)
        line = f"{name}: {len(sequences)} prompts; top-1 per step fp32 "
        line += " ".join(f"{a:.3f}" for a in fp32)
        if cpu_has_bf16():
            bf16 = evaluate(head, batches, args.k, bf16=True)
            line += ", bf16 autocast " + " ".join(f"{a:.3f}" for a in bf16)
        replayed = replayed_acceptance(head, sequences, draft_ids, args.k, args.max_tokens)
        line += f"; estimate {expected_acceptance(fp32, args.k):.2f} (fp32)"
        line += f"; replayed acceptance length {replayed.mean_acceptance_length:.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
