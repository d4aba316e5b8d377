"""`ServerConfig`: the HTTP side's options (`pagedllm serve` flags beyond the engine's)."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field

from pagedllm.entrypoints.openai.lora_registry import LoRAModulePath
from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedllm.entrypoints.openai.tenant_limits import TenantLimits
from pagedllm.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS

# vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, under our prefix: the default of the switch.
RUNTIME_LORA_UPDATING_ENV = "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING"
# uvicorn's choices for --http and --loop (`http_protocols.py` resolves "auto").
HTTP_PARSERS = ("auto", "httptools", "h11")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    # Each key is a tenant (`tenants.py`); repr=False keeps keys out of any printed config.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_file: str | None = None
    # The `admin` tenant's key (`--admin-api-key`): runtime LoRA updates and every tenant's
    # figures. Without tenants (no keys file, at most one key) the one key is the admin.
    admin_api_key: str | None = field(default=None, repr=False)
    tenant_limits: TenantLimits = field(default_factory=TenantLimits)
    share_prefix_cache_across_tenants: bool = False
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Requests waiting for their first token beyond which new ones get a 503 (None: no limit).
    max_num_queued_requests: int | None = None
    # Admission limits (`frontend/admission.py`, `limits.py`): prompt tokens waiting for their
    # first token; request body size (None: sized from max_model_len); how long a client may
    # take to send its headers and its body; h11's bound on a header block (None: h11's).
    max_num_queued_tokens: int | None = None
    max_request_body_bytes: int | None = None
    request_header_timeout: float = 30.0
    request_body_timeout: float = 60.0
    h11_max_incomplete_event_size: int | None = None
    # uvicorn's --http and --loop (`http_protocols.py`): "auto" is httptools on uvloop when
    # installed, h11 on asyncio's loop otherwise.
    http: str = "auto"
    loop: str = "auto"
    # Unknown request fields, at any depth: logged and ignored (vLLM's behaviour), or, with
    # --strict-request-fields (False here), a 400 naming the field's path.
    allow_unknown_fields: bool = True
    shutdown_timeout: float = 30.0
    # Engine supervision: seconds a core with unfinished requests may send nothing before it
    # counts as stalled, and whether a failed (exited or stalled) core is replaced; seconds a
    # core may take to start (None: 600 for the first start, a restart 3 x the first start's
    # time, at least 60), a restarted core's own deadline (None: engine_startup_timeout's
    # rule), and start attempts per restart before the server gives up.
    engine_iteration_timeout: float = 60.0
    restart_on_engine_failure: bool = False
    engine_startup_timeout: float | None = None
    engine_restart_timeout: float | None = None
    engine_restart_attempts: int = 3
    enable_log_requests: bool = False
    # `audit_log.py`: the file (None: no audit log), its rotation, prompts in its lines.
    audit_log: str | None = None
    audit_log_max_bytes: int = 100 * 1024 * 1024
    audit_log_backup_count: int = 5
    audit_log_prompts: bool = False
    disable_uvicorn_access_log: bool = False
    # uvicorn's log level, and the path prefix a routing proxy may put in front of every
    # route (vLLM's --uvicorn-log-level and --root-path; None: no prefix).
    uvicorn_log_level: str = "info"
    root_path: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # `reasoning.py`: the thinking split into reasoning_content (None: no split).
    reasoning_parser: str | None = None
    # The chat template rendered in place of the model's (`--chat-template`); None: the model's.
    chat_template: str | None = None
    # A request's own chat template (`chat_template`) is refused unless this is set (vLLM's
    # --trust-request-chat-template); every template renders bounded either way.
    trust_request_chat_template: bool = False
    # GET /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint): off by default, as in
    # vLLM, since it shows the chat template and the tokenizer's configuration.
    enable_tokenizer_info_endpoint: bool = False
    # TLS, passed to uvicorn: certificate and key (both or neither), a CA bundle for client
    # certificates, and whether clients must present one (ssl.VerifyMode: 0, 1 or 2).
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    # LoRA adapters served from the start (`--lora-modules`; the engine needs enable_lora),
    # and whether /v1/load_lora_adapter and /v1/unload_lora_adapter exist.
    lora_modules: tuple[LoRAModulePath, ...] = ()
    allow_runtime_lora_updating: bool = False
    # Directories a runtime load may read adapters under (`--lora-path-root`); empty: the
    # directories holding the `--lora-modules` adapters (none of those: no runtime loads).
    lora_path_roots: tuple[str, ...] = ()
    # Responses kept per API key for `previous_response_id` (/v1/responses; 0: none kept).
    responses_store_size: int = 0

    def __post_init__(self) -> None:
        check_tls(self.ssl_keyfile, self.ssl_certfile, self.ssl_ca_certs, self.ssl_cert_reqs)
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_name: needs at least one non-empty name")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_num_queued_requests is not None and self.max_num_queued_requests < 1:
            raise ValueError(
                f"max_num_queued_requests must be >= 1, got {self.max_num_queued_requests}"
            )
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if not 0 < self.engine_iteration_timeout < float("inf"):
            raise ValueError(
                "engine_iteration_timeout must be a finite number of seconds > 0, got "
                f"{self.engine_iteration_timeout}"
            )
        for name in ("engine_startup_timeout", "engine_restart_timeout"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
        if self.engine_restart_attempts < 1:
            raise ValueError(
                f"engine_restart_attempts must be >= 1, got {self.engine_restart_attempts}"
            )
        for name in ("max_num_queued_tokens", "max_request_body_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.h11_max_incomplete_event_size is not None and (
            self.h11_max_incomplete_event_size < 1024
        ):
            raise ValueError(
                "h11_max_incomplete_event_size must be >= 1024 (a header block needs room), "
                f"got {self.h11_max_incomplete_event_size}"
            )
        for name, choices in (("http", HTTP_PARSERS), ("loop", EVENT_LOOPS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}")
        for name in ("request_header_timeout", "request_body_timeout"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                f"{self.tool_call_parser!r}"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                f"{self.reasoning_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (e.g. hermes)")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if self.audit_log_max_bytes < 1 or self.audit_log_backup_count < 0:
            raise ValueError(
                "audit_log_max_bytes must be >= 1 and audit_log_backup_count >= 0, got "
                f"{self.audit_log_max_bytes} and {self.audit_log_backup_count}"
            )
        if any(not key for key in self.api_keys):
            raise ValueError("api_key: must not be empty")
        if self.root_path is not None and not self.root_path.startswith("/"):
            raise ValueError(f"root_path must start with '/', got {self.root_path!r}")
        if self.admin_api_key is not None and not self.admin_api_key:
            raise ValueError("admin_api_key: must not be empty")
        self._check_lora_modules()

    def _check_lora_modules(self) -> None:
        names = [module.name for module in self.lora_modules]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"lora_modules: the name {name!r} is given more than once")
            if name in self.served_model_names:
                raise ValueError(f"lora_modules: the name {name!r} is the base model's served name")


def runtime_lora_updating_from_env() -> bool:
    """`PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING`: 1 or true (any case) turn it on."""
    return os.environ.get(RUNTIME_LORA_UPDATING_ENV, "").strip().lower() in ("1", "true")


def check_tls(
    keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int
) -> None:
    """Refuse TLS options uvicorn would fail on only once serving (or silently ignore): one of
    key and certificate, files that cannot be read, a key that does not match its certificate."""
    if (keyfile is None) != (certfile is None):
        raise ValueError("ssl_keyfile and ssl_certfile: give both or neither")
    for name, path in (("ssl_keyfile", keyfile), ("ssl_certfile", certfile)):
        if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ValueError(f"{name}: {path!r} is not a readable file")
    if ca_certs is not None and not (os.path.isfile(ca_certs) or os.path.isdir(ca_certs)):
        raise ValueError(f"ssl_ca_certs: {ca_certs!r} is not a file or directory")
    if cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError(
            f"ssl_cert_reqs must be 0 (none), 1 (optional) or 2 (required), got {cert_reqs}"
        )
    if certfile is None:
        if ca_certs is not None or cert_reqs != ssl.CERT_NONE:
            raise ValueError("ssl_ca_certs and ssl_cert_reqs: need ssl_certfile and ssl_keyfile")
        return
    if cert_reqs != ssl.CERT_NONE and ca_certs is None:
        raise ValueError("ssl_cert_reqs: checking client certificates needs ssl_ca_certs")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An empty password: an encrypted key fails here rather than prompting on a terminal.
        context.load_cert_chain(certfile, keyfile, password="")
        if ca_certs is not None:
            context.load_verify_locations(
                cafile=None if os.path.isdir(ca_certs) else ca_certs,
                capath=ca_certs if os.path.isdir(ca_certs) else None,
            )
    except (ssl.SSLError, OSError) as error:
        raise ValueError(f"ssl_certfile/ssl_keyfile: cannot load them: {error}") from None
