"""`pagedllm run-batch`'s flags and command; the batch itself is `run_batch.py`, imported
only when the command runs (it pulls in the server's request handling)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pagedllm.entrypoints.engine_flags import add_engine_args, engine_args_from, llm_from_args


def add_run_batch_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSON lines) through the offline engine",
        description="Run an OpenAI batch file (JSON lines) through the offline engine.",
    )
    parser.add_argument(
        "-i",
        "--input-file",
        required=True,
        help="the batch file: one request a line, OpenAI's batch format (required; - reads "
        "standard input)",
    )
    parser.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="where the results go, one record a line; an existing file is appended to, its "
        "custom_ids skipped (required)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model names a request's `model` may give; responses name the first "
        "(default: the model as given, or the bundled model's file name)",
    )
    parser.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="ignore unknown request fields instead of refusing the request (default: off)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let tool_choice="auto" parse tool calls from free text (needs '
        "--tool-call-parser; default: off)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=["hermes"],
        default=None,
        help="how tool calls are read from generated text (default: none)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="TEMPLATE",
        help="the chat template to render instead of the model's: a file holding a Jinja "
        "template, or the template (default: the model's)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat_template sent in a request (default: off: such a request gets a 400)",
    )
    parser.add_argument(
        "--disable-progress-bar",
        action="store_true",
        help="no tqdm progress bar while the batch runs (default: shown)",
    )
    add_engine_args(parser)
    parser.set_defaults(handler=run_batch)


def run_batch(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import default_served_model_name
    from pagedllm.entrypoints.openai.server_config import ServerConfig
    from pagedllm.entrypoints.run_batch import (
        BatchRunner,
        read_done,
        read_requests,
        write_records,
    )
    from pagedllm.frontend.chat_template import load_chat_template

    # Everything that can be wrong with the flags or the files fails here, before the model
    # loads (ValueError: `pagedllm` prints it in one line).
    chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    engine_args = engine_args_from(args)
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name or ("model",)),
        allow_unknown_fields=args.allow_unknown_fields,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    try:
        done = read_done(args.output_file)
        lines = _input_lines(args.input_file)
    except OSError as error:
        raise ValueError(f"{error.filename}: {error.strerror}") from None
    skipped: list[int] = []
    items = list(read_requests(lines, done, skipped))
    if not items:
        print(f"nothing to do: every request already has a record in {args.output_file}")
        return 0
    llm = llm_from_args(args)
    if not args.served_model_name:
        name = default_served_model_name(engine_args, llm.llm_engine.model_config.model)
        config = dataclasses.replace(config, served_model_names=(name,))
    if chat_template is not None:  # as the server: it stands in for the model's everywhere
        llm.get_tokenizer().chat_template = chat_template
    runner = BatchRunner(llm, config, use_tqdm=not args.disable_progress_bar)
    records = runner.run(items)
    write_records(args.output_file, records)
    num_ok = sum(1 for r in records if r["response"] and r["response"]["status_code"] == 200)
    print(
        f"{len(records)} requests: {num_ok} answered, {len(records) - num_ok} errors; "
        f"{len(skipped)} skipped (already in {args.output_file}); records appended to "
        f"{args.output_file}"
    )
    return 0


def _input_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    with open(path, encoding="utf-8") as file:
        return file.read().splitlines()
