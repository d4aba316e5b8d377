"""The wheel's C++ kernels, compiled ahead of time (`pip wheel .`, `pip install .`).

Everything else about the package lives in pyproject.toml; this file only adds the extension
that `torch.utils.cpp_extension.BuildExtension` compiles against the build environment's torch
(pinned in `[build-system] requires` to the version the package pins at run time, the ABI it
links against). One binary carries every ISA path the kernels dispatch between at run time:
the flags and sources are `pagedllm/ops/build_spec.py`'s, the same as the JIT build's.

An editable install (`make`, `pip install -e .`) compiles nothing here: a checkout's kernels
are built by the JIT path (`pagedllm/ops/extension.py`), which rebuilds as the sources change.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent


def _build_spec() -> ModuleType:
    # By path: importing pagedllm.ops would import the package (and its dependencies), which
    # the build environment does not have.
    path = ROOT / "pagedllm" / "ops" / "build_spec.py"
    spec = importlib.util.spec_from_file_location("_pagedllm_build_spec", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernels() -> CppExtension:
    spec = _build_spec()
    csrc = spec.CSRC.relative_to(ROOT)  # setuptools wants paths relative to this file
    return CppExtension(
        name=f"pagedllm.ops.{spec.prebuilt_module()}",
        sources=[str(csrc / name) for name in spec.SOURCE_NAMES],
        include_dirs=[str(csrc)],
        extra_compile_args=list(spec.CFLAGS),
        extra_link_args=list(spec.LDFLAGS),
    )


class BuildKernels(BuildExtension):
    """BuildExtension with the JIT build's flags alone, and nothing to build in an editable
    install, whose kernels the JIT path builds."""

    def run(self) -> None:
        if self.editable_mode:
            print("pagedllm: editable install, the C++ kernels build at first use (JIT)")
            return
        super().run()

    def build_extensions(self) -> None:
        # Python's own CFLAGS (-g -fwrapv -DNDEBUG -O3 -Wall) lead every compile command: -g
        # made a 31 MB library (2 MB without), and -fwrapv can keep loops from vectorizing.
        # The JIT build has none of them; the binary should be the one `make` tests.
        self.compiler.set_executable("compiler_so", [self.compiler.compiler_so[0], "-fPIC"])
        super().build_extensions()

    def get_outputs(self) -> list[str]:
        return [] if self.editable_mode else super().get_outputs()


setup(ext_modules=[_kernels()], cmdclass={"build_ext": BuildKernels})
