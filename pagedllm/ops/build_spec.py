"""What the C++ extension is built from and how: its name, sources and compiler flags.

Two builds read this: the JIT build of a development checkout (`pagedllm/ops/extension.py`)
and the ahead-of-time build of a wheel (`setup.py`, which loads this file by its path before
pagedllm or its dependencies can be imported). Kept free of imports beyond the standard
library for that reason, and so that both builds compile the same binary.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

EXTENSION_NAME = "pagedllm_cpu_ops"
CSRC = Path(__file__).parent / "csrc"
# The translation units, in link order; the headers beside them are included by these.
SOURCE_NAMES = (
    "paged_attention.cpp",
    "cpu_ops.cpp",
    "skinny_linear.cpp",
    "fp8_dequant.cpp",
    "gguf_linear.cpp",
    "gguf_pack.cpp",
    "lora.cpp",
    "cpu_probe.cpp",
    "amx_linear.cpp",
    "bf16_dot_linear.cpp",
)
# Explicit ISA flags rather than -march=native: the JIT cache may be shared by machines of
# different generations, and a wheel runs on machines it was not built on. AVX2 + FMA + F16C
# is the baseline; the AVX-512 (VNNI, BF16) code is compiled under its own target pragmas and
# attributes and runs only where the CPU has it (dispatch at run time, ops/cpu_features.py).
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def source_files(csrc: Path = CSRC) -> list[Path]:
    """Every file of the build (sources and headers), sorted: what a digest must cover."""
    return sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h"))


def prebuilt_digest(csrc: Path = CSRC) -> str:
    """A digest of the sources and flags, which names the wheel's prebuilt library: a library
    built from other sources (an old in-place build in a checkout) is never loaded for these.
    Unlike the JIT cache's key it leaves torch's location out: the wheel is built in one
    environment and runs in another, and the torch it runs against is pinned instead."""
    digest = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode())
    for path in source_files(csrc):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def prebuilt_module(csrc: Path = CSRC) -> str:
    """The prebuilt library's module name inside pagedllm.ops (its file adds the ABI tag)."""
    return f"_{EXTENSION_NAME}_{prebuilt_digest(csrc)}"
