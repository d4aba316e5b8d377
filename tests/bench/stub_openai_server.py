"""A stub OpenAI-compatible server for `bench serve` tests, with known timings.

Streams `max_tokens` one-token chunks per request: the first `--ttft-ms` after the request
arrived, then one every `--itl-ms`, each on an absolute deadline (arrival + ttft + i × itl)
so sleep jitter does not add up; then a finish chunk, a usage chunk and `[DONE]`.
With `--hold-file PATH` each stream pauses after its first token until PATH exists.
Serves POST /v1/completions, POST /v1/chat/completions and GET /v1/models. Every
`--fail-every`-th request answers HTTP 500; `--log` appends each request body, with
its path and Authorization header (JSONL).

Run as a script it binds 127.0.0.1 on a free port and prints `PORT <n>`; tests start it
in its own process with `running_stub`, so its timing never competes with the client's
event loop for the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from aiohttp import web

MODEL = "stub-model"


def _prompt_tokens(body: dict[str, Any]) -> int:
    # Token ids count as themselves, text as its words (WordCodec prompts: 1 word = 1 id).
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    prompt = body.get("prompt", "")
    return len(prompt) if isinstance(prompt, list) else len(str(prompt).split())


def _chunk(chat: bool, content: str | None, finish: str | None = None) -> dict[str, Any]:
    if chat:
        delta = {"role": "assistant", "content": ""} if content is None else {"content": content}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}
    choice = {"index": 0, "text": content or "", "finish_reason": finish}
    return {"object": "text_completion", "model": MODEL, "choices": [choice]}


async def _send(response: web.StreamResponse, payload: dict[str, Any] | str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    await response.write(f"data: {data}\n\n".encode())


async def _stream(request: web.Request, body: dict[str, Any], arrived: float) -> web.StreamResponse:
    options = request.app["options"]
    chat = request.path.endswith("/chat/completions")
    tokens = int(body.get("max_tokens") or 16)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    loop = asyncio.get_running_loop()
    # A content-free first chunk (chat's role delta, an empty text): must not count as TTFT.
    await _send(response, _chunk(chat, None))
    for index in range(tokens):
        deadline = arrived + (options.ttft_ms + index * options.itl_ms) / 1000
        await asyncio.sleep(max(0.0, deadline - loop.time()))
        await _send(response, _chunk(chat, f" tok{index}"))
        while index == 0 and options.hold_file and not os.path.exists(options.hold_file):
            await asyncio.sleep(0.01)
    await _send(response, _chunk(chat, "", finish="length"))
    usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": tokens}
    usage["total_tokens"] = usage["prompt_tokens"] + tokens
    await _send(response, {"object": "usage", "model": MODEL, "choices": [], "usage": usage})
    await _send(response, "[DONE]")
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    arrived = asyncio.get_running_loop().time()
    options = request.app["options"]
    body = await request.json()
    if options.log:
        with open(options.log, "a") as log:
            seen = {"path": request.path, "authorization": request.headers.get("Authorization")}
            log.write(json.dumps({**seen, **body}) + "\n")
    count = next(request.app["counter"])
    if options.fail_every and count % options.fail_every == 0:
        return web.json_response({"error": {"message": "stub failure"}}, status=500)
    if not body.get("stream"):
        return web.json_response({"error": {"message": "the stub only streams"}}, status=400)
    return await _stream(request, body, arrived)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


def make_app(options: argparse.Namespace) -> web.Application:
    app = web.Application()
    app["options"] = options
    app["counter"] = itertools.count(1)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


async def serve(options: argparse.Namespace) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(make_app(options), access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttft-ms", type=float, default=100.0)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--log", default=None)
    parser.add_argument("--hold-file", default=None)
    return parser.parse_args(argv)


@contextlib.contextmanager
def running_stub(*args: str, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Runs the stub in a subprocess with `args`; yields its base URL; stops it on exit."""
    from process_guard import dies_with_us  # here: the stub itself runs without tests/ on its path

    process = subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True,
        preexec_fn=dies_with_us(),
    )  # fmt: skip
    try:
        ready, _, _ = select.select([process.stdout], [], [], start_timeout_s)
        line = process.stdout.readline() if ready else ""  # type: ignore[union-attr]
        if not line.startswith("PORT "):
            raise RuntimeError(f"the stub server did not start (said {line!r})")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        process.terminate()
        process.wait(timeout=10)


if __name__ == "__main__":
    asyncio.run(serve(parse_args()))
