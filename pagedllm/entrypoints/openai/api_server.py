"""`pagedllm serve`: start the engine-core process, then serve HTTP until told to stop.

Shutdown (`drain.py`): SIGTERM or Ctrl-C stops accepting connections, lets in-flight
requests finish for up to `--shutdown-timeout` seconds, ends the rest with a 503 in OpenAI's
shape (a stream with an error event and `[DONE]`) and aborts them, stops the engine and
exits 0. The engine-core process ignores SIGTERM and SIGINT, so a signal sent to the whole
process group (systemd's `KillMode=control-group`, Ctrl-C) drains exactly the same way.

Engine failure: a core with unfinished requests that sends nothing for
`--engine-iteration-timeout` seconds is reported stalled (/health 503, an error in the log,
`pagedllm:engine_stalled` 1) until it sends something again. If the core exits, in-flight
requests fail with a 500 (an error event in a stream), /health and new requests get a 503,
and the server exits with status 1 shortly after. With `--restart-on-engine-failure`, a core
that exits or stalls is killed and replaced instead: in-flight requests fail, new requests
are answered 503 while the new core loads and served after, and
`pagedllm:engine_restarts_total` counts the restarts. A new core not ready within
`--engine-restart-timeout` (else `--engine-startup-timeout`'s rule) is killed and started
again, `--engine-restart-attempts` times in all; then the server logs why and exits 1.
SIGHUP reloads `--api-keys-file` in a worker thread (a file that fails to load keeps the old
keys).

LoRA (`--enable-lora`): the adapters of `--lora-modules` are read and checked while the core
loads the model, and a bad one stops the server with the reason before it serves.

Data parallelism (`-dp N`): N engine-core processes behind this one; each is supervised as
above on its own (a restart replaces that core alone and fails only its requests), /health
is 503 while any of them is stalled or restarting, and the engine metrics carry its index in
their `engine` label.

`--root-path PREFIX` (vLLM's): behind a routing proxy every route answers both under PREFIX
(a proxy that keeps it) and without it (one that strips it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import uvicorn

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.app import build_app, lora_registry
from pagedllm.entrypoints.openai.audit_log import AuditLog
from pagedllm.entrypoints.openai.drain import DrainingServer, graceful_shutdown_timeout
from pagedllm.entrypoints.openai.http_protocols import (
    event_loop_factory,
    resolve_event_loop,
    resolve_http_parser,
    uvicorn_limits,
)
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.tenants import TenantRegistry, redact_access_log
from pagedllm.frontend.async_llm import AsyncLLM
from pagedllm.metrics.frontend.prometheus import PrometheusMetrics
from pagedllm.metrics.frontend.vllm_metrics import cache_config_labels

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
    audit_log = None
    try:
        names = config_overrides.pop("served_model_names", None) or (
            default_served_model_name(engine_args, engine.model_config.model),
        )
        config = ServerConfig(served_model_names=tuple(names), **config_overrides)
        # Read while the core loads the model: a bad adapter stops the server before it serves.
        loras = lora_registry(engine, config)
        engine.startup_timeout_s = config.engine_startup_timeout
        engine.restart_timeout_given_s = config.engine_restart_timeout
        engine.restart_attempts = config.engine_restart_attempts
        await engine.start()
        if config.chat_template is not None:
            # The server's template stands in for the model's everywhere one is rendered
            # (chat completions, /tokenize, tool prompts), as the model's own would.
            engine.tokenizer.chat_template = config.chat_template
        lora_config = engine.config.lora_config
        metrics = PrometheusMetrics(
            config.served_model_names[0],
            engine.model_config.max_model_len,
            num_engines=len(engine.cores),
            max_loras=None if lora_config is None else lora_config.max_loras,
            cache_info=cache_config_labels(engine.config.cache_config),
        )
        engine.observers.append(metrics)
        engine.iteration_timeout_s = config.engine_iteration_timeout
        engine.restart_on_failure = config.restart_on_engine_failure
        engine.on_stalled.append(metrics.on_engine_stalled)
        engine.on_restarted.append(metrics.on_engine_restarted)
        audit_log = open_audit_log(config)
        app = build_app(engine, config, metrics, loras, audit_log)
        asgi_app = app if config.root_path is None else RootPath(app, config.root_path)
        server = DrainingServer(_uvicorn_config(asgi_app, config), engine, config.shutdown_timeout)
        # After uvicorn set up its loggers: keys sent in a query string stay out of the log.
        redact_access_log()
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGHUP, reload_keys, app.state.tenants, audit_log
        )
        engine.on_dead.append(lambda: _exit_soon(server))
        # uvicorn re-raises the signal that stopped it once it is done; a handler of our own
        # keeps that from killing the process before it exits with its own status.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: None)
        logger.info(
            "Serving %s on %s://%s:%d (started in %.1f s)",
            config.served_model_names[0],
            "https" if config.ssl_certfile else "http",
            config.host,
            config.port,
            time.monotonic() - started,
        )
        await server.serve()
    finally:
        await engine.shutdown()
        if audit_log is not None:
            audit_log.close()
    return 1 if engine.dead_error is not None else 0


def open_audit_log(config: ServerConfig) -> AuditLog | None:
    if config.audit_log is None:
        return None
    return AuditLog(
        config.audit_log,
        config.audit_log_max_bytes,
        config.audit_log_backup_count,
        include_prompts=config.audit_log_prompts,
    )


def reload_keys(tenants: TenantRegistry, audit_log: AuditLog | None) -> None:
    """SIGHUP: the keys file read again off the event loop; once done, an admin action in
    the audit log."""

    def audited(reloaded: bool) -> None:
        if audit_log is not None:
            audit_log.admin("reload_api_keys", None, ok=reloaded, num_tenants=len(tenants.names))

    tenants.reload_in_background(audited)


def _exit_soon(server: uvicorn.Server) -> None:
    def stop() -> None:
        server.should_exit = True

    asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_DELAY_S, stop)


def _uvicorn_config(app, config: ServerConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.uvicorn_log_level,
        access_log=not config.disable_uvicorn_access_log,
        # A backstop only: DrainingServer ends what is left at shutdown_timeout itself.
        timeout_graceful_shutdown=graceful_shutdown_timeout(config.shutdown_timeout),
        timeout_keep_alive=5,
        **uvicorn_limits(config),  # header/body read deadlines, header block size
        **_tls_options(config),
    )


class RootPath:
    """ASGI wrapper for `--root-path`: a request under the prefix has it taken off its path
    (and set as the scope's root_path, so URLs the app builds keep it). Done before the app
    rather than by FastAPI's root_path, so the key check, tenant limits and audit log, which
    read the path, see the route's own path either way."""

    def __init__(self, app, root_path: str) -> None:
        self.app = app
        self.prefix = root_path.rstrip("/")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket") and self.prefix:
            scope = self._strip(scope)
        await self.app(scope, receive, send)

    def _strip(self, scope: dict) -> dict:
        path = scope["path"]
        scope = {**scope, "root_path": scope.get("root_path", "") + self.prefix}
        if path != self.prefix and not path.startswith(self.prefix + "/"):
            return scope
        scope["path"] = path[len(self.prefix) :] or "/"
        raw_path, raw_prefix = scope.get("raw_path"), self.prefix.encode()
        if isinstance(raw_path, bytes) and raw_path.startswith(raw_prefix):
            scope["raw_path"] = raw_path[len(raw_prefix) :] or b"/"
        return scope


def _tls_options(config: ServerConfig) -> dict:
    """uvicorn's TLS arguments (vLLM's flags, checked by ServerConfig); none for plain HTTP."""
    if config.ssl_certfile is None:
        return {}
    return {
        "ssl_keyfile": config.ssl_keyfile,
        "ssl_certfile": config.ssl_certfile,
        "ssl_ca_certs": config.ssl_ca_certs,
        "ssl_cert_reqs": config.ssl_cert_reqs,
    }


def run_server(engine_args: EngineArgs, config_overrides: dict) -> int:
    """Serve on the event loop `--loop` names; a parser or loop that is not installed is
    refused here, before the engine starts."""
    loop = config_overrides.get("loop", "auto")
    parser = resolve_http_parser(config_overrides.get("http", "auto"))
    logger.info("HTTP: %s parser on the %s event loop", parser, resolve_event_loop(loop))
    with asyncio.Runner(loop_factory=event_loop_factory(loop)) as runner:
        return runner.run(serve(engine_args, config_overrides))
