"""`KVTierManager`: the scheduler's side of the KV tiers: what each tier holds, and each step's
moves (`KVTransferOps`) for the runner to carry out.

Pure bookkeeping, like the KV cache manager: the runner holds every byte.

- **Host tier** (`num_host_blocks` slots, LRU): a prefix block evicted from the pool is saved
  to a slot instead of vanishing; a later request whose prefix is there gets fresh pool
  blocks loaded from it before its step runs, and computes only the rest.
- **Disk tier** (`disk_dir`): every block published to the prefix cache is also written to
  disk (in the background, after the step that filled it), so it outlives the pool and the
  process. A request whose prefix is on disk waits, parked, while the runner reads the files
  into host slots in the background; the requests behind it run meanwhile.
- **Swap** (`preemption_mode='swap'`): a preempted request's blocks are saved to host slots
  of its own and loaded back when it resumes, instead of recomputed.
- **Transfer** (`kv_transfer_config`): a producer ships each prompt's blocks (its partly
  filled last block too) once the prompt is computed; a consumer takes received blocks into
  its host tier, where its own requests find them.

Keys are `ops.block_key`s of the stable chained hashes; a host entry records its token ids
and a lookup compares them, the disk tier's files do the same when read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.core import hashing
from pagedllm.core.kv_block import KVCacheBlock
from pagedllm.core.request import Request, RequestStatus
from pagedllm.kv_transfer.config import KVTierConfig
from pagedllm.kv_transfer.ops import (
    BlockRecord,
    DiskFetch,
    KVTransferOps,
    KVTransferResult,
    RequestSend,
    block_key,
)
from pagedllm.utils import cdiv


@dataclass
class HostEntry:
    slot: int
    token_ids: tuple[int, ...]


@dataclass
class TierHit:
    """What the tiers hold of a request: the host slot of each entry of its block table they
    fill (flat table index, slot), and the tokens those entries hold (a partly filled last
    block counts all but the token the step must compute). A swapped-out request's own
    blocks (`swapped`) come back whole and free their slots; a prefix's `keys` stay in the
    host tier."""

    num_tokens: int
    slots: list[tuple[int, int]]
    keys: list[str] = field(default_factory=list)
    swapped: bool = False

    @property
    def slot_ids(self) -> list[int]:
        return [slot for _, slot in self.slots]


@dataclass
class KVTierStats:
    """Counts since start-up (blocks unless named tokens)."""

    host_hit_tokens: int = 0
    saved_blocks: int = 0
    loaded_blocks: int = 0
    persisted_blocks: int = 0
    fetched_blocks: int = 0
    failed_fetches: int = 0
    swapped_out_requests: int = 0
    swapped_in_requests: int = 0
    received_blocks: int = 0
    sent_requests: int = 0
    failed_sends: int = 0
    send_seconds: float = 0.0

    def snapshot(self) -> dict[str, float]:
        return dict(vars(self))


class KVTierManager:
    def __init__(
        self,
        config: KVTierConfig,
        block_size: int,
        num_groups: int = 1,
        disk_keys: Iterable[str] = (),
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.num_groups = num_groups
        self.host: OrderedDict[str, HostEntry] = OrderedDict()  # oldest first
        self.free_slots = list(range(config.num_host_blocks - 1, -1, -1))
        # Slots read or written this step: never handed out again before it ran.
        self._busy_slots: set[int] = set()
        self._release_after_step: list[int] = []
        self.disk_keys: set[str] = set(disk_keys) if config.disk_dir is not None else set()
        self.fetching: dict[str, DiskFetch] = {}
        self.parked: dict[str, set[str]] = {}  # request id -> keys it waits for
        self._fetched_for: set[str] = set()  # requests that parked once already
        # Keys a parked request will load (read for it, or found before its reads): kept in
        # the host tier until it is admitted or ends (key -> how many requests hold it).
        self._pins: dict[str, int] = {}
        self._pins_of: dict[str, list[str]] = {}
        self.swapped: dict[str, TierHit] = {}
        self.stats = KVTierStats()
        self._ops = KVTransferOps()

    @property
    def sends(self) -> bool:
        """A producer: each prompt's blocks go to its peer once computed."""
        return self.config.transfer is not None and self.config.transfer.sends

    @property
    def receives(self) -> bool:
        """A consumer: blocks its peer sent join the host tier before each step."""
        return self.config.transfer is not None and self.config.transfer.receives

    # ---- the host tier's slots --------------------------------------------------------
    @property
    def num_free_host_blocks(self) -> int:
        return len(self.free_slots)

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used entry's that this step does not use
        and no parked request holds."""
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((k for k, e in self.host.items() if self._evictable(k, e)), None)
            if victim is None:
                return None
            slot = self.host.pop(victim).slot
        self._busy_slots.add(slot)
        return slot

    def _evictable(self, key: str, entry: HostEntry) -> bool:
        return entry.slot not in self._busy_slots and key not in self._pins

    def _num_takeable_slots(self) -> int:
        evictable = sum(1 for k, e in self.host.items() if self._evictable(k, e))
        return len(self.free_slots) + evictable

    def _pin(self, request_id: str, keys: Iterable[str]) -> None:
        held = self._pins_of.setdefault(request_id, [])
        for key in keys:
            held.append(key)
            self._pins[key] = self._pins.get(key, 0) + 1

    def _unpin(self, request_id: str) -> None:
        for key in self._pins_of.pop(request_id, ()):
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]

    def _release(self, slots: Iterable[int]) -> None:
        self._release_after_step.extend(slots)

    def take_ops(self) -> KVTransferOps | None:
        """This step's moves (None if none); the slots they use are free to reuse after."""
        ops, self._ops = self._ops, KVTransferOps()
        self._busy_slots.clear()
        self.free_slots.extend(self._release_after_step)
        self._release_after_step.clear()
        return ops if ops else None

    # ---- blocks leaving the pool ------------------------------------------------------
    def on_evict(self, block: KVCacheBlock) -> None:
        """A cached pool block is about to be handed out again: keep it in the host tier."""
        key = block.tier_key
        if key is None or not self.config.num_host_blocks or block.cache_key is None:
            return
        if key in self.host:
            self.host.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._ops.saves.append((block.block_id, slot))
        self.host[key] = HostEntry(slot, block.cache_key.token_ids)
        self.stats.saved_blocks += 1

    def on_publish(
        self, block: KVCacheBlock, block_hash: int, group: int, token_ids: tuple[int, ...]
    ) -> None:
        """A block joined the prefix cache this step: write it through to disk after the
        step fills it."""
        key = block.tier_key = block_key(block_hash, group)
        if self.config.disk_dir is None or key in self.disk_keys:
            return
        self.disk_keys.add(key)
        self._ops.persists.append(BlockRecord(block.block_id, key, token_ids))
        self.stats.persisted_blocks += 1

    # ---- blocks coming back -----------------------------------------------------------
    def find(self, request: Request, num_hit_tokens: int) -> TierHit | None:
        """The request's next blocks after its `num_hit_tokens` prefix-cache hits, from the
        tiers: a `TierHit` in host slots, or None. While some are read from disk (asked for
        here) the request is parked: its status is WAITING_FOR_KV until they are in."""
        if request.sampling_params.prompt_logprobs is not None:
            return None
        if request.request_id in self.parked:
            request.status = RequestStatus.WAITING_FOR_KV
            return None
        if request.status is RequestStatus.WAITING_FOR_KV:  # its reads ended
            request.status = RequestStatus.WAITING
        slots: list[int] = []
        keys: list[str] = []
        on_disk: list[DiskFetch] = []
        token_ids = request.all_token_ids
        bs, num_tokens = self.block_size, len(token_ids)
        first = num_hit_tokens // bs
        index = first
        while index < (num_tokens - 1) // bs:
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            row = self._locate_row(request.block_hashes[index], tokens, request, on_disk)
            if row is None:
                break
            slots.extend(slot for slot, _ in row)
            keys.extend(key for _, key in row)
            index += 1
        num_tail_tokens = 0
        if index == (num_tokens - 1) // bs and not on_disk:
            tail = self._find_tail(request, index)
            if tail is not None:
                slots.extend(slot for slot, _ in tail[0])
                keys.extend(key for _, key in tail[0])
                num_tail_tokens = tail[1]
        if on_disk:
            in_host = [key for key, slot in zip(keys, slots, strict=True) if slot >= 0]
            self._park(request, on_disk, in_host)
            return None
        num_loaded = (index - first) * bs + num_tail_tokens
        if num_loaded <= 0:
            self._unpin(request.request_id)
            return None
        # Held for the step: the request's own allocation may evict pool blocks into the
        # host tier before `load`, and must not take these slots for them.
        self._busy_slots.update(slots)
        for key in keys:
            self.host.move_to_end(key)
        first_entry = first * self.num_groups
        return TierHit(num_loaded, list(enumerate(slots, first_entry)), keys)

    def _locate_row(
        self,
        block_hash: int,
        tokens: tuple[int, ...],
        request: Request,
        on_disk: list[DiskFetch],
    ) -> list[tuple[int, str]] | None:
        """(host slot, key) of one logical block's every group, or None where a group
        misses; a block only on disk is noted in `on_disk` (slot -1 stands for it)."""
        row = []
        for group in range(self.num_groups):
            key = block_key(block_hash, group)
            entry = self.host.get(key)
            if entry is not None and entry.token_ids == tokens:
                row.append((entry.slot, key))
            elif key in self.fetching or (
                key in self.disk_keys and request.request_id not in self._fetched_for
            ):
                on_disk.append(DiskFetch(key, -1, tokens))
                row.append((-1, key))
            else:
                return None
        return row

    def _find_tail(self, request: Request, index: int) -> tuple[list[tuple[int, str]], int] | None:
        """The host slots of the block the request's last token falls in, when a producer
        shipped it: full, or partly filled (its key is the partial hash of its tokens)."""
        bs, token_ids = self.block_size, request.all_token_ids
        tail = tuple(token_ids[index * bs :])
        if len(tail) < 2:
            return None
        if len(tail) == bs:
            block_hash = request.block_hashes[index]
        else:
            parent = request.block_hashes[index - 1] if index else None
            block_hash = hashing.partial_block_hash(parent, tail, index, request.cache_namespace)
        row = []
        for group in range(self.num_groups):
            key = block_key(block_hash, group)
            entry = self.host.get(key)
            if entry is None or entry.token_ids != tail:
                return None
            row.append((entry.slot, key))
        return row, len(tail) - 1

    def _park(self, request: Request, on_disk: list[DiskFetch], host_keys: list[str]) -> None:
        """Ask for the request's blocks on disk, in order, while host slots allow, and park
        it (WAITING_FOR_KV) until they are read; what it will load stays in the host tier
        until it is admitted. No slot free: it is not parked, and is computed."""
        self._pin(request.request_id, host_keys)  # before the reads take slots
        waiting = set()
        for fetch in on_disk:
            if fetch.key in self.fetching:
                waiting.add(fetch.key)
                continue
            slot = self._take_slot()
            if slot is None:
                break
            self._busy_slots.discard(slot)  # in `fetching` until read: never handed out
            fetch.slot = slot
            self.fetching[fetch.key] = fetch
            self._ops.fetches.append(fetch)
            waiting.add(fetch.key)
        if not waiting:
            self._unpin(request.request_id)
            return
        self._pin(request.request_id, waiting)
        self._fetched_for.add(request.request_id)
        self.parked[request.request_id] = waiting
        request.status = RequestStatus.WAITING_FOR_KV

    def load(self, request_id: str, hit: TierHit, block_table: list[int]) -> None:
        """Load the hit's host slots into the request's fresh pool blocks (its table, just
        allocated) before its step; a swapped-out request's slots free after the step."""
        for index, slot in hit.slots:
            self._ops.loads.append((slot, block_table[index]))
        self.stats.loaded_blocks += len(hit.slots)
        if hit.swapped:
            del self.swapped[request_id]
            self._release(hit.slot_ids)
            self.stats.swapped_in_requests += 1
        else:
            self.stats.host_hit_tokens += hit.num_tokens
            self._unpin(request_id)  # its reads are loaded: LRU again

    # ---- swap -------------------------------------------------------------------------
    def swap_out(self, request: Request, blocks: list[KVCacheBlock], null: KVCacheBlock) -> bool:
        """Save a preempted request's blocks to host slots of its own; False (nothing taken)
        if the host tier cannot hold them all."""
        if not self.config.swaps:
            return False
        entries = [(i, b.block_id) for i, b in enumerate(blocks) if b is not null]
        if not entries or len(entries) > self._num_takeable_slots():
            return False
        slots = []
        for index, block_id in entries:
            slot = self._take_slot()
            assert slot is not None
            self._ops.saves.append((block_id, slot))
            slots.append((index, slot))
        self.swapped[request.request_id] = TierHit(request.num_computed_tokens, slots, swapped=True)
        self.stats.swapped_out_requests += 1
        return True

    # ---- transfer ---------------------------------------------------------------------
    def on_prompt_computed(
        self, request: Request, block_hashes: list[int], block_ids: list[int], null_id: int
    ) -> None:
        """A producer ships a prompt's blocks (the partly filled last one too) after the
        step that computes its last prompt token."""
        if not self.sends:
            return
        bs, num_prompt = self.block_size, request.num_prompt_tokens
        prompt = request.prompt_token_ids
        records = []
        for index in range(cdiv(num_prompt, bs)):
            tokens = tuple(prompt[index * bs : (index + 1) * bs])
            if len(tokens) == bs:
                block_hash = block_hashes[index]
            else:
                parent = block_hashes[index - 1] if index else None
                block_hash = hashing.partial_block_hash(
                    parent, tokens, index, request.cache_namespace
                )
            for group in range(self.num_groups):
                block_id = block_ids[index * self.num_groups + group]
                if block_id != null_id:
                    records.append(BlockRecord(block_id, block_key(block_hash, group), tokens))
        if records:
            self._ops.sends.append(RequestSend(request.request_id, records))

    def on_received(self, received: list[tuple[str, tuple[int, ...]]]) -> None:
        """A consumer takes blocks a producer sent into its host tier."""
        for key, token_ids in received:
            slot = None if key in self.host else self._take_slot()
            if slot is None:
                self._ops.drops.append(key)
                continue
            self._ops.ingests.append((key, slot))
            self.host[key] = HostEntry(slot, tuple(token_ids))
            self.stats.received_blocks += 1

    # ---- results and request ends -----------------------------------------------------
    def apply_result(self, result: KVTransferResult | None) -> None:
        if result is None:
            return
        for key, slot, ok in result.fetched:
            fetch = self.fetching.pop(key)
            if ok:
                self.host[key] = HostEntry(slot, fetch.token_ids)
                self.stats.fetched_blocks += 1
            else:
                self.free_slots.append(slot)
                self.disk_keys.discard(key)
                self.stats.failed_fetches += 1
            for request_id in list(self.parked):
                self.parked[request_id].discard(key)
                if not self.parked[request_id]:
                    del self.parked[request_id]
        for _, ok, seconds in result.sent:
            self.stats.sent_requests += ok
            self.stats.failed_sends += not ok
            self.stats.send_seconds += seconds

    def request_finished(self, request_id: str) -> None:
        """A finished or aborted request gives back its swap slots and parked state."""
        record = self.swapped.pop(request_id, None)
        if record is not None:
            self._release(record.slot_ids)
        self.parked.pop(request_id, None)
        self._fetched_for.discard(request_id)
        self._unpin(request_id)

    def reset(self) -> None:
        """Forget the host tier's prefixes (with the prefix cache); swapped requests and
        reads in flight keep theirs, the disk tier keeps its files."""
        for entry in self.host.values():
            self.free_slots.append(entry.slot)
        self.host.clear()

    def check_integrity(self) -> None:
        """Every slot is exactly one of: free, a host entry, being read, swapped, or
        released after this step."""
        used = [e.slot for e in self.host.values()]
        used += [f.slot for f in self.fetching.values()]
        used += [slot for record in self.swapped.values() for slot in record.slot_ids]
        used += self.free_slots + self._release_after_step
        assert sorted(used) == list(range(self.config.num_host_blocks)), "host slots leak"
