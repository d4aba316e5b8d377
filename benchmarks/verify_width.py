"""What a wider verification costs on the default model, and what Medusa heads cost to run:
the numbers a Medusa token tree (more candidates verified per step) would have to beat.

Single-stream greedy decoding of the copy workload with prompt lookup proposing up to
`--k` tokens: every target forward is bucketed by how many tokens it verified (1 + drafts)
and its median wall time reported, so the marginal cost of one more verified token shows.
Then `--heads` Medusa heads of the default model's sizes (random weights, one residual
block and an own lm_head each, packed as the engine packs them) are timed proposing for one
request: the price of a step's drafts, tree or chain alike.

    .venv/bin/python -m benchmarks.verify_width [--k 9] [--max-tokens 400] [--heads 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.spec_decode import copy_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.onednn import pack_linear_weights
from pagedllm.spec_decode.runner.medusa_head import MedusaHeads


def forward_times(k: int, max_tokens: int, rounds: int):
    """(median-able wall times by verified width, the engine's runner)."""
    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2}
    llm = LLM(max_model_len=2048, kv_cache_memory="512MiB", speculative_config=config)
    prompt = copy_prompts(llm.get_tokenizer())[0]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    by_width: dict[int, list[float]] = defaultdict(list)

    def record(step) -> None:
        if step.num_scheduled_tokens <= k + 1:  # decode steps, not the prompt's
            by_width[step.num_scheduled_tokens].append(step.seconds)

    runner = llm.model_runner
    runner.add_forward_observer(record)
    for _ in range(rounds):
        llm.generate(prompt, params, use_tqdm=False)
    return by_width, runner


def head_seconds(num_heads: int, hidden: int, vocab: int, kernels, rounds: int = 50) -> float:
    heads = MedusaHeads(
        num_heads, 1, hidden, vocab, True, list(range(num_heads)), torch.float32, kernels
    )
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    pack_linear_weights(heads)
    state = torch.randn(1, hidden)
    with torch.inference_mode():
        heads(state)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            [logits.argmax(-1) for logits in heads(state)]
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=9)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    by_width, runner = forward_times(args.k, args.max_tokens, args.rounds)
    hidden, vocab = runner.model.config.hidden_size, runner.vocab_size
    base = statistics.median(by_width[1]) if by_width.get(1) else None
    for width in sorted(by_width):
        median = statistics.median(by_width[width])
        ratio = f", {median / base:.2f}x one token" if base else ""
        count = len(by_width[width])
        print(f"verify {width:2d} tokens: {median * 1e3:6.2f} ms ({count} steps{ratio})")
    seconds = head_seconds(args.heads, hidden, vocab, runner.kernels)
    print(f"{args.heads} Medusa heads (hidden {hidden}, vocab {vocab}): {seconds * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
