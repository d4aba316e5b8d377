"""`pagedllm chat` and `pagedllm complete` (vLLM's `vllm chat` / `vllm complete`): terminal
clients of a running OpenAI-compatible server, streaming each answer as it arrives.

`chat` keeps a multi-turn conversation (`/clear` starts it over, `/exit` or end of input
quits); `complete` completes each line it reads. `-q/--quick` sends one message and exits.
The model defaults to the server's first `/v1/models` entry. A server that cannot be reached
or answers an error is reported in one line (exit status 1), never with a traceback.

Plain HTTP from the standard library: no client package needed at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, TextIO

DEFAULT_URL = "http://127.0.0.1:8000/v1"
# Seconds to wait for the server to connect or send the next bytes of an answer.
DEFAULT_TIMEOUT_S = 600.0
PROMPT = "> "


class ClientError(Exception):
    """What went wrong talking to the server, in one line for the user."""


class OpenAIClient:
    """The few calls the terminal clients make, over the server's `/v1` routes."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def first_model(self) -> str:
        with self._open("GET", "/models") as response:
            data = json.loads(response.read() or b"{}").get("data") or []
        if not data:
            raise ClientError(f"{self.base_url}/models lists no model")
        return data[0]["id"]

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """The server-sent events of a streamed POST, parsed; an error event raises."""
        with self._open("POST", path, {**body, "stream": True}) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise ClientError(f"the server failed mid-answer: {_error_text(event)}")
                yield event

    def _open(self, method: str, path: str, body: dict | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(self.base_url + path, data, headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as error:
            detail = _error_text(_json_or_none(error.read()))
            raise ClientError(f"the server answered {error.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise ClientError(f"cannot reach the server at {self.base_url}: {reason}") from None


def _json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace").strip() or None


def _error_text(body: Any) -> str:
    """OpenAI's `{"error": {"message", "param"}}` as one line; anything else as it came."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        param = f" (param: {error['param']})" if error.get("param") else ""
        return f"{error.get('message')}{param}"
    return str(body)


# ---- the conversations ------------------------------------------------------------------------


def sampling_fields(args: argparse.Namespace) -> dict:
    """The sampling fields the user set; the rest are left to the server's defaults."""
    fields: dict[str, Any] = {}
    if args.max_tokens is not None:
        fields["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        fields["temperature"] = args.temperature
    return fields


def stream_text(events: Iterator[dict], key: str, out: TextIO) -> str:
    """Print each event's text (`key`: "delta" for chat, "text" for completions) as it
    arrives; the whole answer."""
    parts = []
    for event in events:
        for choice in event.get("choices") or ():
            value = choice.get(key)
            text = (value or {}).get("content") if key == "delta" else value
            text = text or ""
            parts.append(text)
            out.write(text)
            out.flush()
    out.write("\n")
    out.flush()
    return "".join(parts)


class ChatSession:
    """One conversation: the system prompt, then user and assistant turns."""

    def __init__(self, client: OpenAIClient, model: str, args: argparse.Namespace) -> None:
        self.client = client
        self.model = model
        self.system_prompt = args.system_prompt
        self.fields = sampling_fields(args)
        self.messages: list[dict] = []
        self.clear()

    def clear(self) -> None:
        self.messages = (
            [] if not self.system_prompt else [{"role": "system", "content": self.system_prompt}]
        )

    def send(self, text: str, out: TextIO) -> str:
        """Stream the answer to `text`; the turn joins the conversation only once answered."""
        messages = [*self.messages, {"role": "user", "content": text}]
        body = {"model": self.model, "messages": messages, **self.fields}
        answer = stream_text(self.client.stream("/chat/completions", body), "delta", out)
        self.messages = [*messages, {"role": "assistant", "content": answer}]
        return answer


def read_line(prompt: str) -> str | None:
    """The next line of input (None at its end); the prompt only on a terminal."""
    try:
        return input(prompt if sys.stdin.isatty() else "")
    except EOFError:
        return None


def run_chat(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        session = ChatSession(client, args.model or client.first_model(), args)
        if args.quick is not None:
            session.send(args.quick, sys.stdout)
            return 0
    except ClientError as error:
        return _fail(error)
    print(f"Chatting with {session.model} at {client.base_url} (/clear starts over, /exit quits)")
    while (line := read_line(PROMPT)) is not None:
        command = line.strip()
        if command == "/exit":
            break
        if command == "/clear":
            session.clear()
            print("(conversation cleared)")
            continue
        if not command:
            continue
        try:
            session.send(line, sys.stdout)
        except ClientError as error:
            # The turn is dropped; the conversation so far stays, so the user can retry.
            print(f"error: {error}", file=sys.stderr)
    return 0


def run_complete(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        model = args.model or client.first_model()
        if args.quick is not None:
            _complete(client, model, args.quick, args)
            return 0
    except ClientError as error:
        return _fail(error)
    while (line := read_line(PROMPT)) is not None:
        if not line.strip():
            continue
        try:
            _complete(client, model, line, args)
        except ClientError as error:
            print(f"error: {error}", file=sys.stderr)
    return 0


def _complete(client: OpenAIClient, model: str, prompt: str, args: argparse.Namespace) -> str:
    body = {"model": model, "prompt": prompt, **sampling_fields(args)}
    return stream_text(client.stream("/completions", body), "text", sys.stdout)


def _client(args: argparse.Namespace) -> OpenAIClient:
    return OpenAIClient(args.url, args.api_key, args.timeout)


def _fail(error: ClientError) -> int:
    print(f"error: {error}", file=sys.stderr)
    return 1


# ---- the commands -----------------------------------------------------------------------------


def add_client_parsers(subparsers) -> None:
    chat = subparsers.add_parser(
        "chat", help="chat with a running server in the terminal (streamed answers)"
    )
    _add_common_args(chat)
    chat.add_argument(
        "--system-prompt",
        default=None,
        help="a system message that opens every conversation (default: none)",
    )
    chat.add_argument(
        "-q",
        "--quick",
        default=None,
        metavar="MESSAGE",
        help="send this one message, print the answer and exit (default: interactive)",
    )
    chat.set_defaults(handler=run_chat)
    complete = subparsers.add_parser(
        "complete", help="complete each line read from the terminal with a running server"
    )
    _add_common_args(complete)
    complete.add_argument(
        "-q",
        "--quick",
        default=None,
        metavar="PROMPT",
        help="complete this one prompt, print it and exit (default: read prompts line by line)",
    )
    complete.set_defaults(handler=run_complete)


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help=f"the server's OpenAI API base URL (default: {DEFAULT_URL})",
    )
    parser.add_argument(
        "--model",
        "--model-name",
        dest="model",
        default=None,
        help="the model to ask (default: the first one the server's /v1/models lists)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDLLM_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $PAGEDLLM_API_KEY, else "
        "$OPENAI_API_KEY, else none)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="most tokens per answer (default: the server's: the rest of the context for chat, "
        "16 for completions)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature, 0 for greedy (default: the server's, 1.0)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds to wait for the server to connect or send more of an answer "
        f"(default: {DEFAULT_TIMEOUT_S:g})",
    )
