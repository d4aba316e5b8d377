"""What the scheduler asks the runner to move between KV tiers in one step, and what came back.

The scheduler owns every index (which key sits in which host slot, which keys the disk
holds); the runner owns the bytes and only carries out `KVTransferOps`, in this order:

    before the forward:  ingests (received blocks → host slots), saves (pool → host),
                         loads (host → pool), fetches started (disk → host, in the background)
    after the forward:   persists (pool → disk, in the background), sends (pool → a peer)

Saves come before loads so an evicted block's bytes leave before a load overwrites its pool
block; a host slot that is read or written in a step is never handed out again in that step.
A key names what a block holds: `block_key` below.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def block_key(block_hash: int, group: int) -> str:
    """A block's key in every tier: its stable chained hash and its KV cache group."""
    return f"{block_hash:032x}.{group}"


@dataclass
class BlockRecord:
    """A pool block and what it holds: its key and the token ids the key stands for."""

    block_id: int
    key: str
    token_ids: tuple[int, ...]


@dataclass
class DiskFetch:
    """Read the disk tier's file of `key` into host slot `slot`; the file must hold
    `token_ids` (else the read fails and the key is recomputed)."""

    key: str
    slot: int
    token_ids: tuple[int, ...]


@dataclass
class RequestSend:
    """A prefill instance ships one request's prompt blocks to its peer."""

    request_id: str
    blocks: list[BlockRecord]


@dataclass
class KVTransferOps:
    ingests: list[tuple[str, int]] = field(default_factory=list)  # (received key, host slot)
    saves: list[tuple[int, int]] = field(default_factory=list)  # (pool block, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, pool block)
    fetches: list[DiskFetch] = field(default_factory=list)
    persists: list[BlockRecord] = field(default_factory=list)
    sends: list[RequestSend] = field(default_factory=list)
    # Received keys with no room in the host tier: the runner drops their bytes.
    drops: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any(
            (
                self.ingests,
                self.saves,
                self.loads,
                self.fetches,
                self.persists,
                self.sends,
                self.drops,
            )
        )


@dataclass
class KVTransferResult:
    """What the runner reports after a step: disk reads that ended (key, slot, ok) and
    sends that ended (request id, ok, seconds)."""

    fetched: list[tuple[str, int, bool]] = field(default_factory=list)
    sent: list[tuple[str, bool, float]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.fetched or self.sent)
