"""`pagedllm run-batch`'s flags and command; the batch itself is `run_batch.py`, imported
only when the command runs (it pulls in the server's request handling)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from typing import BinaryIO

from pagedllm.entrypoints.engine_flags import add_engine_args, engine_args_from, llm_from_args
from pagedllm.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS

# As run_batch.DEFAULT_MAX_LINE_BYTES (not imported: this module loads with every command).
DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024


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
        help="where the results go, one record a line, written as each is ready; an existing "
        "file is refused unless --resume is given (required)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an earlier run into the same output file: keep its records, skip the "
        "lines they answer (by custom_id; lines without one by line number) and append the "
        "rest; a last record cut short by a kill is dropped first (default: off)",
    )
    parser.add_argument(
        "--max-line-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_LINE_BYTES,
        metavar="BYTES",
        help="a longer input line is answered with an error record, unread "
        f"(default: {DEFAULT_MAX_LINE_BYTES})",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model names a request's `model` may give; responses name the first "
        "(default: the model as given, or the bundled model's file name)",
    )
    parser.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="answer a body with a field the server does not know, at any depth, with a 400 "
        "naming its path (by default such fields are logged and ignored, as by the server)",
    )
    parser.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="log and ignore unknown request fields: the default now, kept for command lines "
        "that pass it",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let tool_choice="auto" parse tool calls from free text (needs '
        "--tool-call-parser; default: off)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
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
        DoneSet,
        RecordWriter,
        item_line,
        read_done,
        read_lines,
        read_requests,
    )
    from pagedllm.frontend.chat_template import load_chat_template

    # Everything that can be wrong with the flags or the files fails here, before the model
    # loads (ValueError: `pagedllm` prints it in one line).
    chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    engine_args = engine_args_from(args)
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name or ("model",)),
        allow_unknown_fields=not args.strict_request_fields,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    _check_output(args.output_file, args.resume)
    skipped: list[int] = []
    try:
        done = read_done(args.output_file) if args.resume else DoneSet()
        with _open_input(args.input_file) as file:
            lines = read_lines(file, args.max_line_bytes)
            items = list(read_requests(lines, done, skipped, args.max_line_bytes))
    except OSError as error:
        raise ValueError(f"{error.filename}: {error.strerror}") from None
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
    with open(args.output_file, "ab") as output:
        writer = RecordWriter(output, [item_line(item) for item in items])
        runner.run(items, writer)
    written, answered = writer.num_written, writer.num_answered
    print(
        f"{written} requests: {answered} answered, {written - answered} errors; "
        f"{len(skipped)} skipped (already in {args.output_file}); records appended to "
        f"{args.output_file}"
    )
    return 0


def _check_output(path: str, resume: bool) -> None:
    """Without --resume, records already in the output file would be appended to by a new
    run (answered twice) or lost by overwriting: refuse before the model loads."""
    if not resume and os.path.exists(path) and os.path.getsize(path) > 0:
        raise ValueError(
            f"output_file: {path} exists; pass --resume to keep its records and answer only "
            "the lines they do not, or remove it"
        )


def _open_input(path: str) -> contextlib.AbstractContextManager[BinaryIO]:
    """The input as bytes: each line is decoded on its own, so one that is no UTF-8 is that
    line's error, not the file's."""
    if path == "-":
        return contextlib.nullcontext(sys.stdin.buffer)  # standard input is not ours to close
    return open(path, "rb")


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number
