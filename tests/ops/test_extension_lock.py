"""The extension's build lock: a lock file left by a killed build never stalls a later start,
and a build holds a lock that another process cannot take meanwhile."""

from __future__ import annotations

import fcntl

import pytest
import torch.utils.cpp_extension

from pagedllm.ops import extension


def test_a_lock_left_by_a_killed_build_is_cleared(monkeypatch, tmp_path):
    directory = tmp_path / "build"
    directory.mkdir()
    (directory / "lock").touch()  # torch's lock file, as a build killed mid-way leaves it
    monkeypatch.setattr(extension, "cache_dir", lambda: directory)
    monkeypatch.setattr(extension, "kernel_isa_missing", lambda: None)
    monkeypatch.setattr(extension, "_register_fake_kernels", lambda: None)
    seen = []

    def build(**kwargs):
        seen.append((directory / "lock").exists())
        with open(tmp_path / "build.lock") as other_process, pytest.raises(BlockingIOError):
            fcntl.flock(other_process, fcntl.LOCK_EX | fcntl.LOCK_NB)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    extension._compile_and_import()
    assert seen == [False]
    with open(tmp_path / "build.lock") as after:  # released once the build is done
        fcntl.flock(after, fcntl.LOCK_EX | fcntl.LOCK_NB)
