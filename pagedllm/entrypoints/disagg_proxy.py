"""`pagedllm proxy`: one OpenAI endpoint in front of a prefill server and a decode server.

Each completion request is sent first to a prefill server (`kv_role` "kv_producer") as a
one-token, non-streaming copy of itself, which computes the prompt and ships its KV blocks
to the decode servers; then the original request goes to a decode server ("kv_consumer"),
whose answer (status, JSON body or SSE stream) reaches the client unchanged. If the prefill
call fails or times out, the decode server simply computes the prompt itself. As vLLM's
disaggregated-prefill proxy examples; several `--prefill` / `--decode` URLs take turns.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import signal
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, suppress
from typing import TypeVar

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.config_file import add_config_arg
from pagedllm.entrypoints.openai.errors import error_response

logger = logging.getLogger("pagedllm")
T = TypeVar("T")

# Request headers sent on to both servers, and response headers relayed back.
FORWARDED_REQUEST_HEADERS = ("authorization", "x-request-id")
RELAYED_RESPONSE_HEADERS = ("retry-after", "x-request-id")
HEALTH_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 10.0


def add_proxy_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "proxy", help="route OpenAI requests through a prefill server, then a decode server"
    )
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="base URL of a prefill server (kv_producer), e.g. http://127.0.0.1:8100; "
        "repeat for several, used in turn",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="base URL of a decode server (kv_consumer); repeat for several, used in turn",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address the proxy listens on")
    parser.add_argument("--port", type=int, default=8000, help="port the proxy listens on")
    parser.add_argument(
        "--prefill-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the prefill server; past it (or on any prefill error) the "
        "request goes to the decode server, which then computes the prompt itself",
    )
    add_config_arg(parser)
    parser.set_defaults(handler=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    if args.prefill_timeout <= 0:
        raise ValueError("--prefill-timeout must be > 0")
    app = build_app(args.prefill, args.decode, args.prefill_timeout)
    logger.info(
        "Proxy on http://%s:%d: prefill %s, decode %s",
        args.host,
        args.port,
        ", ".join(args.prefill),
        ", ".join(args.decode),
    )
    # uvicorn re-raises the signal that stopped it once it is done; a handler of our own
    # makes a SIGTERM or Ctrl-C a clean exit 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def prefill_body(body: dict) -> dict:
    """The request as the prefill server gets it: one token, no stream, one sample."""
    body = {**body, "max_tokens": 1, "stream": False, "n": 1}
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens"):  # min_tokens > 1 would be refused
        body.pop(key, None)
    return body


class ClientLeft(Exception):
    """The client disconnected while the proxy waited for an upstream server."""


class DisaggProxy:
    """The upstream servers (taken in turn) and one HTTP client session for all of them."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], prefill_timeout: float):
        if not prefill_urls or not decode_urls:
            raise ValueError("the proxy needs at least one prefill and one decode URL")
        self.prefill_urls = [url.rstrip("/") for url in prefill_urls]
        self.decode_urls = [url.rstrip("/") for url in decode_urls]
        # One turn per request: with as many prefill as decode URLs, the i-th prefill server
        # pairs with the i-th decode server (a producer ships to its one peer).
        self._turns = itertools.count()
        self._next_decode = itertools.cycle(self.decode_urls)
        self.prefill_timeout = aiohttp.ClientTimeout(total=prefill_timeout)
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=0)  # no cap on concurrent streams
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def completion(self, request: Request, path: str) -> Response:
        raw = await request.body()
        headers = _forwarded_headers(request)
        turn = next(self._turns)
        prefill_url = self.prefill_urls[turn % len(self.prefill_urls)]
        decode_url = self.decode_urls[turn % len(self.decode_urls)]
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # not ours to judge: the decode server answers it
        try:
            if isinstance(body, dict):
                await _unless_client_leaves(
                    request, self._prefill(prefill_url + path, prefill_body(body), headers)
                )
            return await _unless_client_leaves(
                request, self._decode(decode_url + path, raw, headers)
            )
        except ClientLeft:  # the upstream call was cancelled: its server aborts the request
            return Response(status_code=499)

    async def _prefill(self, url: str, body: dict, headers: dict[str, str]) -> None:
        try:
            async with self.session.post(
                url, json=body, headers=headers, timeout=self.prefill_timeout
            ) as response:
                await response.read()
                if response.status // 100 == 2:
                    return
                reason = f"HTTP {response.status}"
        except TimeoutError:
            reason = f"no answer within {self.prefill_timeout.total} s"
        except aiohttp.ClientError as error:
            reason = f"{type(error).__name__}: {error}"
        logger.warning("Prefill at %s failed (%s); the decode server prefills itself", url, reason)

    async def _decode(self, url: str, raw: bytes, headers: dict[str, str]) -> Response:
        headers = {**headers, "Content-Type": "application/json"}
        try:
            upstream = await self.session.post(url, data=raw, headers=headers)
        except aiohttp.ClientError as error:
            logger.warning("Decode server %s unreachable: %s", url, error)
            return error_response(502, f"decode server unreachable: {error}")
        if upstream.content_type == "text/event-stream":
            return StreamingResponse(
                _relay(upstream),
                status_code=upstream.status,
                media_type="text/event-stream",
                headers=_relayed_headers(upstream),
            )
        try:
            return await _whole(upstream)
        except aiohttp.ClientError as error:
            logger.warning("Decode server %s failed mid-answer: %s", url, error)
            return error_response(502, f"decode server failed: {error}")

    async def get(self, path: str, request: Request) -> Response:
        url = next(self._next_decode) + path
        try:
            async with self.session.get(
                url, headers=_forwarded_headers(request), timeout=_health_timeout()
            ) as upstream:
                return await _whole(upstream)
        except (TimeoutError, aiohttp.ClientError) as error:
            return error_response(502, f"decode server {url} unreachable: {error}")

    async def health(self) -> Response:
        """200 when every decode server answers its /health with 200, else 503."""
        statuses = await asyncio.gather(*(self._health_of(url) for url in self.decode_urls))
        pairs = zip(self.decode_urls, statuses, strict=True)
        down = [f"{url}: {status}" for url, status in pairs if status != "200"]
        if down:
            return JSONResponse({"decode_unhealthy": down}, status_code=503)
        return Response(status_code=200)

    async def _health_of(self, url: str) -> str:
        try:
            async with self.session.get(url + "/health", timeout=_health_timeout()) as upstream:
                return str(upstream.status)
        except (TimeoutError, aiohttp.ClientError) as error:
            return f"unreachable ({type(error).__name__})"


def build_app(prefill_urls: list[str], decode_urls: list[str], prefill_timeout: float) -> FastAPI:
    proxy = DisaggProxy(prefill_urls, decode_urls, prefill_timeout)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    app = FastAPI(lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.completion(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.completion(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.get("/v1/models", request)

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    return app


def _forwarded_headers(request: Request) -> dict[str, str]:
    return {k: request.headers[k] for k in FORWARDED_REQUEST_HEADERS if k in request.headers}


def _relayed_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: upstream.headers[k] for k in RELAYED_RESPONSE_HEADERS if k in upstream.headers}


def _health_timeout() -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (closing its
    upstream connection) and ClientLeft raised."""
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled
        task.cancel()
        raise
    finally:
        left.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    raise ClientLeft


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the request body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(upstream: aiohttp.ClientResponse) -> Response:
    """The upstream's answer read whole and relayed as it is (status, body, content type)."""
    try:
        content = await upstream.read()
    except BaseException:
        upstream.close()
        raise
    upstream.release()
    return Response(
        content,
        status_code=upstream.status,
        media_type=upstream.headers.get("Content-Type"),
        headers=_relayed_headers(upstream),
    )


async def _relay(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The upstream's stream chunk by chunk. If the client leaves first, the upstream
    connection is closed, so the decode server aborts the request."""
    finished = False
    try:
        async for chunk in upstream.content.iter_any():
            yield chunk
        finished = True
    except aiohttp.ClientError as error:  # the client sees the stream end early
        logger.warning("Decode stream from %s broke off: %s", upstream.url, error)
    finally:
        if finished:
            upstream.release()
        else:
            upstream.close()
