"""`KVTierWorker`: the runner's side of the KV tiers: the host tier's bytes, the disk tier's
files and the link to a peer instance. It carries out each step's `KVTransferOps` (the
scheduler's `KVTierManager` decides them) and reports what ended.

A block is moved as raw bytes: one row (dim 0) of every tensor of the pool (keys, values and,
for a quantized cache, their scales), so any cache dtype moves unchanged and a loaded block
is bit for bit the block that was saved.

Several ranks: each carries out the same ops on its own bytes (its heads, its stage's
layers), the disk tier in files of its own (disk_layout.py). A disk read ends on each rank
in its own time, and with its own outcome, but the scheduler hears only one rank: the ranks
agree (`_agree_on_fetches`) and report a read once it ended on all of them, loaded only if
it loaded on all. Until then its host slot is not handed out again, so no rank's read can
land in a slot reused for another block.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.kv_transfer import disk_layout
from pagedllm.kv_transfer.config import KVTierConfig
from pagedllm.kv_transfer.ops import KVTransferOps, KVTransferResult, RequestSend
from pagedllm.kv_transfer.runner.transport import KVBlockPayload, KVReceiver, KVSender

logger = logging.getLogger("pagedllm")


def host_zeros(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Zeroed host bytes: calloc'd on the CPU (pages mapped lazily, so a large tier costs
    nothing until used), pinned for an accelerator (fast copies to and from it)."""
    if device.type == "cpu":
        return torch.from_numpy(np.zeros(shape, dtype=np.uint8))
    return torch.zeros(shape, dtype=torch.uint8, pin_memory=True)


class KVTierWorker:
    """`ranks`: the group of all the engine's ranks when there are several (None: one)."""

    def __init__(
        self, config: KVTierConfig, pool: list[torch.Tensor], ranks: GroupCoordinator | None = None
    ) -> None:
        self.config = config
        self._ranks = ranks if ranks is not None and ranks.world_size > 1 else None
        rank, world_size = (0, 1)
        if self._ranks is not None:
            rank, world_size = self._ranks.rank_in_group, self._ranks.world_size
        # What this rank's block files are checked against (its rank included if several).
        self._file_identity = disk_layout.rank_identity(config.identity, rank, world_size)
        # Disk reads asked for and not yet agreed on by every rank (the same count on each).
        self._num_unagreed = 0
        # This rank's reads that ended and wait for the others': key -> (slot, loaded).
        self._ended: dict[str, tuple[int, bool]] = {}
        # Every pool tensor as bytes, block id on dim 0.
        self.pool = [t.view(torch.uint8).view(t.shape[0], -1) for t in pool]
        self.device = pool[0].device
        self.block_nbytes = [t.shape[1] for t in self.pool]
        self.nbytes_per_block = sum(self.block_nbytes)
        self.host = [
            host_zeros((config.num_host_blocks, n), self.device) for n in self.block_nbytes
        ]
        self._lock = threading.Lock()
        self._fetch_ended = threading.Event()
        self._fetched: list[tuple[str, int, bool]] = []
        self._sent: list[tuple[str, bool, float]] = []
        self._namespace: Path | None = None
        self._io: ThreadPoolExecutor | None = None
        if config.disk_dir is not None:
            self._namespace = disk_layout.rank_namespace(
                config.disk_dir, config.identity, rank, world_size
            )
            self._namespace.mkdir(parents=True, exist_ok=True)
            # One thread: writes and reads of the same key run in the order asked.
            self._io = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-kv-disk")
        transfer = config.transfer
        self._sender: KVSender | None = None
        self._receiver: KVReceiver | None = None
        # Received blocks not yet taken into the host tier: key -> (token ids, bytes).
        self._inbox: dict[str, tuple[tuple[int, ...], bytes]] = {}
        self._reported: set[str] = set()
        if transfer is not None and transfer.sends:
            assert transfer.peer is not None
            self._sender = KVSender(transfer.peer, config.identity, transfer.timeout_s)
        if transfer is not None and transfer.receives:
            self._inbox_limit = transfer.kv_buffer_size
            self._receiver = KVReceiver(
                transfer.kv_ip,
                transfer.kv_port,
                config.identity,
                self._on_blocks,
                max_message_bytes=transfer.kv_buffer_size + (1 << 20),
            )

    @property
    def receiver_port(self) -> int | None:
        return None if self._receiver is None else self._receiver.port

    # ---- one step ---------------------------------------------------------------------
    def before_forward(self, ops: KVTransferOps | None) -> None:
        if ops is None:
            return
        with self._lock:
            received = {key: self._inbox.pop(key, None) for key, _ in ops.ingests}
            for key in ops.drops:
                self._inbox.pop(key, None)
                self._reported.discard(key)
            self._reported.difference_update(received)
        for key, slot in ops.ingests:
            entry = received[key]
            if entry is not None:
                self._write_host(slot, entry[1])
        if ops.saves:
            self._copy([b for b, _ in ops.saves], [s for _, s in ops.saves], to_host=True)
        if ops.loads:
            self._copy([b for _, b in ops.loads], [s for s, _ in ops.loads], to_host=False)
        assert self._io is not None or not ops.fetches
        self._num_unagreed += len(ops.fetches)
        for fetch in ops.fetches:
            self._io.submit(self._fetch, fetch.key, fetch.slot, fetch.token_ids)

    def after_forward(self, ops: KVTransferOps | None) -> None:
        if ops is None:
            return
        for record in ops.persists:
            assert self._io is not None
            data = self._block_bytes(record.block_id)
            self._io.submit(self._persist, record.key, record.token_ids, data)
        for send in ops.sends:
            self._send(send)

    def take_result(self) -> KVTransferResult | None:
        """What ended since the last call (every rank calls this once a step)."""
        with self._lock:
            fetched, sent = self._fetched, self._sent
            self._fetched, self._sent = [], []
            self._fetch_ended.clear()
        if self._ranks is not None:
            fetched = self._agree_on_fetches(fetched)
        result = KVTransferResult(fetched, sent)
        return result if result else None

    def _agree_on_fetches(self, ended: list[tuple[str, int, bool]]) -> list[tuple[str, int, bool]]:
        """The disk reads that ended on every rank, loaded where every rank loaded its bytes
        (one rank's bad or missing file makes the block a miss, recomputed on all). A
        collective, called only while reads are outstanding: every rank gets the same ops
        and agrees on the same reads, so all call it in the same steps."""
        assert self._ranks is not None
        self._ended.update((key, (slot, ok)) for key, slot, ok in ended)
        if not self._num_unagreed:
            return []
        views = self._ranks.all_gather_object({k: ok for k, (_, ok) in self._ended.items()})
        agreed = []
        for key in sorted(set.intersection(*(set(view) for view in views))):
            slot, _ = self._ended.pop(key)
            agreed.append((key, slot, all(view[key] for view in views)))
        self._num_unagreed -= len(agreed)
        return agreed

    def wait_for_fetches(self, timeout_s: float) -> None:
        """A step with nothing to run waits (a little) for disk reads instead of spinning."""
        self._fetch_ended.wait(timeout_s)

    def take_received(self) -> list[tuple[str, tuple[int, ...]]]:
        """Blocks received since the last call: (key, token ids); their bytes wait in the
        inbox until the scheduler gives them host slots (or drops them)."""
        with self._lock:
            new = [(k, tokens) for k, (tokens, _) in self._inbox.items() if k not in self._reported]
            self._reported.update(k for k, _ in new)
        return new

    def shutdown(self) -> None:
        """Finish the disk writes asked for (a restart finds them), close the peer link."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    # ---- bytes ------------------------------------------------------------------------
    def _copy(self, block_ids: list[int], slots: list[int], to_host: bool) -> None:
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        host_slots = torch.tensor(slots, dtype=torch.long)
        for pool, host in zip(self.pool, self.host, strict=True):
            if to_host:
                host[host_slots] = pool[blocks].to(host.device)
            else:
                pool[blocks] = host[host_slots].to(pool.device, non_blocking=True)

    def _block_bytes(self, block_id: int) -> bytes:
        rows = [pool[block_id].cpu() for pool in self.pool]
        return torch.cat(rows).numpy().tobytes()

    def _write_host(self, slot: int, data: bytes) -> None:
        row = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for host, part in zip(self.host, row.split(self.block_nbytes), strict=True):
            host[slot] = part

    # ---- disk (the I/O thread) --------------------------------------------------------
    def _persist(self, key: str, token_ids: tuple[int, ...], data: bytes) -> None:
        assert self._namespace is not None
        try:
            encoded = disk_layout.encode_block_file(self._file_identity, key, token_ids, data)
            disk_layout.write_block_file(disk_layout.block_path(self._namespace, key), encoded)
        except OSError as error:
            logger.warning("KV disk tier: could not write block %s: %s", key, error)

    def _fetch(self, key: str, slot: int, token_ids: tuple[int, ...]) -> None:
        """Read one block file into a host slot; anything wrong with it (a link, not a
        regular file, the wrong size, a failed check) is a miss: the block is recomputed."""
        assert self._namespace is not None
        path = disk_layout.block_path(self._namespace, key)
        identity, nbytes = self._file_identity, self.nbytes_per_block
        ok = False
        try:
            size = disk_layout.block_file_size(identity, key, token_ids, nbytes)
            data = disk_layout.read_block_file(path, size)
            self._write_host(
                slot, disk_layout.decode_block_file(data, identity, key, token_ids, nbytes)
            )
            ok = True
        except Exception as error:  # whatever the folder holds, a miss, never a crash
            logger.warning("KV disk tier: block %s not loaded (%s); it is recomputed", key, error)
            disk_layout.remove_block_file(path)  # a bad file is rewritten when recomputed
        with self._lock:
            self._fetched.append((key, slot, ok))
            self._fetch_ended.set()

    # ---- the peer link ----------------------------------------------------------------
    def _send(self, send: RequestSend) -> None:
        assert self._sender is not None
        start = time.perf_counter()
        payloads = [
            KVBlockPayload(r.key, list(r.token_ids), None, self._block_bytes(r.block_id))
            for r in send.blocks
        ]
        ok = self._sender.send(payloads)
        with self._lock:
            self._sent.append((send.request_id, ok, time.perf_counter() - start))

    def _on_blocks(self, blocks: list[KVBlockPayload]) -> None:
        """The receiver thread: keep a producer's blocks until the scheduler takes them."""
        for block in blocks:
            if len(block.data) != self.nbytes_per_block:
                raise ValueError(
                    f"block {block.key}: {len(block.data)} bytes, this cache's blocks have "
                    f"{self.nbytes_per_block}"
                )
        with self._lock:
            held = len(self._inbox) * self.nbytes_per_block
            if held + len(blocks) * self.nbytes_per_block > self._inbox_limit:
                raise ValueError("the receive buffer (kv_buffer_size) is full")
            for block in blocks:
                self._inbox[block.key] = (tuple(block.token_ids), bytes(block.data))
