"""Weight memory per rank of a Llama-3-8B-shaped model with random weights, at TP=1 and TP=2.

The model is a directory holding only Llama-3-8B's config.json (`load_format="dummy"`: seeded
random weights of the config's shapes, no file read, each rank building only its shard),
in bf16. Each layout runs in a process of its own: it builds the engine, generates 4 greedy
tokens from an 8-token prompt (the model runs, it does not only load), and reports each rank's
weight and KV-cache bytes (`Worker.memory_usage`) and its process's resident memory.

    .venv/bin/python -m benchmarks.real_size_memory [--tp 1 2 --output-json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.child_runs import run_children
from benchmarks.parallel_memory import LLAMA_3_8B

MODEL_DIR = "benchmarks/out/real_size_memory/llama-3-8b-shape"


def run_layout(tp: int) -> dict:
    import psutil

    from pagedllm import LLM, SamplingParams
    from pagedllm.model.loader import write_config_dir

    started = time.perf_counter()
    llm = LLM(
        write_config_dir(MODEL_DIR, LLAMA_3_8B.hf_config()),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        kv_cache_memory="64MiB",
        tensor_parallel_size=tp,
        disable_log_stats=True,
    )
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": list(range(1, 9))}], params, use_tqdm=False)
    executor = llm.llm_engine.engine_core.model_executor
    pids = getattr(executor, "worker_pids", None) or [os.getpid()]
    ranks = [
        {**usage, "rss_bytes": psutil.Process(pid).memory_info().rss}
        for usage, pid in zip(executor.collective_rpc("memory_usage"), pids, strict=True)
    ]
    llm.llm_engine.engine_core.shutdown()
    return {
        "tensor_parallel_size": tp,
        "start_s": round(load_s, 1),
        "generated": list(output[0].outputs[0].token_ids),
        "ranks": ranks,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(run_layout(args.child)), flush=True)
        return 0
    children = [["--child", str(tp)] for tp in args.tp]
    run_children("benchmarks.real_size_memory", children, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
