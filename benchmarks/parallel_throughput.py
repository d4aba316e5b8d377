"""W1 on this host at TP=1, TP=2 and DP=2: requests/s, and each rank's weight and KV memory.

W1 is `pagedllm bench throughput`'s default workload (64 random prompts of 256 tokens, 128
generated each, ignore_eos). SmolLM2-135M's 9 heads do not split over 2 ranks, so the model
is SmolLM2's shape with 8 heads of 72 and 2 KV heads (hidden 576, 30 layers, intermediate
1536, vocabulary 49152: the same weights' size, 134.5M parameters), random weights
(`load_format="dummy"`, a directory holding only its config.json). Each layout runs in a
process of its own (the child mode of this module), one after the other: a warm-up of 8
requests, then W1, then every rank reports the bytes it holds (`Worker.memory_usage`). On a
2-core host, TP=1 runs 2 threads in one process, TP=2 two worker processes of 1 thread each
(`cpu_threads_bind=auto`), and DP=2 two engine cores stepped one after the other in the
offline `LLM`'s process.

    .venv/bin/python -m benchmarks.parallel_throughput [--layouts tp1 tp2 dp2 --model M
        --output-json F]
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.child_runs import run_children

SMOLLM2_SHAPE_TP2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 72,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}
MODEL_DIR = "benchmarks/out/parallel_throughput/smollm2-shape-8-heads"

LAYOUTS = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "dp2": {"data_parallel_size": 2},
}
WARMUP_REQUESTS = 8


def run_layout(layout: str, args: argparse.Namespace) -> dict:
    """In the child process: build the engine, warm it up, run W1, read every rank's memory."""
    from pagedllm import LLM
    from pagedllm.entrypoints.bench.datasets import DatasetConfig, load_dataset
    from pagedllm.entrypoints.bench.runs import run_throughput
    from pagedllm.model.loader import write_config_dir

    model = args.model or write_config_dir(MODEL_DIR, SMOLLM2_SHAPE_TP2)
    llm = LLM(
        model,
        load_format="dummy" if args.model is None else "auto",
        skip_tokenizer_init=args.model is None,
        kv_cache_memory=args.kv_cache_memory,
        disable_log_stats=True,
        **LAYOUTS[layout],
    )
    engine = llm.llm_engine
    config = DatasetConfig(
        name="random", num_prompts=args.num_prompts, input_len=256, output_len=128, seed=0
    )
    tokenizer = None if args.model is None else llm.get_tokenizer()
    requests = load_dataset(config, engine.model_config.vocab_size, tokenizer)
    warmup = DatasetConfig(
        name="random", num_prompts=WARMUP_REQUESTS, input_len=256, output_len=16, seed=1
    )
    run_throughput(llm, load_dataset(warmup, engine.model_config.vocab_size, None), False)
    result = run_throughput(llm, requests, use_tqdm=False)
    cores = getattr(engine, "engine_cores", None) or [engine.engine_core]
    ranks = [
        {"engine": index, **usage}
        for index, core in enumerate(cores)
        for usage in core.model_executor.collective_rpc("memory_usage")
    ]
    for core in cores:
        core.shutdown()
    return {"layout": layout, **result, "ranks": ranks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["tp1", "tp2", "dp2"], choices=LAYOUTS)
    parser.add_argument(
        "--model", default=None, help="default: SmolLM2's shape with 8 heads, dummy weights"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="per rank")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_layout(args.child, args)), flush=True)
        return 0
    common = ["--num-prompts", str(args.num_prompts), "--kv-cache-memory", args.kv_cache_memory]
    common += ["--model", args.model] if args.model else []
    children = [["--child", layout, *common] for layout in args.layouts]
    run_children("benchmarks.parallel_throughput", children, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
