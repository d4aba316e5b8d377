"""What this CPU offers the kernels, detected once per process.

`cpu_features()` reads the instruction-set extensions the kernels can use (AVX2, FMA, F16C,
AVX-512, VNNI, AVX512-BF16, AMX) from the kernel's CPU flags, falling back to torch's own
checks where `/proc/cpuinfo` is missing. `PAGEDLLM_CPU_DISABLE` (a comma-separated list of
feature names, e.g. `avx512_vnni,amx_bf16`) hides features, so a machine can run, and a
test can check, the paths an older CPU would take. The C++ kernels' baseline is AVX2 + FMA,
read from torch's dispatch level (`ATEN_CPU_CAPABILITY=default` lowers it too); wider paths
are chosen per kernel from these features (`gguf_kernel_isa`, `fp8_kernel_isa`).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, fields

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDLLM_CPU_DISABLE"
# torch's capability names at or above the kernels' baseline.
_BASELINE_OR_BETTER = ("AVX2", "AVX512")


@dataclass(frozen=True)
class CpuFeatures:
    """Instruction-set extensions, named as in /proc/cpuinfo."""

    avx2: bool = False
    fma: bool = False
    f16c: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vl: bool = False
    avx512_vnni: bool = False
    avx512_bf16: bool = False
    amx_tile: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False

    @classmethod
    def from_flags(cls, flags: set[str], disabled: set[str] = frozenset()) -> CpuFeatures:
        return cls(**{f.name: f.name in flags and f.name not in disabled for f in fields(cls)})

    def names(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]

    @property
    def bf16_arithmetic(self) -> bool:
        """Native bf16 dot products (AVX512-BF16 or AMX): where bf16 beats fp32."""
        return self.avx512_bf16 or self.amx_bf16


def cpuinfo_flags() -> set[str] | None:
    """The kernel's flags for the first CPU, as /proc/cpuinfo names them, none hidden (None
    where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def _torch_flags() -> set[str]:
    """The flags torch can tell us about, for systems without /proc/cpuinfo."""
    # torch.cpu's private probes (torch 2.13; tests/ops/test_torch_entry_points.py checks
    # they are there: missing, a feature would look absent without a word).
    checks = {
        "avx512_vnni": "_is_vnni_supported",
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_tile": "_is_amx_tile_supported",
        "amx_bf16": "_is_amx_tile_supported",
    }
    flags = set()
    if torch.backends.cpu.get_cpu_capability() in _BASELINE_OR_BETTER:
        flags |= {"avx2", "fma", "f16c"}
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        flags |= {"avx512f", "avx512bw", "avx512vl"}
    for name, check in checks.items():
        if getattr(torch.cpu, check, lambda: False)():
            flags.add(name)
    return flags


def disabled_features() -> set[str]:
    """The names `PAGEDLLM_CPU_DISABLE` hides; unknown names are refused."""
    names = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    known = {f.name for f in fields(CpuFeatures)}
    if names - known:
        raise ValueError(
            f"{DISABLE_ENV} names unknown CPU features {sorted(names - known)}; "
            f"known: {sorted(known)}"
        )
    return names


@functools.cache
def cpu_features() -> CpuFeatures:
    """This CPU's features, less those `PAGEDLLM_CPU_DISABLE` hides (read once)."""
    flags = cpuinfo_flags()
    return CpuFeatures.from_flags(
        flags if flags is not None else _torch_flags(), disabled_features()
    )


# The GGUF kernel's paths (ops/csrc/gguf_linear.cpp's `isa`). The AMX path runs groups of
# 16 rows on AMX-INT8 tiles and the rest on the VNNI body; the kernel lowers it to VNNI
# where Linux does not grant the tiles.
GGUF_PORTABLE, GGUF_AVX2, GGUF_VNNI, GGUF_AMX = 0, 1, 2, 3


def gguf_kernel_isa(features: CpuFeatures | None = None) -> int:
    """The widest GGUF kernel path these features allow."""
    features = features or cpu_features()
    if not (features.avx2 and features.fma):  # every vector path uses both
        return GGUF_PORTABLE
    if features.avx512f and features.avx512_vnni and features.avx512bw and features.avx512vl:
        return GGUF_AMX if features.amx_tile and features.amx_int8 else GGUF_VNNI
    return GGUF_AVX2


# The fp8 kernels' paths (ops/csrc/fp8_dequant.cpp's `isa`); both give the same bits.
FP8_AVX2, FP8_AVX512 = 1, 2


def fp8_kernel_isa(features: CpuFeatures | None = None) -> int:
    """The widest fp8 kernel path these features allow."""
    features = features or cpu_features()
    if features.avx512f and features.avx512bw and features.avx512vl:
        return FP8_AVX512
    return FP8_AVX2


def describe_cpu(features: CpuFeatures | None = None) -> str:
    """One line for the start-up log: the features and what each kernel family runs."""
    features = features or cpu_features()
    gguf_path = {
        GGUF_AMX: "AMX-INT8 tiles from 16 rows, AVX-512 VNNI below",
        GGUF_VNNI: "AVX-512 VNNI",
        GGUF_AVX2: "AVX2",
        GGUF_PORTABLE: "portable",
    }
    fp8_path = {FP8_AVX512: "AVX-512", FP8_AVX2: "AVX2"}
    disabled = sorted(disabled_features())
    hidden = f" ({DISABLE_ENV} hides {', '.join(disabled)})" if disabled else ""
    bf16 = "yes" if features.bf16_arithmetic else "no (bf16 is converted to fp32)"
    return (
        f"CPU features: {' '.join(features.names()) or 'none of interest'}{hidden}; "
        f"GGUF matmul path: {gguf_path[gguf_kernel_isa(features)]}; "
        f"fp8 path: {fp8_path[fp8_kernel_isa(features)]}; bf16 arithmetic: {bf16}"
    )


def kernel_isa_missing() -> str | None:
    """Why the kernels cannot run on this CPU, or None if they can."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _BASELINE_OR_BETTER:
        return f"the CPU lacks AVX2 and FMA, which the kernels need (torch reports {capability})"
    features = cpu_features()
    if not (features.avx2 and features.fma):
        return f"AVX2 or FMA is hidden by {DISABLE_ENV}; the kernels need both"
    return None
