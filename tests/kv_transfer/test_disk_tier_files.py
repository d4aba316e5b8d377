"""The disk tier's folder is not trusted: a block file that is a link (to /dev/zero, to a big
file, to a genuine block file elsewhere), a FIFO, a folder, or a regular file of the wrong
size, or one that grows or shrinks while read, is a miss (counted, logged, deleted where it
can be), read no further than a block file's size, and never hangs or kills the reader;
writes and the start-up scan follow no link. On several ranks each rank's files are its own
(its folder, its rank in their headers), and a read counts once every rank ended it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pagedllm.kv_transfer import disk_layout
from pagedllm.kv_transfer.config import KVTierConfig
from pagedllm.kv_transfer.core.tier_manager import KVTierManager
from pagedllm.kv_transfer.ops import DiskFetch, KVTransferOps
from pagedllm.kv_transfer.runner.tier_worker import KVTierWorker

IDENTITY = "model-fp16-block4"
TOKENS = (5, 6, 7, 8)
KEY = "ab" + "0" * 30 + ".0"


class Reads:
    """Bytes read through `os.read`/`os.readv` while `counting` (how block files are read)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counting = False
        self.total = 0
        self.before_first: list = []  # callables run before the first read (then dropped)
        read, readv = os.read, os.readv

        def counted_read(fd: int, n: int) -> bytes:
            self._first()
            data = read(fd, n)
            self.total += len(data) if self.counting else 0
            return data

        def counted_readv(fd: int, buffers) -> int:
            self._first()
            n = readv(fd, buffers)
            self.total += n if self.counting else 0
            return n

        monkeypatch.setattr(os, "read", counted_read)
        monkeypatch.setattr(os, "readv", counted_readv)

    def _first(self) -> None:
        while self.counting and self.before_first:
            self.before_first.pop()()


@pytest.fixture
def reads(monkeypatch):
    return Reads(monkeypatch)


@pytest.fixture
def worker(tmp_path):
    pool = [
        torch.arange(4 * 48, dtype=torch.int32).to(torch.uint8).view(4, 48),
        torch.full((4, 16), 3, dtype=torch.uint8),
    ]
    config = KVTierConfig(IDENTITY, num_host_blocks=2, disk_dir=str(tmp_path / "tier"))
    tiers = KVTierWorker(config, pool)
    yield tiers
    tiers.shutdown()


def block_file(worker: KVTierWorker) -> Path:
    assert worker._namespace is not None
    return disk_layout.block_path(worker._namespace, KEY)


def persist(worker: KVTierWorker, block_id: int = 1) -> Path:
    """Write block `block_id` to the disk tier (on this thread); its file's path."""
    worker._persist(KEY, TOKENS, worker._block_bytes(block_id))
    return block_file(worker)


def fetch(worker: KVTierWorker, reads: Reads) -> bool:
    """Read the block back into host slot 0 (on this thread); whether it loaded."""
    reads.counting = True
    try:
        worker._fetch(KEY, 0, TOKENS)
    finally:
        reads.counting = False
    result = worker.take_result()
    assert result is not None
    ((key, slot, ok),) = result.fetched
    assert (key, slot) == (KEY, 0)
    return ok


def host_block(worker: KVTierWorker, slot: int = 0) -> bytes:
    return torch.cat([host[slot] for host in worker.host]).numpy().tobytes()


def warnings(log) -> list[str]:
    return [r.getMessage() for r in log.records if "not loaded" in r.getMessage()]


def test_an_intact_block_file_loads_reading_exactly_its_size(worker, reads):
    path = persist(worker)
    size = disk_layout.block_file_size(IDENTITY, KEY, TOKENS, worker.nbytes_per_block)
    assert path.stat().st_size == size
    assert fetch(worker, reads)
    assert host_block(worker) == worker._block_bytes(1)
    assert reads.total == size  # and the one byte more it tried was not there


def plant(kind: str, path: Path, elsewhere: Path) -> Path | None:
    """Put something other than a block file at `path`; the outside file it links to."""
    genuine = path.read_bytes()
    path.unlink()
    if kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
        return None
    target = elsewhere / "target.kvb"
    if kind == "link to a genuine block file":
        target.write_bytes(genuine)
    elif kind == "link to a big file":
        with open(target, "wb") as file:
            file.truncate(64 << 20)  # sparse: costs no disk
    if kind.startswith("link"):
        path.symlink_to(target)
        return target
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(genuine)
    elif kind == "bigger file":
        path.write_bytes(genuine + b"\0")
    elif kind == "smaller file":
        path.write_bytes(genuine[:-1])
    return None


PLANTED = {
    "link to /dev/zero": "symbolic link",
    "link to a big file": "symbolic link",
    "link to a genuine block file": "symbolic link",
    "FIFO": "FIFO",
    "directory": "directory",
    "bigger file": "wrong file size",
    "smaller file": "wrong file size",
}


@pytest.mark.parametrize("kind", list(PLANTED))
def test_anything_but_a_block_file_is_a_miss_read_unread(
    worker, reads, pagedllm_log, tmp_path, kind
):
    path = persist(worker)
    target = plant(kind, path, tmp_path)
    before = target.read_bytes() if target is not None else None

    assert not fetch(worker, reads)
    assert reads.total == 0  # refused from its metadata: not one byte read
    (message,) = warnings(pagedllm_log)
    assert KEY in message and PLANTED[kind] in message
    # Deleted (a link itself, never what it points to), so the recomputed block's write
    # replaces it; a folder in its place cannot be deleted and stays a miss.
    assert path.is_dir() if kind == "directory" else not os.path.lexists(path)
    if target is not None:
        assert target.read_bytes() == before
    persist(worker, block_id=2)
    assert fetch(worker, reads) is (kind != "directory")
    if kind != "directory":
        assert host_block(worker) == worker._block_bytes(2)


def test_a_miss_is_counted_like_a_corrupt_file(worker, tmp_path):
    """The worker's miss reaches the scheduler's side as a failed fetch: the key is
    forgotten (recomputed, written again) and counted."""
    tiers = KVTierManager(worker.config, 4, disk_keys=[KEY])
    slot = tiers._take_slot()
    assert slot is not None
    tiers.fetching[KEY] = DiskFetch(KEY, slot, TOKENS)
    plant("link to a genuine block file", persist(worker), tmp_path)
    worker._fetch(KEY, slot, TOKENS)
    tiers.apply_result(worker.take_result())
    assert tiers.stats.failed_fetches == 1 and tiers.stats.fetched_blocks == 0
    assert KEY not in tiers.disk_keys and KEY not in tiers.fetching
    assert slot in tiers.free_slots


@pytest.mark.parametrize("change", ["grows", "shrinks"])
def test_a_file_that_changes_while_read_is_a_miss(worker, reads, pagedllm_log, change):
    path = persist(worker)
    size = path.stat().st_size

    def meddle() -> None:
        if change == "grows":
            with open(path, "ab") as file:
                file.write(b"more")
        else:
            os.truncate(path, 10)

    reads.before_first.append(meddle)
    assert not fetch(worker, reads)
    assert reads.total <= size + 1
    (message,) = warnings(pagedllm_log)
    assert ("grew" if change == "grows" else "shrank") in message


def test_a_linked_subfolder_is_neither_read_nor_written(worker, reads, pagedllm_log, tmp_path):
    path = persist(worker)
    outside = tmp_path / "outside"
    path.parent.rename(outside)  # a genuine block file, in a folder outside the tier
    path.parent.symlink_to(outside, target_is_directory=True)
    assert not fetch(worker, reads)
    assert reads.total == 0
    assert (outside / path.name).exists()  # not deleted through the link either
    assert disk_layout.scan_keys(block_file(worker).parent.parent) == set()

    (outside / path.name).unlink()
    worker._persist(KEY, TOKENS, worker._block_bytes(2))
    assert list(outside.iterdir()) == []  # nothing written through the link
    assert any("could not write" in r.getMessage() for r in pagedllm_log.records)


def test_writes_follow_no_planted_link(worker, reads, tmp_path):
    path = persist(worker)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    # The block file itself, and the temporary name an older writer used, both link out.
    path.unlink()
    path.symlink_to(victim)
    path.with_name(f".{path.name}.{os.getpid()}.tmp").symlink_to(victim)
    worker._persist(KEY, TOKENS, worker._block_bytes(2))
    assert victim.read_bytes() == b"precious"
    assert not path.is_symlink() and path.is_file()
    assert fetch(worker, reads)
    assert host_block(worker) == worker._block_bytes(2)


def test_the_start_up_scan_lists_names_and_follows_no_link(worker, tmp_path):
    namespace = block_file(worker).parent.parent
    path = persist(worker)
    other = "cd" + "1" * 30 + ".0"
    fifo = disk_layout.block_path(namespace, other)
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = "ef" + "2" * 30 + ".0"
    (outside / f"{linked}{disk_layout.SUFFIX}").write_bytes(path.read_bytes())
    (namespace / "ef").symlink_to(outside, target_is_directory=True)
    # A FIFO is listed by name (and refused when read); the linked folder is not entered.
    assert disk_layout.scan_keys(namespace) == {KEY, other}


class PeerRanks:
    """A two-rank group to a `KVTierWorker` of rank 1: the other rank's reads that ended
    (key -> loaded) are what its `all_gather_object` answers for rank 0."""

    world_size, rank_in_group = 2, 1

    def __init__(self) -> None:
        self.peer: dict[str, bool] = {}
        self.calls = 0

    def all_gather_object(self, value: object) -> list[object]:
        self.calls += 1
        return [dict(self.peer), value]


@pytest.fixture
def rank_worker(tmp_path):
    ranks = PeerRanks()
    config = KVTierConfig(IDENTITY, num_host_blocks=2, disk_dir=str(tmp_path / "tier"))
    pool = [torch.full((4, 16), 7, dtype=torch.uint8)]
    tiers = KVTierWorker(config, pool, ranks)  # type: ignore[arg-type]
    yield tiers, ranks
    tiers.shutdown()


def ask_fetch(worker: KVTierWorker) -> None:
    """A step's ops ask for KEY into host slot 0; returns once this rank's read ended."""
    worker.before_forward(KVTransferOps(fetches=[DiskFetch(KEY, 0, TOKENS)]))
    assert worker._io is not None
    worker._io.submit(lambda: None).result()  # the one I/O thread: the read ran before


def test_a_rank_keeps_its_own_files_checked_against_its_rank(rank_worker, tmp_path):
    worker, _ = rank_worker
    path = persist(worker)
    assert path.parent.parent == tmp_path / "tier" / IDENTITY / "rank1"
    identity = disk_layout.rank_identity(IDENTITY, 1, 2)
    size = disk_layout.block_file_size(identity, KEY, TOKENS, worker.nbytes_per_block)
    data = disk_layout.read_block_file(path, size)
    disk_layout.decode_block_file(data, identity, KEY, TOKENS, worker.nbytes_per_block)
    with pytest.raises(disk_layout.BlockFileError, match="another model"):
        disk_layout.decode_block_file(data, IDENTITY, KEY, TOKENS, worker.nbytes_per_block)
    # The scheduler sees a block on disk only where every rank has its file.
    assert disk_layout.scan_all_ranks(tmp_path / "tier", IDENTITY, 2) == set()
    other = disk_layout.block_path(tmp_path / "tier" / IDENTITY / "rank0", KEY)
    other.parent.mkdir(parents=True)
    other.write_bytes(b"")
    assert disk_layout.scan_all_ranks(tmp_path / "tier", IDENTITY, 2) == {KEY}


def test_a_read_is_reported_once_every_rank_ended_it_loaded_only_if_all_did(rank_worker):
    worker, ranks = rank_worker
    persist(worker)
    ask_fetch(worker)  # loads here; the other rank has not finished
    assert worker.take_result() is None and ranks.calls == 1
    ranks.peer[KEY] = False  # the other rank's file was bad: a miss on every rank
    result = worker.take_result()
    assert result is not None and result.fetched == [(KEY, 0, False)]
    assert worker.take_result() is None and ranks.calls == 2  # nothing outstanding: no call
    ask_fetch(worker)
    ranks.peer[KEY] = True
    result = worker.take_result()
    assert result is not None and result.fetched == [(KEY, 0, True)]
