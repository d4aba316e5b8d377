"""Model weights on transparent huge pages (Linux): one arena, advised before it is touched.

A decode step of a few sequences streams every weight once, so its matmuls run at memory
bandwidth. On 4 KB pages that stream needs a new TLB entry every 4 KB; on 2 MB pages the
default model's 121 projections took 10.7 ms instead of 11.2 at one row and 17.1 instead of
19.2 at four (benchmarks/results/matmul.md; single-stream decode paired against it in
benchmarks/results/single_stream.md).
The kernel's THP setting here is `madvise`, so memory gets huge pages only where asked:
the large weights are copied into one 2 MB-aligned arena advised with MADV_HUGEPAGE before
its first write. Where the advice is refused (not Linux, THP off) or PAGEDLLM_HUGE_PAGES=0,
the weights stay where they are. `mapped_zeros` gives the KV pool zeros of its own mapping,
advised alike before any write.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import mmap
import os
import sys
from collections.abc import Iterable

import numpy as np
import torch

from pagedllm.utils import round_up

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * 2**20
MIN_TENSOR_BYTES = 2**20  # smaller tensors are read too rarely for their TLB misses to count
_TENSOR_ALIGN = 64
_MADV_HUGEPAGE = 14  # linux/mman.h


def place_weights_on_huge_pages(model: torch.nn.Module) -> int:
    """Move the model's large CPU parameters and buffers into a huge-page arena, in place
    (each keeps its tensor object; only its storage changes). Returns the bytes moved."""
    if os.environ.get("PAGEDLLM_HUGE_PAGES", "1") == "0":
        return 0
    tensors = _large_cpu_tensors([*model.parameters(), *model.buffers()])
    if not tensors:
        return 0
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += round_up(tensor.nbytes, _TENSOR_ALIGN)
    arena = _advised_arena(total)
    if arena is None:
        return 0
    for tensor, offset in zip(tensors, offsets, strict=True):
        place = torch.from_numpy(arena[offset : offset + tensor.nbytes])
        place = place.view(tensor.dtype).view(tensor.shape)
        place.copy_(tensor)
        tensor.data = place  # the numpy arena stays alive as long as any view of it
    logger.info("Model weights: %.0f MB on transparent huge pages", total / 1e6)
    return total


def _large_cpu_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, found = set(), []
    for tensor in tensors:
        if id(tensor) in seen or tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        seen.add(id(tensor))
        if tensor.nbytes >= MIN_TENSOR_BYTES:
            found.append(tensor)
    return found


@functools.cache
def _libc_function(name: str):
    """A function of the Linux libc, or None where there is none (looked up once)."""
    library = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if library is None:
        return None
    return getattr(ctypes.CDLL(library, use_errno=True), name, None)


@functools.cache
def _libc_madvise():
    function = _libc_function("madvise")
    if function is not None:
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return function


def madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) on [address, address + length): 0, or the errno (ENOSYS where there is no
    Linux libc to ask)."""
    function = _libc_madvise()
    if function is None:
        return errno.ENOSYS
    return 0 if function(address, length, advice) == 0 else ctypes.get_errno()


def mapped_zeros(num_bytes: int) -> np.ndarray:
    """`num_bytes` of zeros in an anonymous mapping of their own, advised MADV_HUGEPAGE (where
    refused, small pages): no page is in RAM until written. calloc (np.zeros) gives the same
    only when it maps fresh memory; in a process that has freed much (a test suite, a
    notebook) it may hand back a dirty free chunk of the heap and clear it, every page
    then resident: a 2 GiB pool started with 512 MB of it in RAM that way."""
    return _advised_mapping(num_bytes)[0]


def _advised_mapping(num_bytes: int) -> tuple[np.ndarray, int]:
    """`mapped_zeros`' array and madvise's errno (0: advised)."""
    buffer = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(buffer, dtype=np.uint8, count=num_bytes)
    error = madvise(array.ctypes.data, num_bytes, _MADV_HUGEPAGE) if num_bytes else 0
    return array, error


def _advised_arena(num_bytes: int) -> np.ndarray | None:
    """`num_bytes` of zeroed memory starting on a huge-page boundary and advised
    MADV_HUGEPAGE before its first touch, or None where the advice cannot be given."""
    length = round_up(num_bytes, HUGE_PAGE_BYTES)
    raw, error = _advised_mapping(length + HUGE_PAGE_BYTES)
    if error:
        logger.info("MADV_HUGEPAGE refused (errno %d); weights stay on small pages", error)
        return None
    skip = -raw.ctypes.data % HUGE_PAGE_BYTES
    return raw[skip : skip + num_bytes]


def release_free_heap() -> None:
    """Return the heap's free pages to the OS (glibc `malloc_trim`). Loading frees many
    tensors below glibc's mmap threshold (packing temporaries, weights moved onto huge
    pages): at 8B ~1.5 GB that would otherwise stay in the resident size."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        trim(0)
