"""API keys found by the SHA-256 digest of the presented key: one dictionary lookup per
request, however many keys are configured.

Why a dictionary lookup is safe against timing: the dictionary never holds or compares a key,
only digests. What the lookup's time can depend on (the digest's hash bucket, how many of its
leading bytes equal a stored digest's) is a function of the presented key's SHA-256, which a
client can steer only by finding preimages; it learns nothing about any stored key. Hashing
the presented key takes the same time whatever the stored keys are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


def key_digest(key: str) -> bytes:
    """The digest a key is stored and looked up under (keys themselves are never kept)."""
    return hashlib.sha256(key.encode()).digest()


class KeyIndex(Generic[T]):
    """What each key maps to (a tenant), by the digest of the key; never changed once built
    (a reload builds a new index and swaps it in whole)."""

    def __init__(self, entries: Iterable[tuple[bytes, T]] = ()) -> None:
        self._by_digest: dict[bytes, T] = dict(entries)

    def find(self, key: str) -> T | None:
        """The value of `key`, or None: one digest and one dictionary lookup."""
        return self._by_digest.get(key_digest(key))

    def __len__(self) -> int:
        return len(self._by_digest)

    def __iter__(self) -> Iterator[T]:
        """The values, in the order the entries were given."""
        return iter(self._by_digest.values())

    def digests(self) -> frozenset[bytes]:
        return frozenset(self._by_digest)
