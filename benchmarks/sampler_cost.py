"""The sampler's cost per step at batch 256 on the default model's vocabulary, as a share of
a real decode step of the default model (fp32) with 256 requests running.

    .venv/bin/python -m benchmarks.sampler_cost [--batch 256 --repeats 20]
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch

from benchmarks.timing import median_seconds
from pagedllm import LLM, SamplingParams
from pagedllm.core.request import Request
from pagedllm.sample.logits_processors import LogitsProcessorState, apply_logits_processors
from pagedllm.sample.sampler import Sampler, SamplingMetadata


def decode_step_seconds(llm: LLM, batch: int, repeats: int) -> float:
    """Median time of a full engine step with `batch` requests decoding (32-token prompts)."""
    core = llm.llm_engine.engine_core
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for index in range(batch):
        prompt = [rng.randrange(100, 49152) for _ in range(32)]
        core.add_request(Request(f"b{index}", prompt, params))
    while len(core.scheduler.running) < batch or core.scheduler.waiting:
        core.step()
    seconds = median_seconds(core.step, repeats)
    core.abort_requests([f"b{index}" for index in range(batch)])
    return seconds


def metadata(batch: int, temperature: float, top_k: int | None, top_p: float | None):
    def column(value, dtype):
        return None if value is None else torch.full((batch,), value, dtype=dtype)

    return SamplingMetadata(
        temperature=torch.full((batch,), temperature),
        top_k=column(top_k, torch.long),
        top_p=column(top_p, torch.float32),
        min_p=None,
        generators={},
        all_greedy=temperature == 0,
        all_random=temperature > 0,
    )


def penalty_states(batch: int, vocab: int) -> list[LogitsProcessorState]:
    rng = np.random.default_rng(0)
    states = []
    for _ in range(batch):
        state = LogitsProcessorState(
            prompt_token_ids=rng.integers(0, vocab, 256).tolist(),
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=0.5,
        )
        for token_id in rng.integers(0, vocab, 128).tolist():
            state.append_output_token(token_id)
        states.append(state)
    return states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    llm = LLM(max_num_seqs=args.batch)
    vocab = llm.llm_engine.model_config.vocab_size
    step = decode_step_seconds(llm, args.batch, max(3, args.repeats // 4))
    logits = torch.randn(args.batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
    sampler = Sampler()
    states = penalty_states(args.batch, vocab)
    cases = {
        "greedy": lambda: sampler(
            logits, metadata(args.batch, 0.0, None, None), compute_logprobs=False
        ),
        "temperature 0.8 (whole vocabulary)": lambda: sampler(
            logits, metadata(args.batch, 0.8, None, None), compute_logprobs=False
        ),
        "temperature 0.8, top-k 50, top-p 0.9": lambda: sampler(
            logits, metadata(args.batch, 0.8, 50, 0.9), compute_logprobs=False
        ),
        "temperature 0.8, top-p 0.9": lambda: sampler(
            logits, metadata(args.batch, 0.8, None, 0.9), compute_logprobs=False
        ),
        "greedy + repetition/presence/frequency penalties": lambda: sampler(
            apply_logits_processors(logits.clone(), states),
            metadata(args.batch, 0.0, None, None),
            raw_logits=logits,
            compute_logprobs=False,
        ),
        "greedy + logprobs (cumulative_logprob)": lambda: sampler(
            logits, metadata(args.batch, 0.0, None, None), compute_logprobs=True
        ),
    }
    print(f"decode step, {args.batch} running: {step * 1000:.1f} ms (median)")
    print("| sampling | ms per step | share of the step |")
    print("|---|---|---|")
    for name, fn in cases.items():
        seconds = median_seconds(fn, args.repeats)
        print(f"| {name} | {seconds * 1000:.1f} | {100 * seconds / step:.1f}% |")


if __name__ == "__main__":
    main()
