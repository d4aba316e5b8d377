"""Small helpers every layer may use: ceiling division and pagedllm's cache directory."""

from __future__ import annotations

import os
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
