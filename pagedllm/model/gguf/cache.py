"""The on-disk cache of what is derived from a GGUF file (config, tokenizer, weights).

Deriving each from the file costs seconds on every start; this module owns where the
results are kept (keyed by the file's path, size and mtime, and the deriving code's
version) and how they are written (all or nothing).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

from pagedllm.utils import cache_root

logger = logging.getLogger(__name__)


def cache_dir_for(path: str, kind: str, version: str) -> str:
    """A cache directory for something derived from GGUF file `path` (by path, size, mtime)."""
    stat = os.stat(path)
    key = f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}:{version}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return str(cache_root() / kind / digest)


def save_atomically(cache_dir: str, save: Callable[[str], Any]) -> None:
    """Write into a staging directory and rename it, so a concurrent reader never sees half."""
    staging = f"{cache_dir}.tmp-{os.getpid()}"
    try:
        save(staging)
        os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
        os.replace(staging, cache_dir)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        if os.path.isdir(cache_dir):  # a process starting beside this one wrote it first
            return
        # A read-only home only costs the next start some seconds.
        logger.warning("could not write the cache %s: %s", cache_dir, error)
