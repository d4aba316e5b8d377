"""Small helpers every layer may use: ceiling division, pagedllm's cache directory, a free
TCP port."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for integers (b > 0), without going through floats."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """The smallest multiple of b (> 0) that is at least a."""
    return cdiv(a, b) * b


def cache_root() -> Path:
    """pagedllm's cache directory: $PAGEDLLM_CACHE_DIR, else ~/.cache/pagedllm (not created)."""
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.expanduser("~/.cache/pagedllm"))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now ("" : every address of this host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
