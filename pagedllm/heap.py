"""Handing the C heap's free memory back to the system (glibc's `malloc_trim`).

glibc keeps what a thread frees in that thread's malloc arena, resident, for its next use:
after a large passing working set, such as a LoRA adapter's weights read and checked in a
worker thread (~43 MB for the default model's), every arena that ran one holds that much
for the life of the process, up to one arena per worker thread. Trimming after such work
returns those pages; it costs a walk over the arenas, so it follows rare, large work only.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        function = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


def trim_heap() -> bool:
    """Return every malloc arena's free pages to the system; False where the C library has
    no `malloc_trim`."""
    function = _malloc_trim()
    if function is None:
        return False
    function(0)
    return True
