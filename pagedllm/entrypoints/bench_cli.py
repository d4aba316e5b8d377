"""`pagedllm bench throughput` and `pagedllm bench latency` flags and their runners."""

from __future__ import annotations

import argparse
import dataclasses

from pagedllm.bench.datasets import DATASETS, DatasetConfig, load_dataset
from pagedllm.bench.runs import format_table, run_latency, run_throughput, write_json
from pagedllm.entrypoints.engine_flags import add_engine_args, llm_from_args


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark the engine offline")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    throughput = kinds.add_parser("throughput", help="requests/s and tokens/s over a dataset")
    throughput.add_argument("--dataset-name", default="random", choices=sorted(DATASETS))
    throughput.add_argument("--dataset-path", default=None, help="JSONL for --dataset-name file")
    throughput.add_argument("--num-prompts", type=int, default=64)
    throughput.add_argument("--input-len", type=int, default=256)
    throughput.add_argument("--output-len", type=int, default=128)
    throughput.add_argument("--range-ratio", type=float, default=0.0)
    throughput.add_argument("--num-prefixes", type=int, default=4)
    throughput.add_argument("--prefix-len", type=int, default=512)
    throughput.add_argument("--dataset-seed", type=int, default=0)
    throughput.add_argument("--output-json", default=None)
    add_engine_args(throughput)
    throughput.set_defaults(handler=run_throughput_command)
    latency = kinds.add_parser("latency", help="latency of one batch, repeated")
    latency.add_argument("--batch-size", type=int, default=8)
    latency.add_argument("--input-len", type=int, default=32)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--num-iters", type=int, default=10)
    latency.add_argument("--num-iters-warmup", type=int, default=2)
    latency.add_argument("--output-json", default=None)
    add_engine_args(latency)
    latency.set_defaults(handler=run_latency_command)


def run_throughput_command(args: argparse.Namespace) -> int:
    config = DatasetConfig(
        name=args.dataset_name,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        path=args.dataset_path,
        seed=args.dataset_seed,
    )
    llm = llm_from_args(args)
    requests = load_dataset(config, llm.llm_engine.model_config.vocab_size, llm.get_tokenizer())
    result = run_throughput(llm, requests)
    print(format_table("Offline throughput", result))
    write_json(args.output_json, {"dataset": dataclasses.asdict(config), **result})
    return 0


def run_latency_command(args: argparse.Namespace) -> int:
    if min(args.batch_size, args.input_len, args.output_len, args.num_iters) < 1:
        raise ValueError("batch-size, input-len, output-len and num-iters must be >= 1")
    llm = llm_from_args(args)
    result = run_latency(
        llm, args.batch_size, args.input_len, args.output_len, args.num_iters, args.num_iters_warmup
    )
    rows = {"mean latency (s)": result["mean_s"]}
    rows.update({f"p{q} latency (s)": v for q, v in result["percentiles_s"].items()})
    rows.update(
        {f"p{q} per output token (ms)": v for q, v in result["per_output_token_ms"].items()}
    )
    print(format_table("Latency", rows))
    write_json(args.output_json, result)
    return 0
