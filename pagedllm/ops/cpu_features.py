"""What this CPU offers the C++ kernels: the AVX2 + FMA baseline they are compiled for.

The baseline is read from torch's own dispatch level (`torch.backends.cpu`), which is AVX2
only where the CPU has both AVX2 and FMA, and which `ATEN_CPU_CAPABILITY=default` lowers,
so a run can pretend to be on an older CPU. Wider paths (AVX-512 VNNI in gguf_linear.cpp)
are not chosen here: the C++ picks them at run time, per call, from CPUID.
"""

from __future__ import annotations

import torch

# torch's capability names at or above the kernels' baseline.
_BASELINE_OR_BETTER = ("AVX2", "AVX512")


def kernel_isa_missing() -> str | None:
    """Why the kernels cannot run on this CPU, or None if they can."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in _BASELINE_OR_BETTER:
        return None
    return f"the CPU lacks AVX2 and FMA, which the kernels need (torch reports {capability})"
