"""Which build of the C++ extension loads: a wheel's prebuilt library, named by the digest of
the sources beside it, else the JIT build (a checkout). The wheel itself is built and run in
tests/ops/test_wheel.py (slow tier); here the choice alone, with loading stubbed."""

from __future__ import annotations

import shutil
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest
import torch

from pagedllm.ops import build_spec, extension


@pytest.fixture
def package(monkeypatch, tmp_path) -> Path:
    """A copy of pagedllm/ops's sources, as an installed package holds them; the extension's
    state as in a fresh process."""
    shutil.copytree(build_spec.CSRC, tmp_path / "ops" / "csrc")
    monkeypatch.setattr(extension, "_CSRC", tmp_path / "ops" / "csrc")
    for name in ("_extension", "_load_error", "_library"):
        monkeypatch.setattr(extension, name, None)
    monkeypatch.setattr(extension, "kernel_isa_missing", lambda: None)
    monkeypatch.setattr(extension, "_register_fake_kernels", lambda: None)
    return tmp_path / "ops"


def _library(package: Path, module: str) -> Path:
    path = package / f"{module}{EXTENSION_SUFFIXES[0]}"
    path.write_bytes(b"")
    return path


def test_a_checkout_has_no_prebuilt_library(package):
    assert extension.prebuilt_library() is None


def test_a_library_of_other_sources_is_not_the_prebuilt_one(package):
    _library(package, f"_{build_spec.EXTENSION_NAME}_000000000000")
    assert extension.prebuilt_library() is None
    expected = _library(package, build_spec.prebuilt_module(package / "csrc"))
    assert extension.prebuilt_library() == expected


def test_the_prebuilt_library_loads_without_compiling(package, monkeypatch):
    library = _library(package, build_spec.prebuilt_module(package / "csrc"))
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(extension, "_compile_and_import", lambda: pytest.fail("compiled"))
    assert extension.load() is torch.ops.pagedllm
    assert loaded == [str(library)]
    assert extension.loaded_from() == library


def test_a_prebuilt_library_that_does_not_load_falls_back_to_the_jit_build(package, monkeypatch):
    _library(package, build_spec.prebuilt_module(package / "csrc"))

    def broken(path: str) -> None:
        raise OSError(f"{path}: undefined symbol")  # as against another torch

    monkeypatch.setattr(torch.ops, "load_library", broken)
    monkeypatch.setattr(extension, "_compile_and_import", lambda: "built")
    assert extension.load() == "built"
