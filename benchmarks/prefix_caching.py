"""Prefix caching on and off, side by side in one run, on the default model (fp32).

Shared prefix: one system prompt (`--system-len` tokens) before each of `--num-questions`
different questions (`--question-len` tokens), `--output-len` output tokens each: total
time, prompt tokens actually computed, time to first token (median, p99).

No sharing: random prompts with nothing in common (`--plain-*`), alternating on and off for
`--rounds` rounds: the throughput cost of looking up and publishing blocks.

    .venv/bin/python -m benchmarks.prefix_caching [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedllm import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--num-questions", type=int, default=64)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--plain-prompts", type=int, default=32)
    parser.add_argument("--plain-input-len", type=int, default=256)
    parser.add_argument("--plain-output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args()


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(100, 49152) for _ in range(count)]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    llm.reset_prefix_cache()  # every run starts cold
    computed_before = llm.get_stats().num_computed_prompt_tokens
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    ttfts = [o.metrics.time_to_first_token for o in outputs]
    return {
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(prompts) / seconds, 3),
        "computed_prompt_tokens": llm.get_stats().num_computed_prompt_tokens - computed_before,
        "prompt_tokens": sum(len(p) for p in prompts),
        "ttft_median_s": round(statistics.median(ttfts), 3),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
        "tokens": [o.outputs[0].token_ids for o in outputs],
    }


def main() -> None:
    args = parse_args()
    rng = random.Random(args.seed)
    engines = {"on": LLM(), "off": LLM(enable_prefix_caching=False)}
    system = random_tokens(rng, args.system_len)
    shared = [system + random_tokens(rng, args.question_len) for _ in range(args.num_questions)]
    plain = [random_tokens(rng, args.plain_input_len) for _ in range(args.plain_prompts)]
    report: dict = {
        "workload": vars(args),
        "shared_prefix": {},
        "no_sharing": {"on": [], "off": []},
    }
    for name, llm in engines.items():
        result = run(llm, shared, args.output_len)
        print(f"shared prefix, caching {name}: {result['seconds']} s", flush=True)
        report["shared_prefix"][name] = result
    same = report["shared_prefix"]["on"].pop("tokens") == report["shared_prefix"]["off"].pop(
        "tokens"
    )
    report["shared_prefix"]["identical_output"] = same
    for round_index in range(args.rounds):
        for name, llm in engines.items():
            result = run(llm, plain, args.plain_output_len)
            result.pop("tokens")
            print(
                f"no sharing round {round_index + 1}, caching {name}: {result['seconds']} s",
                flush=True,
            )
            report["no_sharing"][name].append(result)
    print_report(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


def print_report(report: dict) -> None:
    print("\n| shared prefix | total s | prompt tokens computed | TTFT median s | TTFT p99 s |")
    print("|---|---|---|---|---|")
    for name in ("on", "off"):
        r = report["shared_prefix"][name]
        print(
            f"| caching {name} | {r['seconds']} | {r['computed_prompt_tokens']} of "
            f"{r['prompt_tokens']} | {r['ttft_median_s']} | {r['ttft_p99_s']} |"
        )
    print(f"identical greedy output: {report['shared_prefix']['identical_output']}")
    medians = {
        name: statistics.median(r["seconds"] for r in runs)
        for name, runs in report["no_sharing"].items()
    }
    print(
        f"\nno sharing, median seconds: on {medians['on']:.2f}, off {medians['off']:.2f}; "
        f"cost of caching {100 * (medians['on'] / medians['off'] - 1):+.2f}%"
    )
    report["no_sharing"]["cost_percent"] = round(100 * (medians["on"] / medians["off"] - 1), 2)


if __name__ == "__main__":
    main()
