"""`pagedllm serve` flags: the server's own (vLLM's names) plus every engine argument, and
vLLM's serve flags that have no effect here (`vllm_flags`), accepted with a warning."""

from __future__ import annotations

import argparse
import json
import os

from pagedllm.entrypoints.engine_flags import add_engine_args, engine_args_from
from pagedllm.entrypoints.flag_help import section
from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedllm.entrypoints.openai.server_config import EVENT_LOOPS, HTTP_PARSERS
from pagedllm.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS
from pagedllm.entrypoints.vllm_flags import (
    SERVE_FLAGS,
    add_vllm_serve_flags,
    compat_warnings,
    warn_once,
)

# uvicorn's log levels (vLLM's --uvicorn-log-level choices).
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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
    parser.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve, as --model (default: --model's)",
    )
    frontend = section(parser, "frontend")
    frontend.add_argument("--host", default="127.0.0.1", help="address the server listens on")
    frontend.add_argument("--port", type=int, default=8000, help="TCP port the server listens on")
    section(parser, "tenants").add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health; repeat for "
        "several keys, each its own tenant (key-1, key-2, ...) (default: $PAGEDLLM_API_KEY)",
    )
    section(parser, "tenants").add_argument(
        "--admin-api-key",
        default=None,
        metavar="KEY",
        help="an admin's key (its tenant is 'admin'; the keys file's 'admin' column makes "
        "more): only admins may load and unload LoRA adapters at runtime and see every "
        "tenant's figures in /metrics and /dashboard/data, other keys see their own. Without "
        "a keys file, this flag or a second --api-key, the one key (or, without keys, "
        "everybody) is the admin (default: $PAGEDLLM_ADMIN_API_KEY)",
    )
    _add_tenant_args(section(parser, "tenants"))
    frontend.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names requests may give as model, the first in responses and /v1/models "
        "(default: the model as given, e.g. its path)",
    )
    _add_cors_args(frontend)
    _add_admission_args(section(parser, "admission"))
    _add_request_field_args(frontend)
    frontend.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for requests in flight to finish; the rest then end with "
        "a 503 error (an error event and [DONE] in a stream)",
    )
    frontend.add_argument(
        "--engine-iteration-timeout",
        type=float,
        default=60.0,
        help="seconds the engine core may send nothing while it has unfinished requests "
        "before it is reported stalled (/health 503, an error in the log, the "
        "pagedllm:engine_stalled gauge); vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S",
    )
    frontend.add_argument(
        "--restart-on-engine-failure",
        action="store_true",
        help="when the engine core exits or stalls, end the requests in flight with an error, "
        "start a new core and go on serving (default: the server exits 1)",
    )
    frontend.add_argument(
        "--engine-startup-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds an engine core may take to load and be ready; a restarted core that is "
        "not ready by then (stopped, or too slow) is killed and started again (default: 600 "
        "for the first start, as vLLM's VLLM_ENGINE_READY_TIMEOUT_S; a restart loads the same "
        "model on the same host, so it gets 3 times the first start's time, at least 60)",
    )
    frontend.add_argument(
        "--engine-restart-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a restarted engine core may take to be ready, the first start's deadline "
        "left as --engine-startup-timeout sets it (default: --engine-startup-timeout's rule "
        "for a restart)",
    )
    frontend.add_argument(
        "--engine-restart-attempts",
        type=int,
        default=3,
        metavar="N",
        help="with --restart-on-engine-failure: start attempts per restart, 1 s apart, then "
        "2 s, 4 s, ... (at most 30 s); when all fail the server logs why and exits 1",
    )
    observability = section(parser, "observability")
    observability.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's id, prompt lengths and sampling parameters",
    )
    observability.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's older switch: do not log requests (the default here: the inverse of "
        "--enable-log-requests, and wins over it)",
    )
    observability.add_argument(
        "--audit-log",
        default=None,
        metavar="FILE",
        help="append one JSON line per HTTP request (time, tenant, request id, route, model "
        "or adapter, prompt / cached / completion tokens, status, finish reasons, queue and "
        "total time) and per admin action (adapter load and unload, key reload) to FILE; "
        "never prompts or keys. A tenant's lines: `pagedllm audit-log FILE --tenant NAME`",
    )
    observability.add_argument(
        "--audit-log-max-bytes",
        type=int,
        default=100 * 1024 * 1024,
        metavar="BYTES",
        help="rotate the audit log past this size (FILE.1 is the newest old file)",
    )
    observability.add_argument(
        "--audit-log-backup-count",
        type=int,
        default=5,
        metavar="N",
        help="rotated audit log files kept",
    )
    observability.add_argument(
        "--audit-log-prompts",
        action="store_true",
        help="also write each request's prompt text into its audit line",
    )
    observability.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no uvicorn log line per HTTP request",
    )
    frontend.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let tool_choice="auto" parse tool calls from free text (needs --tool-call-parser)',
    )
    frontend.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how tool calls are parsed from the model's text for tool_choice=auto, by model "
        "family: hermes (Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3.1-3.3), mistral, "
        "pythonic (Llama 3.2/4, ToolACE), qwen3_coder (Qwen3-Coder) (default: none: auto "
        "tool choice is off)",
    )
    frontend.add_argument(
        "--reasoning-parser",
        choices=tuple(REASONING_PARSERS),
        default=None,
        help="return a thinking model's <think>...</think> as reasoning_content (streamed as "
        "delta.reasoning_content): deepseek_r1 (the answer starts inside the thinking), "
        "qwen3 (thinking may be absent) (default: none: the thinking stays in content)",
    )
    frontend.add_argument(
        "--responses-store-size",
        type=int,
        default=0,
        metavar="N",
        help="responses kept per API key (least recently used dropped first) for "
        "/v1/responses' previous_response_id and store (default: 0, none kept: "
        "those fields are refused)",
    )
    _add_uvicorn_args(frontend, observability)
    _add_template_and_tls_args(parser)
    _add_lora_args(section(parser, "lora"))
    add_engine_args(parser)
    add_vllm_serve_flags(parser)
    parser.set_defaults(handler=run_serve)


def _add_request_field_args(frontend: argparse._ArgumentGroup) -> None:
    frontend.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="refuse a request with a field the server does not know, at any depth, with a "
        "400 naming its path (by default such fields are logged and ignored, as vLLM does)",
    )
    frontend.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="log and ignore unknown request fields: the default now, kept for launch "
        "lines that pass it (--strict-request-fields refuses them)",
    )


def _add_uvicorn_args(
    frontend: argparse._ArgumentGroup, observability: argparse._ArgumentGroup
) -> None:
    observability.add_argument(
        "--uvicorn-log-level",
        choices=UVICORN_LOG_LEVELS,
        default="info",
        help="vLLM's: log level of uvicorn, the HTTP server (its start-up and access lines)",
    )
    frontend.add_argument(
        "--root-path",
        default=None,
        metavar="PATH",
        help="vLLM's: FastAPI root_path when the server sits behind a path-based routing "
        "proxy, e.g. /api: routes answer under PATH/v1/... as well as /v1/... (default: "
        "none)",
    )
    frontend.add_argument(
        "--http",
        choices=HTTP_PARSERS,
        default="auto",
        help="uvicorn's: the HTTP/1.1 parser; auto is httptools (C) when installed, else h11 "
        "(pure Python); both keep the header and body deadlines and the header-block limit",
    )
    frontend.add_argument(
        "--loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="uvicorn's: the API process's event loop; auto is uvloop when installed, else "
        "asyncio's own",
    )


def _add_cors_args(frontend: argparse._ArgumentGroup) -> None:
    for what in ("origins", "methods", "headers"):
        frontend.add_argument(
            f"--allowed-{what}",
            type=_json_list,
            default=["*"],
            help=f"CORS: allowed {what} as a JSON list ('*': any)",
        )
    frontend.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: let browsers send cookies and credentials",
    )


def _add_lora_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=None,
        metavar="MODULE",
        help="LoRA adapters served from the start, each name=path or a JSON object "
        '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}\'; a request '
        "runs one by naming it as its model (needs --enable-lora); repeatable (default: none)",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load and "
        "unload LoRA adapters while the server runs, for admin keys only (needs "
        "--enable-lora; an adapter is read from under --lora-path-root; --lora-modules "
        "adapters are never unloaded or replaced) (default: "
        "$PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1 or true, vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    parser.add_argument(
        "--lora-path-root",
        action="append",
        default=None,
        metavar="DIR",
        help="a directory runtime loads may read adapters under (the path's real path, "
        "links followed, must lie inside it); repeatable (default: the directories holding "
        "the --lora-modules adapters; without those, runtime loads are refused)",
    )


def _add_tenant_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help="API keys as 'name key [max_requests_per_minute=N ...]' lines, one tenant each "
        "('#' comments); SIGHUP reloads it (a bad file keeps the old keys) (default: none)",
    )
    parser.add_argument(
        "--tenant-max-requests-per-minute",
        type=int,
        default=None,
        help="each tenant's requests a minute (429 beyond); the keys file may override it "
        "(default: no limit)",
    )
    parser.add_argument(
        "--tenant-max-tokens-per-minute",
        type=int,
        default=None,
        help="each tenant's prompt + generated tokens a minute (429 while overdrawn); "
        "the keys file may override it (default: no limit)",
    )
    parser.add_argument(
        "--tenant-max-concurrent-requests",
        type=int,
        default=None,
        help="each tenant's generation requests in flight (429 beyond); the keys file may "
        "override it (default: no limit)",
    )
    parser.add_argument(
        "--share-prefix-cache-across-tenants",
        action="store_true",
        help="let tenants hit each other's cached prompt prefixes (by default each tenant's "
        "cache is its own, so no tenant can time another's prompts)",
    )


def _add_admission_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--max-num-queued-requests",
        type=int,
        default=None,
        help="engine requests (prompts x n) that may wait for their first token; an HTTP "
        "request that would pass it is refused whole with a 503 and Retry-After (default: "
        "no limit)",
    )
    parser.add_argument(
        "--max-num-queued-tokens",
        type=int,
        default=None,
        help="prompt tokens that may wait for their first token (each prompt once, whatever "
        "its n); an HTTP request that would pass it is refused whole with a 503 and "
        "Retry-After; a prompt longer than this is never admitted (default: no limit)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="largest request body in bytes, checked while it is read (413 beyond) (default: "
        "64 bytes a token times max_model_len, plus 1 MiB for messages, tools and schemas)",
    )
    parser.add_argument(
        "--request-header-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's headers before the connection "
        "is closed",
    )
    parser.add_argument(
        "--request-body-timeout",
        type=float,
        default=60.0,
        help="seconds a client may take to send a request's body, counted from its headers "
        "(408 beyond)",
    )
    parser.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=None,
        help="bytes of request line and headers the server buffers before refusing the "
        "request with a 400, whichever parser runs (default: h11's 16 KiB)",
    )


def _tenant_overrides(args: argparse.Namespace) -> dict:
    from pagedllm.entrypoints.openai.tenant_limits import TenantLimits
    from pagedllm.entrypoints.openai.tenants import load_tenants

    env_key = os.environ.get("PAGEDLLM_API_KEY")
    api_keys = tuple(args.api_key or ([env_key] if env_key else []))
    admin_api_key = args.admin_api_key or os.environ.get("PAGEDLLM_ADMIN_API_KEY") or None
    limits = TenantLimits(
        max_requests_per_minute=args.tenant_max_requests_per_minute,
        max_tokens_per_minute=args.tenant_max_tokens_per_minute,
        max_concurrent_requests=args.tenant_max_concurrent_requests,
    )
    # Read once here so a bad keys file fails before the model loads (the server reads it
    # again when it starts, and on SIGHUP).
    load_tenants(api_keys, args.api_keys_file, limits, admin_api_key)
    return {
        "api_keys": api_keys,
        "api_keys_file": args.api_keys_file,
        "admin_api_key": admin_api_key,
        "tenant_limits": limits,
        "share_prefix_cache_across_tenants": args.share_prefix_cache_across_tenants,
    }


def _add_template_and_tls_args(parser: argparse.ArgumentParser) -> None:
    frontend, tls = section(parser, "frontend"), section(parser, "tls")
    frontend.add_argument(
        "--chat-template",
        default=None,
        metavar="TEMPLATE",
        help="the chat template to render instead of the model's (needed where the model has "
        "none, e.g. a base model's GGUF): a file holding a Jinja template, or the template "
        "(default: the model's own)",
    )
    frontend.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat_template sent in a request (chat completions, /tokenize); by "
        "default such a request is refused with a 400 and only the model's template runs",
    )
    frontend.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (vLLM's): the tokenizer's configuration and chat "
        "template, behind the API key; off by default since it shows the template",
    )
    tls.add_argument(
        "--ssl-keyfile",
        default=None,
        metavar="PATH",
        help="serve HTTPS with this private key (default: none: plain HTTP)",
    )
    tls.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="PATH",
        help="serve HTTPS with this certificate (chain), together with --ssl-keyfile "
        "(default: none: plain HTTP)",
    )
    tls.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="PATH",
        help="CA certificates to verify client certificates against (default: none)",
    )
    tls.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="client certificates: 0 not asked for, 1 checked if sent, 2 required "
        "(Python's ssl.CERT_NONE/OPTIONAL/REQUIRED)",
    )


def _template_and_tls_overrides(args: argparse.Namespace) -> dict:
    from pagedllm.entrypoints.openai.server_config import check_tls

    # Checked here so a missing or mismatched file, or a broken template, fails before the
    # model loads.
    check_tls(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    from pagedllm.frontend.chat_template import load_chat_template

    chat_template = args.chat_template
    return {
        "chat_template": None if chat_template is None else load_chat_template(chat_template),
        "trust_request_chat_template": args.trust_request_chat_template,
        "enable_tokenizer_info_endpoint": args.enable_tokenizer_info_endpoint,
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": args.ssl_cert_reqs,
    }


def _lora_overrides(args: argparse.Namespace) -> dict:
    """--lora-modules parsed (a bad value fails here, before the model loads; the adapters
    themselves are read once the model's shapes are known) and the runtime-update switch."""
    from pagedllm.entrypoints.openai.lora_registry import parse_lora_module, resolved_root
    from pagedllm.entrypoints.openai.server_config import runtime_lora_updating_from_env

    modules = tuple(parse_lora_module(value) for value in args.lora_modules or ())
    if modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    allow_updating = args.allow_runtime_lora_updating
    if allow_updating and not args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    if allow_updating is None:
        # From the environment, which may be set for every server: off without LoRA.
        allow_updating = args.enable_lora and runtime_lora_updating_from_env()
    roots = tuple(args.lora_path_root or ())
    for root in roots:  # a typo fails now, not at the first load
        resolved_root(root, "--lora-path-root")
    return {
        "lora_modules": modules,
        "allow_runtime_lora_updating": allow_updating,
        "lora_path_roots": roots,
    }


def _vllm_overrides(args: argparse.Namespace) -> dict:
    """What vLLM's serve flags mean here: the unknown-fields policy, request logging,
    uvicorn's log level and root path; the rest are warned about (once, before the model
    loads)."""
    if args.strict_request_fields and args.allow_unknown_fields:
        raise ValueError("--strict-request-fields and --allow-unknown-fields exclude each other")
    warn_once(compat_warnings(args, SERVE_FLAGS))
    return {
        "allow_unknown_fields": not args.strict_request_fields,
        "enable_log_requests": args.enable_log_requests and not args.disable_log_requests,
        "uvicorn_log_level": args.uvicorn_log_level,
        "root_path": args.root_path,
    }


def run_serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    engine_args = engine_args_from(args)
    if args.model_positional is not None:
        engine_args.model = args.model_positional
    overrides = {
        "host": args.host,
        "port": args.port,
        **_tenant_overrides(args),
        "served_model_names": args.served_model_name,
        "allowed_origins": tuple(args.allowed_origins),
        "allowed_methods": tuple(args.allowed_methods),
        "allowed_headers": tuple(args.allowed_headers),
        "allow_credentials": args.allow_credentials,
        "max_num_queued_requests": args.max_num_queued_requests,
        "max_num_queued_tokens": args.max_num_queued_tokens,
        "max_request_body_bytes": args.max_request_body_bytes,
        "request_header_timeout": args.request_header_timeout,
        "request_body_timeout": args.request_body_timeout,
        "h11_max_incomplete_event_size": args.h11_max_incomplete_event_size,
        "http": args.http,
        "loop": args.loop,
        "shutdown_timeout": args.shutdown_timeout,
        "engine_iteration_timeout": args.engine_iteration_timeout,
        "restart_on_engine_failure": args.restart_on_engine_failure,
        "engine_startup_timeout": args.engine_startup_timeout,
        "engine_restart_timeout": args.engine_restart_timeout,
        "engine_restart_attempts": args.engine_restart_attempts,
        "audit_log": args.audit_log,
        "audit_log_max_bytes": args.audit_log_max_bytes,
        "audit_log_backup_count": args.audit_log_backup_count,
        "audit_log_prompts": args.audit_log_prompts,
        "disable_uvicorn_access_log": args.disable_uvicorn_access_log,
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "responses_store_size": args.responses_store_size,
        **_template_and_tls_overrides(args),
        **_lora_overrides(args),
        **_vllm_overrides(args),
    }
    return run_server(engine_args, overrides)
