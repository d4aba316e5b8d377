"""benchmarks.soak_memory and the pool ranges a core publishes: the RSS outside the KV pool
counts none of the pool's resident pages, and the soak's core goal compares that."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import psutil
import torch

from benchmarks.soak_chaos import Chaos, CoreRecord
from benchmarks.soak_memory import PAGE_BYTES, core_usage, read_ranges, resident_bytes
from pagedllm.runner.kv_pool_ranges import RANGES_DIR_ENV, publish_kv_pool_ranges

NUM_PAGES = 64


def fresh_pool() -> tuple[mmap.mmap, torch.Tensor]:
    """A page-aligned tensor none of whose pages is in memory yet, on small pages only (a
    huge page would bring its neighbours in with the first touch)."""
    memory = mmap.mmap(-1, NUM_PAGES * PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    return memory, torch.frombuffer(memory, dtype=torch.uint8)


def test_the_published_pool_counts_only_its_touched_pages(tmp_path, monkeypatch):
    monkeypatch.setenv(RANGES_DIR_ENV, str(tmp_path))
    memory, pool = fresh_pool()
    published = publish_kv_pool_ranges([pool])
    assert published == tmp_path / f"{os.getpid()}.json"
    ranges = read_ranges(tmp_path, os.getpid())
    assert ranges == [(pool.data_ptr(), NUM_PAGES * PAGE_BYTES)]
    assert resident_bytes(os.getpid(), ranges) == 0
    pool[: 10 * PAGE_BYTES : PAGE_BYTES] = 1  # one byte in each of the first 10 pages
    assert resident_bytes(os.getpid(), ranges) == 10 * PAGE_BYTES
    usage = core_usage(psutil.Process(), tmp_path)
    assert usage["rss_outside_kv_pool"] == usage["rss"] - 10 * PAGE_BYTES
    del pool
    memory.close()


def test_nothing_is_published_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(RANGES_DIR_ENV, raising=False)
    assert publish_kv_pool_ranges([torch.zeros(8)]) is None
    assert read_ranges(tmp_path, os.getpid()) is None
    assert core_usage(psutil.Process(), tmp_path)["rss_outside_kv_pool"] is None


def reading(rss: int, outside: int | None) -> dict[str, int | None]:
    return {"rss": rss, "rss_outside_kv_pool": outside, "open_fds": 16}


def test_core_growth_compares_rss_outside_the_pool():
    chaos = Chaos(1, "http://127.0.0.1:1", 300.0, 120.0, Path("unused"))
    chaos.cores = [
        CoreRecord(10, 0.0, reading(2_900, 1_000)),
        CoreRecord(11, 300.0, reading(3_000, 1_000)),  # the first restarted core
        CoreRecord(12, 600.0, reading(2_500, None)),  # its pool never published: left out
        CoreRecord(13, 900.0, reading(2_600, 1_020)),  # less of its pool touched
    ]
    growth = chaos.core_growth()
    assert growth["rss_first"] == 3_000 and growth["rss_last"] == 2_600
    assert growth["rss_outside_kv_pool_first"] == 1_000
    assert growth["rss_outside_kv_pool_last"] == 1_020
    assert growth["growth_percent"] == 2.0
    assert "outside its KV pool" in growth["definition"]


def test_ranges_sharing_a_page_count_it_once():
    memory, pool = fresh_pool()
    pool[0] = 1  # the first page, which both halves below overlap
    start = pool.data_ptr()
    halves = [(start, PAGE_BYTES // 2), (start + PAGE_BYTES // 2, PAGE_BYTES)]
    assert resident_bytes(os.getpid(), halves) == PAGE_BYTES
    del pool
    memory.close()
