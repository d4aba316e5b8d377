"""Multi-turn chat replay on the default model with no KV tier, a host tier and a disk tier:
wall time and prompt tokens computed.

`--conversations` (8) conversations of `--turns` (4) turns are replayed turn by turn (all
conversations' turn t in one `generate`): each turn's prompt is the whole conversation so
far (earlier user messages and answers) plus `--user-len` (128) new random token ids, and
the answer is `--answer-len` (32) greedy tokens (EOS ignored). The pool
(`--kv-cache-memory`, 64 MiB: about two whole conversations) cannot keep every
conversation's prefix between its turns, so without a tier most of each prompt is
recomputed. Configurations:
- "none": the pool alone;
- "host": `kv_offload_memory` (`--host-memory`, 512 MiB: every conversation);
- "disk": `kv_offload_dir` (a fresh folder) with only `--staging` (32 MiB) of host memory,
  so most hits are read back from disk;
- "disk-restart": a new engine on the folder "disk" wrote, replaying the same turns (a
  restart: the pool and host memory start empty).

Every configuration's answers are compared with "none"'s (greedy: they must be equal).

    .venv/bin/python -m benchmarks.kv_tiers [--conversations 8] [--turns 4]
        [--configs none,host,disk,disk-restart] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

from benchmarks.compare import machine
from pagedllm import LLM, SamplingParams


def user_turns(args: argparse.Namespace) -> list[list[list[int]]]:
    """turns[c][t]: the user message of conversation c at turn t (random token ids)."""
    rng = random.Random(args.seed)
    return [
        [[rng.randrange(100, 40000) for _ in range(args.user_len)] for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]


def replay(llm: LLM, turns: list[list[list[int]]], answer_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=answer_len, ignore_eos=True)
    histories: list[list[int]] = [[] for _ in turns]
    answers: list[list[int]] = []
    core = llm.llm_engine.engine_core
    computed_before = core.get_stats().num_computed_prompt_tokens
    num_prompt_tokens = 0
    start = time.perf_counter()
    for turn in range(len(turns[0])):
        prompts = [history + user[turn] for history, user in zip(histories, turns, strict=True)]
        num_prompt_tokens += sum(len(p) for p in prompts)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for index, output in enumerate(outputs):
            answer = list(output.outputs[0].token_ids)
            answers.append(answer)
            histories[index] = prompts[index] + answer
    seconds = time.perf_counter() - start
    stats = core.get_stats()
    return {
        "seconds": round(seconds, 2),
        "prompt_tokens": num_prompt_tokens,
        "computed_prompt_tokens": stats.num_computed_prompt_tokens - computed_before,
        "tiers": stats.kv_tiers,
        "answers": answers,
    }


def engine(args: argparse.Namespace, config: str, folder: Path) -> LLM:
    tiers = {
        "none": {},
        "host": {"kv_offload_memory": args.host_memory},
        "disk": {"kv_offload_dir": str(folder), "kv_offload_memory": args.staging},
        "disk-restart": {"kv_offload_dir": str(folder), "kv_offload_memory": args.staging},
    }[config]
    return LLM(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        disable_log_stats=True,
        **tiers,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-len", type=int, default=128)
    parser.add_argument("--answer-len", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--host-memory", default="512MiB")
    parser.add_argument("--staging", default="32MiB")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default="none,host,disk,disk-restart")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    turns = user_turns(args)
    results = {}
    with tempfile.TemporaryDirectory(prefix="pagedllm-kv-disk-") as folder:
        for config in args.configs.split(","):
            llm = engine(args, config, Path(folder))
            replay(llm, [[t[:8] for t in c[:1]] for c in turns[:1]], 2)  # warm-up
            llm.reset_prefix_cache()
            result = replay(llm, turns, args.answer_len)
            llm.llm_engine.engine_core.shutdown()  # the disk writes finish here
            del llm
            gc.collect()
            results[config] = result
            equal = result["answers"] == results[next(iter(results))]["answers"]
            print(
                f"{config:>12}: {result['seconds']:7.2f} s, prompt tokens computed "
                f"{result['computed_prompt_tokens']} of {result['prompt_tokens']}, "
                f"answers equal to the first configuration's: {equal}"
            )
            print(f"{'':>12}  tiers: {result['tiers']}")
    report = {
        "machine": machine(),
        "args": vars(args) | {"output_json": None},
        "results": {k: {**v, "answers": None} for k, v in results.items()},
    }
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
