"""Structured output's cost, on the default model (fp32), in one run.

1. Throughput: `--batch` chat requests asking for JSON, sampled (temperature 1), with the
   JSON schema enforced; then the same requests unconstrained, each forced (ignore_eos) to
   the length its constrained run produced, so both generate the same tokens per request
   and the times compare directly; output tokens/s each.
2. Per-step cost of the bitmask at that batch: fill (xgrammar) + apply (to the logits).
3. Compile time of the largest test schema on a fresh compiler, and time to first token of
   one request with that schema when its grammar is not cached (cold) and when it is (warm).

    .venv/bin/python -m benchmarks.structured_output [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sample.grammar_bitmask import apply_bitmask, bitmask_words
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.xgrammar_backend import XgrammarBackend
from tests.structured_output.schemas import PERSON, SCHEMAS

# The structured-output tests' person schema and their largest one (an order with a $ref'd
# item array, enums, bounded numbers and a pattern).
LARGEST = SCHEMAS[-1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    return parser.parse_args()


def throughput(llm: LLM, lengths: list[int], spec) -> tuple[dict, list[int]]:
    """One batch (constrained when `spec`, else forced to `lengths`); result, lengths."""
    conversations = [
        [{"role": "user", "content": f"Describe person number {i} as JSON."}]
        for i in range(len(lengths))
    ]
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=n, structured_outputs=spec, ignore_eos=spec is None
        )
        for i, n in enumerate(lengths)
    ]
    started = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    result = {"seconds": round(seconds, 2), "output_tokens": sum(produced),
              "output_tokens_per_s": round(sum(produced) / seconds, 1)}  # fmt: skip
    return result, produced


def bitmask_cost(llm: LLM, batch: int) -> dict:
    engine = llm.llm_engine
    backend = XgrammarBackend(engine.tokenizer, engine.model_config.vocab_size, [2])
    compiled = backend.compile(StructuredOutputsParams(json=PERSON))
    matchers = [backend.matcher(compiled) for _ in range(batch)]
    vocab = engine.model_config.vocab_size
    bitmask = torch.full((batch, bitmask_words(vocab)), -1, dtype=torch.int32)
    logits = torch.randn(batch, vocab)
    fills, applies = [], []
    for _ in range(20):
        started = time.perf_counter()
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)
        fills.append(time.perf_counter() - started)
        started = time.perf_counter()
        apply_bitmask(logits, bitmask, torch.arange(batch))
        applies.append(time.perf_counter() - started)
    return {"fill_ms": round(1000 * statistics.median(fills), 3),
            "apply_ms": round(1000 * statistics.median(applies), 3)}  # fmt: skip


def compile_and_ttft(llm: LLM) -> dict:
    engine = llm.llm_engine
    backend = XgrammarBackend(engine.tokenizer, engine.model_config.vocab_size, [2])
    started = time.perf_counter()
    backend.compile(StructuredOutputsParams(json=LARGEST))
    compile_s = time.perf_counter() - started
    # A schema no earlier request used: the first request compiles it, the second reuses it.
    schema = {**LARGEST, "title": f"fresh-{time.time()}"}
    params = SamplingParams(temperature=0, max_tokens=1,
                            structured_outputs=StructuredOutputsParams(json=schema))  # fmt: skip
    ttfts = []
    for _ in range(2):
        output = llm.generate("An order as JSON:", params, use_tqdm=False)[0]
        ttfts.append(output.metrics.time_to_first_token)
    return {
        "largest_schema_compile_ms": round(1000 * compile_s, 2),
        "ttft_cold_ms": round(1000 * ttfts[0], 1),
        "ttft_warm_ms": round(1000 * ttfts[1], 1),
    }


def main() -> None:
    args = parse_args()
    llm = LLM()
    spec = StructuredOutputsParams(json=PERSON)
    results: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.rounds):  # alternate, so drift on the machine hits both alike
        constrained, lengths = throughput(llm, [args.max_tokens] * args.batch, spec)
        results["json_schema"].append(constrained)
        results["unconstrained"].append(throughput(llm, lengths, None)[0])
    summary = {
        name: max(runs, key=lambda r: r["output_tokens_per_s"]) for name, runs in results.items()
    }
    summary["bitmask_per_step"] = bitmask_cost(llm, args.batch)
    summary.update(compile_and_ttft(llm))
    print(json.dumps({"runs": results, "best": summary}, indent=2))


if __name__ == "__main__":
    main()
