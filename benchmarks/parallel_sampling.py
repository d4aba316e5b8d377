"""n = 4 parallel sampling against 4 separate requests with the same prompt, on the default
model (fp32), in one run: total time and prompt tokens computed.

The engine forks a request's n samples in the scheduler once its prompt is computed; the
separate requests are what fanning n requests out in the frontend would send (child j of
seed i seeded i + j, so both make the same tokens), served by prefix caching unless
`--no-prefix-caching`.

    .venv/bin/python -m benchmarks.parallel_sampling [--prompts 16 --input-len 256 --output-len 64
        --rounds 2 --no-prefix-caching]
"""

from __future__ import annotations

import argparse
import random
import time

from pagedllm import LLM, SamplingParams


def run(llm: LLM, prompts, params) -> tuple[float, int, int]:
    llm.reset_prefix_cache()
    before = llm.get_stats().num_computed_prompt_tokens
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return seconds, num_tokens, llm.get_stats().num_computed_prompt_tokens - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="run the engine with enable_prefix_caching=False",
    )
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 49152) for _ in range(args.input_len)]}
        for _ in range(args.prompts)
    ]
    llm = LLM(enable_prefix_caching=not args.no_prefix_caching)

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(
            n=n, temperature=1.0, top_p=0.95, seed=seed, max_tokens=args.output_len, ignore_eos=True
        )

    separate_prompts = [p for p in prompts for _ in range(args.n)]
    # Child j of a request with seed i samples with seed i + j: both runs make the same tokens.
    separate_params = [params(1, i + j) for i in range(args.prompts) for j in range(args.n)]
    runs = {"parallel": [], "separate": []}
    for round_index in range(args.rounds):
        order = ["parallel", "separate"] if round_index % 2 == 0 else ["separate", "parallel"]
        for name in order:
            if name == "parallel":
                result = run(llm, prompts, [params(args.n, i) for i in range(args.prompts)])
            else:
                result = run(llm, separate_prompts, separate_params)
            print(f"round {round_index + 1} {name}: {result[0]:.1f} s", flush=True)
            runs[name].append(result)
    parallel = min(runs["parallel"])
    separate = min(runs["separate"])
    print("\n(fastest of each)")
    print("| requests | seconds | output tok/s | prompt tokens computed |")
    print("|---|---|---|---|")
    for name, (seconds, num_tokens, computed) in (
        (f"{args.prompts} × n={args.n}", parallel),
        (f"{args.prompts * args.n} separate (same prompts)", separate),
    ):
        print(f"| {name} | {seconds:.1f} | {num_tokens / seconds:.1f} | {computed} |")
    print(f"\nn={args.n} / separate: {separate[0] / parallel[0]:.2f}x faster")


if __name__ == "__main__":
    main()
