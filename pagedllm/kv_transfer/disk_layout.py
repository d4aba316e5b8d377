"""Where the disk tier keeps a block, and what a block file looks like.

One folder per cache identity (`KVTierConfig.identity`: model, dtypes, block size, layout),
one file per block key, in 256 subfolders by the key's first two hex digits:
`<kv_offload_dir>/<identity>/<key[:2]>/<key>.kvb`. A file is

    MAGIC | 4-byte little-endian header length | header (JSON) | payload

where the header names the identity, the key, the block's token ids, the payload's length
and its SHA-256. A file is written under a temporary name and renamed, so a reader sees a
whole file or none; a torn, foreign or altered file fails its checks and is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

MAGIC = b"PAGEDLLM-KV1\n"
SUFFIX = ".kvb"
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20


class BlockFileError(ValueError):
    """A block file that must not be loaded (torn, foreign, altered)."""


def namespace_dir(disk_dir: str | os.PathLike, identity: str) -> Path:
    return Path(disk_dir) / identity


def block_path(namespace: Path, key: str) -> Path:
    return namespace / key[:2] / f"{key}{SUFFIX}"


def scan_keys(namespace: Path) -> set[str]:
    """Keys of the block files under `namespace` (their contents are checked when read)."""
    if not namespace.is_dir():
        return set()
    return {path.name[: -len(SUFFIX)] for path in namespace.glob(f"*/*{SUFFIX}")}


def encode_block_file(identity: str, key: str, token_ids: tuple[int, ...], payload: bytes) -> bytes:
    header = json.dumps(
        {
            "identity": identity,
            "key": key,
            "token_ids": list(token_ids),
            "payload_bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
    ).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + payload


def decode_block_file(
    data: bytes, identity: str, key: str, token_ids: tuple[int, ...], payload_bytes: int
) -> bytes:
    """The payload of a block file, after every check; else `BlockFileError` saying which."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LENGTH.size:
        raise BlockFileError("not a block file (bad magic)")
    start = len(MAGIC) + _LENGTH.size
    (header_bytes,) = _LENGTH.unpack_from(data, len(MAGIC))
    if header_bytes > MAX_HEADER_BYTES or start + header_bytes > len(data):
        raise BlockFileError("truncated header")
    try:
        header = json.loads(data[start : start + header_bytes])
    except ValueError:
        raise BlockFileError("unreadable header") from None
    if not isinstance(header, dict):
        raise BlockFileError("unreadable header")
    payload = data[start + header_bytes :]
    checks = (
        (header.get("identity") == identity, "another model or cache layout"),
        (header.get("key") == key, "another block's key"),
        (header.get("token_ids") == list(token_ids), "other token ids"),
        (header.get("payload_bytes") == payload_bytes == len(payload), "wrong payload size"),
        (header.get("sha256") == hashlib.sha256(payload).hexdigest(), "checksum mismatch"),
    )
    for passed, problem in checks:
        if not passed:
            raise BlockFileError(problem)
    return payload


def write_block_file(path: Path, data: bytes) -> None:
    """Write atomically: a temporary file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as file:
        file.write(data)
    os.replace(temporary, path)
