"""Process settings for running the model on the CPU: the allocator's thresholds.

A step allocates and frees activations of several MB each (a 2,048-token chunk's MLP input
is 25 MB). glibc serves blocks that large with fresh mmap()s and returns them with
munmap(), so each step pays page faults to zero the same memory again; raising the mmap
and trim thresholds keeps those blocks in the heap for reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's ceiling for this setting (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD_BYTES = 2**30


def tune_malloc() -> bool:
    """Raise glibc's mmap/trim thresholds; False where disabled (PAGEDLLM_MALLOC_TUNING=0)
    or not glibc."""
    if os.environ.get("PAGEDLLM_MALLOC_TUNING", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok &= mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        logger.warning("mallopt refused the allocator thresholds; left as they were")
    return ok
