"""Chained block hashes for the prefix cache.

A full block's hash covers its parent block's hash, its own token ids and extra keys (such
as a tenant's `cache_salt`), so equal hashes stand for equal prefixes. A hash only finds
candidates: the prefix cache still compares token ids and the parent entry before it
accepts a hit (see `core/prefix_cache.py`), so even a constant hash serves correct KV.

Python's `hash` of a string differs from process to process, so the KV tiers, whose keys
outlive the process (the disk tier) or cross to another one (a decode instance), use the
stable 128-bit `stable_hash_block_tokens` instead (about 4 µs a block against 0.3 µs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

BlockHash = int
ExtraKeys = tuple[Any, ...] | None


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: tuple[int, ...], extra_keys: ExtraKeys
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    return hash((parent_hash, token_ids, extra_keys))


def stable_hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: tuple[int, ...], extra_keys: ExtraKeys
) -> BlockHash:
    """`hash_block_tokens` that every process computes alike (the extra keys' repr is
    stable: strings, ints and tuples of them)."""
    text = repr((parent_hash, token_ids, extra_keys)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=16).digest(), "little")


def partial_block_hash(
    parent_hash: BlockHash | None, token_ids: tuple[int, ...], index: int, cache_salt: Any
) -> BlockHash:
    """The stable hash of a partly filled last block (a prompt's tail that a prefill
    instance ships whole); never equal to a full block's."""
    extra_keys = (*(block_extra_keys(index, cache_salt) or ()), "partial")
    return stable_hash_block_tokens(parent_hash, token_ids, extra_keys)


def block_extra_keys(block_index: int, cache_salt: Any) -> ExtraKeys:
    """Extra keys of a block: the salt (a request's `cache_namespace`: its `cache_salt`, and
    its LoRA adapter) marks the first block, and the chain carries it on."""
    if block_index == 0 and cache_salt is not None:
        return (cache_salt,)
    return None


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: Any,
    stable: bool = False,
) -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet (`stable`: the
    hashes the KV tiers key blocks by)."""
    hash_fn = stable_hash_block_tokens if stable else hash_block_tokens
    num_full_blocks = len(token_ids) // block_size
    for index in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else None
        tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
        block_hashes.append(hash_fn(parent, tokens, block_extra_keys(index, cache_salt)))
