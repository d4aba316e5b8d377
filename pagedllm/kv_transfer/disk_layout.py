"""Where the disk tier keeps a block, and what a block file looks like.

One folder per cache identity (`KVTierConfig.identity`: model, dtypes, block size, layout),
one file per block key, in 256 subfolders by the key's first two hex digits:
`<kv_offload_dir>/<identity>/<key[:2]>/<key>.kvb`. A file is

    MAGIC | 4-byte little-endian header length | header (JSON) | payload

where the header names the identity, the key, the block's token ids, the payload's length
and its SHA-256. A file is written under a temporary name and renamed, so a reader sees a
whole file or none; a torn, foreign or altered file fails its checks and is never loaded.

Several ranks (tensor or pipeline parallel) each hold their own heads' or layers' bytes of a
block: each writes and reads its own files, in its own subfolder `<identity>/rank<r>/`, and
its files' headers name the rank (`rank_identity`), so a file in another rank's folder fails
its checks. A block is on disk when every rank's file of it is (`scan_all_ranks`).

The folder is not trusted: no link is followed (a subfolder or block file that is a
symbolic link is refused, the temporary file is new, created with O_EXCL), a block file is
read only if it is a regular file of exactly the size its key's header and payload make, and
never past that size; anything else (a link, a FIFO, a device, a folder, a wrong size) is a
`BlockFileError`: a miss, the block is recomputed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import stat
import struct
from pathlib import Path

MAGIC = b"PAGEDLLM-KV1\n"
SUFFIX = ".kvb"
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW
# O_NONBLOCK: opening a FIFO planted in place of a file must not wait for a writer.
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW


class BlockFileError(ValueError):
    """A block file that must not be loaded (torn, foreign, altered)."""


def namespace_dir(disk_dir: str | os.PathLike, identity: str) -> Path:
    return Path(disk_dir) / identity


def rank_namespace(disk_dir: str | os.PathLike, identity: str, rank: int, world_size: int) -> Path:
    """The folder of rank `rank`'s block files: the identity's folder itself for one rank
    (as before ranks had folders: a one-rank cache stays readable), else its subfolder."""
    namespace = namespace_dir(disk_dir, identity)
    return namespace if world_size == 1 else namespace / f"rank{rank}"


def rank_identity(identity: str, rank: int, world_size: int) -> str:
    """What rank `rank`'s block file headers name: the identity, with the rank if several."""
    return identity if world_size == 1 else f"{identity}/rank{rank}"


def scan_all_ranks(disk_dir: str | os.PathLike, identity: str, world_size: int) -> set[str]:
    """Keys whose block files every rank has (a block is loaded only whole)."""
    folders = [rank_namespace(disk_dir, identity, r, world_size) for r in range(world_size)]
    return set.intersection(*(scan_keys(folder) for folder in folders))


def block_path(namespace: Path, key: str) -> Path:
    return namespace / key[:2] / f"{key}{SUFFIX}"


def scan_keys(namespace: Path) -> set[str]:
    """Keys of the block files under `namespace`: names only, no file is opened or followed
    (a linked subfolder is skipped; what a name holds is checked when it is read)."""
    keys: set[str] = set()
    try:
        folders = os.scandir(namespace)
    except OSError:
        return keys
    with folders:
        for folder in folders:
            try:
                if len(folder.name) != 2 or not folder.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(folder.path) as entries:
                    keys.update(
                        entry.name[: -len(SUFFIX)]
                        for entry in entries
                        if entry.name.endswith(SUFFIX) and entry.name.startswith(folder.name)
                    )
            except OSError:
                continue
    return keys


def _header(
    identity: str, key: str, token_ids: tuple[int, ...], payload_bytes: int, sha256: str
) -> bytes:
    return json.dumps(
        {
            "identity": identity,
            "key": key,
            "token_ids": list(token_ids),
            "payload_bytes": payload_bytes,
            "sha256": sha256,
        }
    ).encode()


def encode_block_file(identity: str, key: str, token_ids: tuple[int, ...], payload: bytes) -> bytes:
    sha256 = hashlib.sha256(payload).hexdigest()
    header = _header(identity, key, token_ids, len(payload), sha256)
    return MAGIC + _LENGTH.pack(len(header)) + header + payload


def block_file_size(identity: str, key: str, token_ids: tuple[int, ...], payload_bytes: int) -> int:
    """The exact size of the block file `encode_block_file` writes for these (a SHA-256 is
    64 hex digits whatever the payload)."""
    header = _header(identity, key, token_ids, payload_bytes, "0" * 64)
    return len(MAGIC) + _LENGTH.size + len(header) + payload_bytes


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


def _open_folder(path: Path) -> int:
    """A descriptor of a block's subfolder, refused (OSError) if it is a link."""
    return os.open(path, _DIR_FLAGS)


def read_block_file(path: Path, size: int) -> bytes:
    """The `size` bytes of the block file at `path`, read without following a link and only
    from a regular file of exactly that size; else `BlockFileError` saying why (OSError if
    it cannot be opened, e.g. it is missing)."""
    folder = _open_folder(path.parent)
    try:
        kind = os.stat(path.name, dir_fd=folder, follow_symlinks=False).st_mode
        if not stat.S_ISREG(kind):
            raise BlockFileError(f"not a regular file ({_kind(kind)})")
        try:
            fd = os.open(path.name, _READ_FLAGS, dir_fd=folder)
        except OSError as error:
            if error.errno == errno.ELOOP:  # replaced by a link since the check above
                raise BlockFileError("not a regular file (symbolic link)") from None
            raise
    finally:
        os.close(folder)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise BlockFileError(f"not a regular file ({_kind(found.st_mode)})")
        if found.st_size != size:
            raise BlockFileError(f"wrong file size ({found.st_size} bytes, not {size})")
        data = bytearray(size)
        view = memoryview(data)
        done = 0
        while done < size:
            count = os.readv(fd, [view[done:]])
            if count == 0:
                raise BlockFileError("the file shrank while read")
            done += count
        if os.read(fd, 1):
            raise BlockFileError("the file grew while read")
    finally:
        os.close(fd)
    return bytes(data)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "symbolic link"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "unknown kind"


def write_block_file(path: Path, data: bytes) -> None:
    """Write atomically, following no link: a new temporary file in the same folder (a name
    nobody can guess, created with O_EXCL), then a rename over whatever `path` is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = _open_folder(path.parent)
    try:
        temporary = f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
        fd = os.open(temporary, _WRITE_FLAGS, 0o666, dir_fd=folder)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=folder)
            raise
    finally:
        os.close(folder)


def remove_block_file(path: Path) -> None:
    """Delete a block file that failed its checks (a link itself, never its target; a
    folder in its place stays: the rename of a rewrite fails on it, a miss again)."""
    try:
        folder = _open_folder(path.parent)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.unlink(path.name, dir_fd=folder)
    finally:
        os.close(folder)
