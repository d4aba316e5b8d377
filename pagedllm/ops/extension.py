"""Load the C++ CPU extension (torch.ops.pagedllm): paged attention and fused ops.

Two builds of the same sources (pagedllm/ops/csrc, flags in `build_spec.py`):
- an installed wheel carries a library compiled ahead of time (setup.py) beside this module,
  named by a digest of the sources; it is loaded as is, with no compiler and no waiting;
- a development checkout (an editable install, `make`) has none, and compiles the sources
  with `torch.utils.cpp_extension.load` into a cache directory (one per Python version, torch
  version, and digest of the sources and of torch's location), reused by later processes.
  The sources are built from copies inside that directory, so a checkout's virtualenv keeps
  its build while other checkouts (a branch, an older clone, a CI clone) build theirs beside
  it instead of over it. `build()` (or `python -m pagedllm.ops.extension`) compiles ahead of
  time, e.g. at install, so that a first start does not wait for the compiler.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

import torch

from pagedllm.ops import build_spec
from pagedllm.ops.cpu_features import cpu_features, kernel_isa_missing
from pagedllm.utils import cache_root

logger = logging.getLogger(__name__)

_EXTENSION_NAME = build_spec.EXTENSION_NAME
_CSRC = build_spec.CSRC
_CFLAGS = list(build_spec.CFLAGS)

_extension: Any = None  # torch.ops.pagedllm once loaded
_load_error: Exception | None = None
_library: Path | None = None  # the file it was loaded from


def _source_files() -> list[Path]:
    return build_spec.source_files(_CSRC)


def _source_digest() -> str:
    # torch's location too: the build's include paths point into it, and a build from
    # another virtualenv's torch would otherwise look changed to ninja and be redone.
    digest = hashlib.sha256(" ".join([*_CFLAGS, os.path.dirname(torch.__file__)]).encode())
    for path in _source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def cache_dir() -> Path:
    """Where the compiled extension lives: per Python version, torch version and sources."""
    tag = f"{_EXTENSION_NAME}-py{sys.version_info.major}{sys.version_info.minor}"
    return cache_root() / "extensions" / f"{tag}-torch{torch.__version__}-{_source_digest()}"


def _copy_sources(directory: Path) -> Path:
    """The sources copied into the build directory (atomically: processes may race)."""
    source_dir = directory / "src"
    source_dir.mkdir(exist_ok=True)
    for path in _source_files():
        target = source_dir / path.name
        if not target.exists():
            partial = source_dir / f".{path.name}.{os.getpid()}"
            partial.write_bytes(path.read_bytes())
            os.replace(partial, target)
    return source_dir


def prebuilt_library() -> Path | None:
    """The library a wheel installs beside this module, compiled ahead of time from these very
    sources (its name carries their digest); None in a development checkout, where an old
    in-place build (`setup.py build_ext --inplace`) of other sources is left alone too."""
    module = build_spec.prebuilt_module(_CSRC)
    for suffix in EXTENSION_SUFFIXES:
        candidate = _CSRC.parent / f"{module}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def loaded_from() -> Path | None:
    """The file torch.ops.pagedllm was loaded from (None before `load()` succeeds)."""
    return _library


def load() -> Any:
    """`torch.ops.pagedllm`: the wheel's prebuilt library, else built from the sources on
    first use (about 30 s) or loaded from the JIT cache.

    Raises RuntimeError, naming the reason, when the CPU lacks AVX2 or the build fails;
    the failure is remembered so later calls in the process fail fast.
    """
    global _extension, _load_error
    if _extension is not None:
        return _extension
    if _load_error is not None:
        raise RuntimeError(f"the CPU extension is unavailable: {_load_error}")
    start = time.perf_counter()
    try:
        prebuilt = _import_prebuilt()
        _extension = prebuilt if prebuilt is not None else _compile_and_import()
    except Exception as error:
        _load_error = error
        raise RuntimeError(f"the CPU extension is unavailable: {error}") from error
    elapsed = time.perf_counter() - start
    if elapsed > 2:  # it compiled: say where the time went
        logger.info("CPU extension built in %.1f s, cached in %s", elapsed, cache_dir())
    logger.info("CPU extension loaded from %s", _library)
    return _extension


def available() -> bool:
    """Whether the extension loads here (building it if needed); never raises."""
    try:
        load()
    except RuntimeError:
        return False
    return True


def _import_prebuilt() -> Any:
    """torch.ops.pagedllm from the wheel's library, or None where there is none or it does not
    load (a torch other than the one it was built against: then the JIT build is tried)."""
    global _library
    library = prebuilt_library()
    if library is None:
        return None
    missing = kernel_isa_missing()
    if missing:
        raise RuntimeError(missing)
    try:
        torch.ops.load_library(str(library))
    except OSError as error:
        logger.warning("the prebuilt CPU extension does not load (%s); building it instead", error)
        return None
    _prepare_loaded_library()
    _library = library
    return torch.ops.pagedllm


def _compile_and_import() -> Any:
    global _library
    missing = kernel_isa_missing()
    if missing:
        raise RuntimeError(missing)
    from torch.utils.cpp_extension import load as load_extension

    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    source_dir = _copy_sources(directory)
    with _build_lock(directory):
        # Registers the ops with the dispatcher (TORCH_LIBRARY) instead of importing a module.
        load_extension(
            name=_EXTENSION_NAME,
            sources=[str(source_dir / name) for name in build_spec.SOURCE_NAMES],
            extra_cflags=_CFLAGS,
            extra_ldflags=list(build_spec.LDFLAGS),
            extra_include_paths=[str(source_dir)],
            build_directory=str(directory),
            is_python_module=False,
        )
    _prepare_loaded_library()
    _library = directory / f"{_EXTENSION_NAME}.so"
    return torch.ops.pagedllm


# torch's own build lock: a file that exists while a process builds in the directory.
_TORCH_BATON = "lock"


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One process at a time builds or loads in `directory`, under an flock the OS releases
    when its holder dies. torch's lock is a file that a killed build leaves behind, and then
    every later start waits for it to go, forever (seen after a `make test` was killed during
    the build); under this flock no other build can be running, so such a file is stale."""
    with open(directory.parent / f"{directory.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / _TORCH_BATON).unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# The kernels that take tensors. Each writes into tensors it is given and returns nothing,
# so tracing them (torch.compile) needs only a fake kernel that does the same: nothing.
_TENSOR_OPS = (
    "paged_attention",
    "write_kv_cache",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "sample_plain",
    "argmax_rows",
    "gelu_tanh_and_mul",
    "soft_cap",
    "skinny_linear",
    "gguf_linear",
    "gguf_linear_k",
    "gguf_pack",
)


def _prepare_loaded_library() -> None:
    _register_fake_kernels()
    # The element-wise and attention kernels take 16 lanes where AVX-512 is there and not
    # hidden (PAGEDLLM_CPU_DISABLE): the same bits as 8, in fewer instructions.
    torch.ops.pagedllm.set_vector_lanes(16 if cpu_features().avx512f else 8)


def _register_fake_kernels() -> None:
    for name in _TENSOR_OPS:
        torch.library.register_fake(f"pagedllm::{name}")(_writes_in_place)


def _writes_in_place(*args: Any, **kwargs: Any) -> None:
    return None


def build() -> float:
    """Compile (or find) the extension now and print how long that took; returns seconds."""
    start = time.perf_counter()
    load()
    elapsed = time.perf_counter() - start
    print(f"pagedllm: CPU extension ready: {_library} ({elapsed:.1f} s)")
    return elapsed


if __name__ == "__main__":
    build()
