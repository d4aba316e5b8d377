"""Publishing where the CPU KV pool (and the host tier's buffers) lie in the engine's memory,
for accounting outside them.

The pool's pages are faulted in lazily (`ModelBuilder.zeros`, kv_prefault.py), and the host
tier's as blocks are offloaded to it, so an engine core's RSS at a given age varies with how
much of them it touched, by hundreds of MB.
A soak that compares RSS across cores wants the RSS outside the pool, and /proc/<pid>/smaps
cannot say which pages are the pool's: its tensors are anonymous mappings like many others
in the process (`huge_pages.mapped_zeros`), and the host tier's come from calloc, which may
place them in the brk heap beside everything else. So, when PAGEDLLM_KV_POOL_RANGES_DIR
names a folder, the core writes `<pid>.json` there: the pool tensors' [start address,
bytes] pairs, which an observer reads the resident pages of in /proc/<pid>/pagemap
(benchmarks/soak_memory.py).
Nothing is written otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

RANGES_DIR_ENV = "PAGEDLLM_KV_POOL_RANGES_DIR"


def publish_kv_pool_ranges(tensors: list[torch.Tensor]) -> Path | None:
    """Write the CPU pool tensors' address ranges where the env var asks; the file's path."""
    folder = os.environ.get(RANGES_DIR_ENV)
    if not folder or any(tensor.device.type != "cpu" for tensor in tensors):
        return None
    storages = [tensor.untyped_storage() for tensor in tensors]
    ranges = [[storage.data_ptr(), storage.nbytes()] for storage in storages]
    path = Path(folder) / f"{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ranges))
    return path
