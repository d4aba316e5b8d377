"""`pagedllm bench throughput|latency|serve` flags and their runners.

`throughput` and `latency` run the engine offline; `serve` is a load generator for any
OpenAI-compatible server (pagedllm's, vLLM, llama.cpp, ...) and needs no engine here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os

from pagedllm.entrypoints.bench.datasets import DATASETS, DatasetConfig, load_dataset
from pagedllm.entrypoints.bench.runs import format_table, run_latency, run_throughput, write_json
from pagedllm.entrypoints.config_file import add_config_arg
from pagedllm.entrypoints.engine_flags import add_engine_args, llm_from_args


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark the engine offline, or a server")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    throughput = kinds.add_parser("throughput", help="requests/s and tokens/s over a dataset")
    _add_dataset_args(throughput)
    throughput.add_argument(
        "--output-json",
        default=None,
        metavar="FILE",
        help="write the results to this JSON file (default: none: printed only)",
    )
    add_engine_args(throughput)
    throughput.set_defaults(handler=run_throughput_command)
    latency = kinds.add_parser("latency", help="latency of one batch, repeated")
    latency.add_argument("--batch-size", type=int, default=8, help="prompts in the batch")
    latency.add_argument("--input-len", type=int, default=32, help="tokens in each prompt")
    latency.add_argument(
        "--output-len", type=int, default=128, help="tokens generated for each prompt"
    )
    latency.add_argument("--num-iters", type=int, default=10, help="timed runs of the batch")
    latency.add_argument(
        "--num-iters-warmup", type=int, default=2, help="untimed runs of the batch before them"
    )
    latency.add_argument(
        "--output-json",
        default=None,
        metavar="FILE",
        help="write the results to this JSON file (default: none: printed only)",
    )
    add_engine_args(latency)
    latency.set_defaults(handler=run_latency_command)
    _add_serve_parser(kinds)


def _add_dataset_args(parser: argparse.ArgumentParser, seed_default: int | None = 0) -> None:
    dataset = parser.add_argument_group("dataset", "the prompts sent and their output lengths")
    dataset.add_argument(
        "--dataset-name",
        default="random",
        choices=sorted(DATASETS),
        help="random: random token ids; sharegpt-like: conversation-like lengths; "
        "shared-prefix: --num-prefixes system prompts before the questions; file: "
        "--dataset-path",
    )
    dataset.add_argument(
        "--dataset-path",
        default=None,
        metavar="FILE.jsonl",
        help="JSONL of prompt or prompt_token_ids (and output_len) lines, for --dataset-name "
        "file (default: none)",
    )
    dataset.add_argument("--num-prompts", type=int, default=64, help="requests in the run")
    dataset.add_argument("--input-len", type=int, default=256, help="prompt tokens, mean")
    dataset.add_argument("--output-len", type=int, default=128, help="output tokens, mean")
    dataset.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random lengths: drawn from len x [1 - r, 1 + r] (0: every length the mean)",
    )
    dataset.add_argument(
        "--num-prefixes", type=int, default=4, help="shared-prefix: system prompts"
    )
    dataset.add_argument(
        "--prefix-len", type=int, default=512, help="shared-prefix: tokens per system prompt"
    )
    dataset.add_argument(
        "--dataset-seed",
        type=int,
        default=seed_default,
        help="seed of the dataset's prompts"
        + (" (default: --seed's value)" if seed_default is None else ""),
    )


def _dataset_config(args: argparse.Namespace, seed: int) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset_name,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        path=args.dataset_path,
        seed=seed,
    )


def run_throughput_command(args: argparse.Namespace) -> int:
    config = _dataset_config(args, args.dataset_seed)
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


def _comma_list(kind: type) -> type:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(item.strip()) for item in text.split(",") if item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None

    return parse  # type: ignore[return-value]


def _add_serve_parser(kinds) -> None:
    serve = kinds.add_parser(
        "serve", help="latency and throughput of an OpenAI-compatible server under load"
    )
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    serve.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"],
        help="the route requests are sent to",
    )
    serve.add_argument(
        "--model",
        default=None,
        help="model requests name (default: the first id of GET /v1/models)",
    )
    _add_dataset_args(serve, seed_default=None)
    serve.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="mean arrivals in requests per second (inf: all at once)",
    )
    serve.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)"
    )
    serve.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (default: no limit)",
    )
    serve.add_argument(
        "--ignore-eos", action="store_true", help="generate each request's whole output length"
    )
    serve.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    serve.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the arrival times, and of the dataset without --dataset-seed",
    )
    serve.add_argument(
        "--api-key", default=None, help="bearer token sent (default: $OPENAI_API_KEY)"
    )
    serve.add_argument(
        "--request-timeout", type=float, default=3600.0, help="seconds one request may take"
    )
    _add_serve_prompt_args(serve)
    _add_serve_report_args(serve)
    add_config_arg(serve)
    serve.set_defaults(handler=run_serve_command)


def _add_serve_prompt_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--prompt-format",
        default="text",
        choices=["text", "token-ids"],
        help="text: send prompts as text; token-ids: as token ids (/v1/completions only)",
    )
    serve.add_argument(
        "--tokenizer",
        default=None,
        help="model dir or .gguf whose tokenizer renders prompts (default: the default model's)",
    )
    serve.add_argument(
        "--tokenizer-free",
        action="store_true",
        help="load no tokenizer: prompts are common words, one per token",
    )
    serve.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="draw prompt ids below this (default: the tokenizer's size)",
    )


def _add_serve_report_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs in milliseconds, e.g. ttft:500 tpot:50 e2el:5000, for the goodput "
        "(requests/s meeting all of them) (default: none: no goodput)",
    )
    serve.add_argument(
        "--percentile-metrics",
        type=_comma_list(str),
        default="ttft,tpot,itl,e2el",
        help="comma-separated metrics to summarize (of ttft,tpot,itl,e2el)",
    )
    serve.add_argument(
        "--metric-percentiles",
        type=_comma_list(float),
        default="90,99",
        help="comma-separated percentiles reported (mean, median and std always)",
    )
    serve.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    serve.add_argument(
        "--output-json",
        default=None,
        metavar="FILE",
        help="write the results to this JSON file (default: none: printed only)",
    )
    serve.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="plot the run's latencies to this image (default: none)",
    )


def _check_plot_dependency(plot: str | None) -> None:
    # Before the run, not after it: matplotlib is the `bench` extra, and a run takes minutes.
    if plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot needs matplotlib: pip install 'pagedllm[bench]'")


def run_serve_command(args: argparse.Namespace) -> int:
    """Exit status 0 when at least one request succeeded, 1 when every request failed."""
    from pagedllm.entrypoints.bench.serve import (
        ServeBenchConfig,
        format_report,
        load_prompt_tokenizer,
        prepare_prompts,
        run_serve_benchmark,
    )

    _check_plot_dependency(args.plot)
    config = ServeBenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        goodput=tuple(args.goodput or ()),
        percentile_metrics=args.percentile_metrics,
        metric_percentiles=args.metric_percentiles,
        prompt_format=args.prompt_format,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        request_timeout_s=args.request_timeout,
        disable_tqdm=args.disable_tqdm,
    )
    dataset = _dataset_config(args, args.seed if args.dataset_seed is None else args.dataset_seed)
    tokenizer, vocab_size = load_prompt_tokenizer(
        args.tokenizer, args.tokenizer_free, args.vocab_size
    )
    prompts = prepare_prompts(
        load_dataset(dataset, vocab_size, tokenizer), tokenizer, config.prompt_format
    )
    report = {"dataset": dataclasses.asdict(dataset), **run_serve_benchmark(config, prompts)}
    print(format_report(report))
    write_json(args.output_json, report)
    if args.plot:
        from pagedllm.entrypoints.bench.plots import plot_serve_run

        plot_serve_run(args.plot, report)
    return 0 if report["completed"] else 1
