"""`pagedllm serve`: start the engine-core process, then serve HTTP until told to stop.

Shutdown: SIGTERM or Ctrl-C stops accepting connections, lets in-flight requests finish for
up to `--shutdown-timeout` seconds, cancels (aborts) the rest, stops the engine and exits 0.
If the engine process dies, /health turns 503, in-flight requests fail with a 500, new ones
get a 503, and the server exits with status 1 shortly after.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import uvicorn

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.app import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.metrics.prometheus import PrometheusMetrics

logger = logging.getLogger("pagedllm")

# After the engine dies, keep answering (503s) this long so clients and probes see why.
ENGINE_DEAD_EXIT_DELAY_S = 2.0


def default_served_model_name(engine_args: EngineArgs, model_path: str) -> str:
    """The model as the user named it; for the bundled default, its file name's stem."""
    if engine_args.model:
        return engine_args.model
    return os.path.basename(model_path).split(".")[0]


async def serve(engine_args: EngineArgs, config_overrides: dict) -> int:
    """Run the server; returns the process exit status."""
    started = time.monotonic()
    engine = AsyncLLM(engine_args)
    try:
        await engine.start()
        names = config_overrides.pop("served_model_names", None) or (
            default_served_model_name(engine_args, engine.model_config.model),
        )
        config = ServerConfig(served_model_names=tuple(names), **config_overrides)
        metrics = PrometheusMetrics(config.served_model_names[0], engine.model_config.max_model_len)
        engine.observers.append(metrics)
        server = uvicorn.Server(_uvicorn_config(build_app(engine, config, metrics), config))
        engine.on_dead.append(lambda: _exit_soon(server))
        # uvicorn re-raises the signal that stopped it once it is done; a handler of our own
        # keeps that from killing the process before it exits with its own status.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: None)
        logger.info(
            "Serving %s on http://%s:%d (started in %.1f s)",
            config.served_model_names[0],
            config.host,
            config.port,
            time.monotonic() - started,
        )
        await server.serve()
    finally:
        await engine.shutdown()
    return 1 if engine.is_dead else 0


def _exit_soon(server: uvicorn.Server) -> None:
    def stop() -> None:
        server.should_exit = True

    asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_DELAY_S, stop)


def _uvicorn_config(app, config: ServerConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        access_log=not config.disable_uvicorn_access_log,
        timeout_graceful_shutdown=config.shutdown_timeout,
        timeout_keep_alive=5,
    )


def run_server(engine_args: EngineArgs, config_overrides: dict) -> int:
    return asyncio.run(serve(engine_args, config_overrides))
