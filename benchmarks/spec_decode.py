"""Speculative decoding on the default model: single-stream tokens/s with and without it.

Two workloads, greedy, one request at a time (`--batch N`: N at once, the workload's prompts
repeated, as W1 runs many; with a `disable_by_batch_size` below N the step does not
speculate, and the row shows what the proposer costs when it is off):
- "copy": the model is asked to repeat a ~440-token code listing (the first class of this
  repository's `pagedllm/core/block_pool.py`), its answer opened with a code fence; the
  case prompt lookup and suffix decoding are made for (a 135M model copies most of it and
  drifts in places);
- "chat": ordinary questions, where only a model can guess what comes next.

Each configuration (`--configs`, names below) gets its own engine; every engine runs the
workload once to warm up, then `--rounds` times, rounds interleaved over the engines so the
machine's drift hits all alike. Reported: output tokens/s (median round), mean acceptance
length, and whether every output equals speculation-free decoding token for token.

    .venv/bin/python -m benchmarks.spec_decode [--workload copy|chat] [--max-tokens 256]
        [--configs off,ngram,suffix,self_gguf] [--rounds 3] [--compile] [--output-json out.json]
        [--eagle-head DIR] [--batch N]

"eagle3" (k = 3) and "eagle3_kN" (k = N) draft with the EAGLE-3 head in `--eagle-head`,
the one `python -m benchmarks.train_eagle --out DIR` trains for the default model; a
"_dM" suffix ("eagle3_d16", "eagle3_k2_d16") sets `disable_by_batch_size` M, as W1 runs it
(`pagedllm bench throughput ... --speculative-config`, benchmarks/results/spec_decode.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
# Where benchmarks.train_eagle's head is looked for unless --eagle-head says otherwise.
DEFAULT_EAGLE_HEAD = Path("~/.cache/pagedllm/eagle3-smollm2").expanduser()
EAGLE3_NAME = re.compile(r"eagle3(?:_k(\d+))?(?:_d(\d+))?")
CHAT_QUESTIONS = [
    "What is the capital of France, and what is it known for?",
    "Explain in a few sentences how a bicycle works.",
    "Give me three tips for writing clear emails.",
    "What causes the seasons on Earth?",
]
CONFIGS = {
    "off": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 8,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "self_gguf": {"method": "self_quantized", "quantization": "gguf", "num_speculative_tokens": 4},
    "self_gguf8": {
        "method": "self_quantized",
        "quantization": "gguf",
        "num_speculative_tokens": 8,
    },
    "self_int8": {"method": "self_quantized", "quantization": "int8", "num_speculative_tokens": 4},
    "gguf_alone": "gguf",  # the quantized model on its own, no speculation
}


def copy_prompts(tokenizer) -> list[str]:
    source = (ROOT / "pagedllm/core/block_pool.py").read_text()
    listing = source[source.index("\nclass ") + 1 :][:1600]
    messages = [
        {"role": "user", "content": f"Repeat this code exactly:\n```python\n{listing}\n```"}
    ]
    opening = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return [opening + "```python\n"]


def chat_prompts(tokenizer) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in CHAT_QUESTIONS
    ]


def eagle3_config(name: str, head: Path) -> dict | None:
    """The speculative_config an "eagle3[_kN][_dM]" name stands for (None: not one)."""
    match = EAGLE3_NAME.fullmatch(name)
    if match is None:
        return None
    k = int(match.group(1) or 3)
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
    if match.group(2) is not None:
        config["disable_by_batch_size"] = int(match.group(2))
    return config


def build(name: str, max_model_len: int, compile_decode: bool, eagle_head: Path) -> LLM:
    config = eagle3_config(name, eagle_head) or CONFIGS[name]
    extra = {"quantization": config} if isinstance(config, str) else {"speculative_config": config}
    return LLM(
        max_model_len=max_model_len, kv_cache_memory="512MiB", compile=compile_decode, **extra
    )


def run_once(llm: LLM, prompts: list[str], params, batch: int = 1) -> tuple[float, list[list[int]]]:
    """The prompts one at a time (`batch` 1), else `batch` of them (repeated) at once."""
    start = time.perf_counter()
    if batch == 1:
        outputs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(batch_of(prompts, batch), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [list(o.outputs[0].token_ids) for o in outputs]


def batch_of(prompts: list[str], batch: int) -> list[str]:
    """`batch` prompts: the workload's, repeated in order."""
    return [prompts[i % len(prompts)] for i in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("copy", "chat"), default="copy")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--configs", default="off,ngram,suffix,self_gguf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--eagle-head", type=Path, default=DEFAULT_EAGLE_HEAD)
    parser.add_argument(
        "--batch", type=int, default=1, help="requests at once (1: one stream, one at a time)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode steps (the target's, and a draft model's chained steps)",
    )
    args = parser.parse_args()
    names = args.configs.split(",")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engines = {name: build(name, 2048, args.compile, args.eagle_head) for name in names}
    tokenizer = next(iter(engines.values())).get_tokenizer()
    conversations = (copy_prompts if args.workload == "copy" else chat_prompts)(tokenizer)
    times: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[list[int]]] = {}
    for name, llm in engines.items():
        _, tokens[name] = run_once(llm, conversations, params, args.batch)  # warm-up
    for _ in range(args.rounds):
        for name, llm in engines.items():
            elapsed, _ = run_once(llm, conversations, params, args.batch)
            times[name].append(elapsed)
    reference = tokens.get("off")
    results = {}
    for name, llm in engines.items():
        num_tokens = sum(len(t) for t in tokens[name])
        counts = llm.get_stats().spec_decode
        results[name] = {
            "tokens": num_tokens,
            "tokens_per_s": num_tokens / statistics.median(times[name]),
            "mean_acceptance_length": counts.mean_acceptance_length if counts else None,
            "equal_to_off": None if reference is None else tokens[name] == reference,
        }
        line = f"{name:>10}: {results[name]['tokens_per_s']:7.2f} tok/s ({num_tokens} tokens)"
        if counts:
            line += f", acceptance length {counts.mean_acceptance_length:.2f}"
        if reference is not None:
            line += f", equal to off: {results[name]['equal_to_off']}"
        print(line, flush=True)
    if "off" in results:
        base = results["off"]["tokens_per_s"]
        for name, result in results.items():
            print(f"{name:>10}: {result['tokens_per_s'] / base:.2f}x off")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    engines.clear()
    gc.collect()


if __name__ == "__main__":
    main()
