"""`ServerConfig`: the HTTP side's options (`pagedllm serve` flags beyond the engine's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Requests waiting for their first token beyond which new ones get a 503 (None: no limit).
    max_num_queued_requests: int | None = None
    allow_unknown_fields: bool = False
    shutdown_timeout: float = 30.0
    enable_log_requests: bool = False
    disable_uvicorn_access_log: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
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
        if self.tool_call_parser not in (None, "hermes"):
            raise ValueError(f"tool_call_parser must be 'hermes', got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (e.g. hermes)")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: must not be empty")
