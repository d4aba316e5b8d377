"""The KV pool's pages are faulted in, in the order blocks are handed out, without touching
their contents, once the model is loaded: the first `AT_START_BYTES` before the engine takes
requests, then by a background thread between steps, at most `AHEAD_BYTES` in all; it stops
on request and with its runner."""

from __future__ import annotations

import ctypes
import gc
import itertools
import mmap
import os
import sys

import numpy as np
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.runner import kv_prefault
from pagedllm.runner.kv_prefault import KVCachePrefaulter, block_major_ranges
from pagedllm.utils import round_up
from tests.model_utils import model_runner, small_engine

PAGE = os.sysconf("SC_PAGE_SIZE")
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


@pytest.fixture(autouse=True)
def prefault_on(monkeypatch):
    """The suite leaves it off (conftest.py); the engines here fault their pools in."""
    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT", "1")


def _pool_tensor(num_blocks: int, block_floats: int) -> torch.Tensor:
    """Zeros on a fresh anonymous mapping of their own, none of its pages touched yet, and
    starting off a page boundary (as calloc's do, after its header)."""
    num_bytes = num_blocks * block_floats * 4
    mapping = mmap.mmap(-1, num_bytes + PAGE)
    raw = np.frombuffer(mapping, dtype=np.uint8)[64 : 64 + num_bytes]
    return torch.from_numpy(raw).view(torch.float32).view(num_blocks, block_floats)


def _resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(resident, all) pages of the mapping under `tensor`, by mincore(2)."""
    begin = tensor.data_ptr() // PAGE * PAGE
    end = round_up(tensor.data_ptr() + tensor.nbytes, PAGE)
    pages = (end - begin) // PAGE
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(begin, end - begin, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector), pages


def test_ranges_are_block_major_and_cover_every_page_once():
    tensors = [_pool_tensor(10, 3000), _pool_tensor(10, 3000)]  # 12,000 bytes a block
    ranges = list(block_major_ranges(tensors, chunk_blocks=4))

    def owner(address: int) -> int:
        for index, tensor in enumerate(tensors):
            if tensor.data_ptr() // PAGE * PAGE <= address < tensor.data_ptr() + tensor.nbytes:
                return index
        raise AssertionError(f"{address:#x} is in no tensor")

    # Blocks 0-3 of both tensors, then 4-7 of both, then 8-9 of both.
    assert [owner(address) for address, _ in ranges] == [0, 1] * 3
    for index, tensor in enumerate(tensors):
        mine = [(a, n) for a, n in ranges if owner(a) == index]
        assert mine[0][0] == tensor.data_ptr() // PAGE * PAGE
        for (address, length), (following, _) in itertools.pairwise(mine):
            assert address + length == following
        last_address, last_length = mine[-1]
        assert last_address + last_length >= tensor.data_ptr() + tensor.nbytes
        assert last_address + last_length - (tensor.data_ptr() + tensor.nbytes) < PAGE
        # A boundary falls where a chunk of blocks ends, rounded up to a page.
        assert mine[1][0] == round_up(tensor.data_ptr() + 4 * 12_000, PAGE)


@linux_only
def test_faults_every_page_in_and_leaves_the_contents_alone():
    keys, values = _pool_tensor(64, 2**15), _pool_tensor(64, 2**15)  # 8 MiB each
    keys[0], keys[10], values[63] = 1.5, -2.0, 3.25  # blocks a step already wrote
    assert _resident_pages(keys)[0] < _resident_pages(keys)[1]
    prefaulter = KVCachePrefaulter([keys, values]).start()
    assert prefaulter.finished.wait(60)
    for tensor in (keys, values):
        resident, pages = _resident_pages(tensor)
        assert resident == pages
    assert prefaulter.populated_bytes >= keys.nbytes + values.nbytes
    assert prefaulter.populated_bytes < keys.nbytes + values.nbytes + 4 * PAGE
    assert (keys[0] == 1.5).all() and (keys[10] == -2.0).all() and (values[63] == 3.25).all()
    assert not keys[1:10].any() and not keys[11:].any() and not values[:63].any()


def test_stop_ends_the_thread_before_it_faults_anything():
    tensor = _pool_tensor(64, 2**15)
    prefaulter = KVCachePrefaulter([tensor])
    prefaulter.stop()
    prefaulter.start()
    assert prefaulter.finished.wait(60)
    assert prefaulter.populated_bytes == 0
    prefaulter.stop()
    assert not prefaulter._thread.is_alive()


@linux_only
def test_stops_where_available_memory_would_run_low(monkeypatch):
    tensor = _pool_tensor(64, 2**15)  # 8 MiB
    readings = iter([2**40, 0])  # plenty at the first check, nothing left at the second
    monkeypatch.setattr(kv_prefault, "available_memory_bytes", lambda: next(readings))
    monkeypatch.setattr(kv_prefault, "_CHECK_MEMORY_EVERY_BYTES", 2 * 2**20)
    prefaulter = KVCachePrefaulter([tensor]).start()
    assert prefaulter.finished.wait(60)
    # The first 2 MiB (and the page the tensor starts in), then the second check stopped it.
    assert 2 * 2**20 <= prefaulter.populated_bytes <= 2 * 2**20 + PAGE
    resident, pages = _resident_pages(tensor)
    assert resident < pages


@linux_only
def test_faults_in_no_more_than_its_limit():
    tensor = _pool_tensor(64, 2**15)  # 8 MiB, in chunks of 256 KiB
    prefaulter = KVCachePrefaulter([tensor], limit_bytes=2 * 2**20).start()
    assert prefaulter.finished.wait(60)
    assert 2 * 2**20 <= prefaulter.populated_bytes <= 2 * 2**20 + PAGE
    resident, pages = _resident_pages(tensor)
    assert resident < pages // 2


def test_the_default_limit_leaves_a_large_pool_to_its_steps():
    prefaulter = KVCachePrefaulter([_pool_tensor(4, 16)])
    assert prefaulter.limit_bytes == kv_prefault.AHEAD_BYTES
    assert prefaulter.at_start_bytes == kv_prefault.AT_START_BYTES < kv_prefault.AHEAD_BYTES


@linux_only
def test_faults_the_first_part_in_at_start_and_the_rest_only_between_steps(monkeypatch):
    monkeypatch.setattr(kv_prefault, "QUIET_S", 0.02)
    tensor = _pool_tensor(64, 2**15)  # 8 MiB, in chunks of 256 KiB
    prefaulter = KVCachePrefaulter([tensor], limit_bytes=6 * 2**20, at_start_bytes=2 * 2**20)
    prefaulter.step_started()  # a step runs from before the start until below
    prefaulter.start()
    # start() returned with the first part faulted in, on its own thread.
    assert 2 * 2**20 <= prefaulter.populated_bytes <= 2 * 2**20 + PAGE
    at_start = _resident_pages(tensor)[0]
    assert at_start * PAGE >= 2 * 2**20
    # Nothing more while the step runs, however long it takes.
    assert not prefaulter.finished.wait(0.3)
    assert prefaulter.populated_bytes <= 2 * 2**20 + PAGE
    assert _resident_pages(tensor)[0] == at_start
    prefaulter.step_finished()
    assert prefaulter.finished.wait(60)
    assert 6 * 2**20 <= prefaulter.populated_bytes <= 6 * 2**20 + PAGE
    resident, pages = _resident_pages(tensor)
    assert at_start < resident < pages


def test_a_stop_during_a_step_ends_the_waiting_thread():
    prefaulter = KVCachePrefaulter([_pool_tensor(64, 2**15)], at_start_bytes=0)
    prefaulter.step_started()
    prefaulter.start()
    assert not prefaulter.finished.wait(0.1)
    prefaulter.stop(timeout_s=10)
    assert prefaulter.finished.is_set()
    assert prefaulter.populated_bytes == 0


def test_the_runner_marks_each_step_for_the_prefaulter(tiny_llama, monkeypatch):
    llm = small_engine(tiny_llama)
    prefaulter = model_runner(llm)._prefaulter
    marks = []
    monkeypatch.setattr(prefaulter, "step_started", lambda: marks.append("started"))
    monkeypatch.setattr(prefaulter, "step_finished", lambda: marks.append("finished"))
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, temperature=0))
    assert len(marks) >= 6
    assert marks == ["started", "finished"] * (len(marks) // 2)
    # A step that schedules no tokens runs no model: it leaves the prefaulter alone.
    marks.clear()
    model_runner(llm).execute_model(SchedulerOutput())
    assert marks == []


def test_the_runner_starts_faulting_in_once_its_model_is_loaded(tiny_llama, monkeypatch):
    from pagedllm.runner.model_building import ModelBuilder

    start_prefault = ModelBuilder.start_prefault
    model_loaded_then = []

    def recording(self, owner, tensors):
        model_loaded_then.append(getattr(owner, "model", None) is not None)
        return start_prefault(self, owner, tensors)

    monkeypatch.setattr(ModelBuilder, "start_prefault", recording)
    small_engine(tiny_llama)
    assert model_loaded_then == [True]


def test_tensors_must_share_their_number_of_blocks():
    with pytest.raises(ValueError, match="number of blocks"):
        KVCachePrefaulter([_pool_tensor(4, 16), _pool_tensor(5, 16)])
    with pytest.raises(ValueError, match="non-empty"):
        KVCachePrefaulter([])


@linux_only
def test_runner_faults_its_whole_pool_in(tiny_llama):
    llm = small_engine(tiny_llama)
    runner = model_runner(llm)
    prefaulter = runner._prefaulter
    assert prefaulter.finished.wait(60)
    pool_bytes = sum(t.nbytes for pair in runner.kv_caches for t in pair)
    assert prefaulter.populated_bytes >= pool_bytes
    for pair in runner.kv_caches:
        for tensor in pair:
            assert _resident_pages(tensor)[0] == _resident_pages(tensor)[1]


def test_a_dropped_runner_stops_a_prefault_still_running(tiny_llama, monkeypatch):
    stopped = []
    monkeypatch.setattr(KVCachePrefaulter, "stop", lambda self, *a: stopped.append(self))
    llm = small_engine(tiny_llama)
    prefaulter = model_runner(llm)._prefaulter
    del llm
    gc.collect()
    assert stopped == [prefaulter]


def test_turned_off_by_environment(tiny_llama, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT", "0")
    assert not kv_prefault.prefault_enabled()
    assert model_runner(small_engine(tiny_llama))._prefaulter is None
