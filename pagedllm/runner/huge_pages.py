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
advised alike before any write. `reuse_activation_pages` keeps a step's large activation
buffers on glibc's heap, so their pages are faulted in once, not at every step.
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


# glibc's mallopt parameters.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# A step's activations up to this size come from the heap and reuse its pages. Above
# glibc's default ceiling (32 MB, where its threshold stops adapting) every buffer was a
# fresh mapping whose pages fault in on first write: a 2,048-token prefill chunk of
# Llama-3.2-1B's shape makes 33 and 67 MB buffers, and SiLU·up into a fresh 33 MB one took
# 22.2 ms (8,193 faults) against 7.6 into a reused one. The heap keeps as much free memory
# before returning it, which a step's peak needs again at the next chunk.
ACTIVATION_HEAP_BYTES = 512 * 1024 * 1024


def reuse_activation_pages() -> bool:
    """Serve large activation buffers from glibc's heap, pages reused across steps (Linux
    glibc; elsewhere nothing changes). Returns whether glibc took the settings."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, ACTIVATION_HEAP_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, ACTIVATION_HEAP_BYTES)
    )


def release_free_heap() -> None:
    """Return the heap's free pages to the OS (glibc `malloc_trim`). Loading frees many
    tensors below glibc's mmap threshold (packing temporaries, weights moved onto huge
    pages): at 8B ~1.5 GB that would otherwise stay in the resident size."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        trim(0)
