"""`pagedllm serve` flags: the server's own (vLLM's names) plus every engine argument."""

from __future__ import annotations

import argparse
import json
import os

from pagedllm.entrypoints.engine_flags import add_engine_args, engine_args_from


def _json_list(value: str) -> list[str]:
    """vLLM takes CORS lists as JSON (`--allowed-origins '["https://a.example"]'`)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"expected a JSON list of strings, got {value!r}"
        ) from None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $PAGEDLLM_API_KEY)",
    )
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--allowed-origins", type=_json_list, default=["*"])
    parser.add_argument("--allowed-methods", type=_json_list, default=["*"])
    parser.add_argument("--allowed-headers", type=_json_list, default=["*"])
    parser.add_argument("--allow-credentials", action="store_true")
    parser.add_argument(
        "--max-num-queued-requests",
        type=int,
        default=None,
        help="answer 503 while this many requests wait for their first token",
    )
    parser.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="log unknown request fields instead of refusing the request",
    )
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument("--enable-log-requests", action="store_true")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let tool_choice="auto" parse tool calls from free text (needs --tool-call-parser)',
    )
    parser.add_argument("--tool-call-parser", choices=["hermes"], default=None)
    add_engine_args(parser)
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    engine_args = engine_args_from(args)
    if args.model_positional is not None:
        engine_args.model = args.model_positional
    overrides = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key or None,
        "served_model_names": args.served_model_name,
        "allowed_origins": tuple(args.allowed_origins),
        "allowed_methods": tuple(args.allowed_methods),
        "allowed_headers": tuple(args.allowed_headers),
        "allow_credentials": args.allow_credentials,
        "max_num_queued_requests": args.max_num_queued_requests,
        "allow_unknown_fields": args.allow_unknown_fields,
        "shutdown_timeout": args.shutdown_timeout,
        "enable_log_requests": args.enable_log_requests,
        "disable_uvicorn_access_log": args.disable_uvicorn_access_log,
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "tool_call_parser": args.tool_call_parser,
    }
    return run_server(engine_args, overrides)
