"""`pagedllm` command line: `pagedllm serve`, `generate`, `bench throughput|latency|serve`,
`proxy`, `run-batch`, `export-tokenizer`, and the terminal clients `chat` and `complete`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from pagedllm.entrypoints.audit_cli import add_audit_log_parser
from pagedllm.entrypoints.bench_cli import add_bench_parser
from pagedllm.entrypoints.cli_clients import add_client_parsers
from pagedllm.entrypoints.disagg_proxy import add_proxy_parser
from pagedllm.entrypoints.engine_flags import add_engine_args, llm_from_args
from pagedllm.entrypoints.flag_help import FlagParser
from pagedllm.entrypoints.run_batch_cli import add_run_batch_parser
from pagedllm.entrypoints.serve_cli import add_serve_parser
from pagedllm.entrypoints.tokenizer_files import add_export_tokenizer_parser
from pagedllm.process_exit import exit_now


def _generate_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate a completion for one prompt")
    parser.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model (default: --model's)",
    )
    sampling = parser.add_argument_group("sampling", "the prompt and how its answer is sampled")
    sampling.add_argument("--prompt", required=True, help="the prompt (required)")
    sampling.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    sampling.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    sampling.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: smallest probability mass kept"
    )
    sampling.add_argument(
        "--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)"
    )
    sampling.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability"
    )
    sampling.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="seed of this prompt's sampling (default: none: the engine's random state, "
        "seeded by --seed)",
    )
    sampling.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send the prompt as raw text instead of a one-turn chat",
    )
    add_engine_args(parser)
    parser.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from pagedllm import SamplingParams

    llm = llm_from_args(args, model=args.model or args.model_positional)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
    )
    tokenizer = llm.get_tokenizer()
    if args.no_chat_template or not getattr(tokenizer, "chat_template", None):
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    # Every subcommand's parser is a FlagParser too (add_subparsers makes parsers of its
    # parser's class):
    # sections, defaults in help, --help=SECTION, --config.
    parser = FlagParser(prog="pagedllm", description="pagedllm LLM inference engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subparsers)
    _generate_parser(subparsers)
    add_bench_parser(subparsers)
    add_proxy_parser(subparsers)
    add_run_batch_parser(subparsers)
    add_client_parsers(subparsers)
    add_audit_log_parser(subparsers)
    add_export_tokenizer_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def run() -> NoReturn:
    """The `pagedllm` command: `main`, then the process ends without the interpreter's
    teardown (a server's stop would wait about a second for it, pagedllm/process_exit.py)."""
    exit_now(main())


if __name__ == "__main__":
    run()
