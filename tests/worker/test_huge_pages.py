"""Large weights move into one arena advised for transparent huge pages, values and tensor
objects kept; small ones stay; PAGEDLLM_HUGE_PAGES=0 leaves everything where it was."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from pagedllm.runner import huge_pages


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 8))  # 2 MB and 32 KB weights
    model.register_buffer("table", torch.randn(300, 1024))  # 1.2 MB
    return model


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_large_weights_move_to_an_advised_arena():
    model = _model()
    big, small, table = model[0].weight, model[1].weight, model.table
    before = {name: t.clone() for name, t in [("big", big), ("small", small), ("table", table)]}
    small_address = small.data_ptr()
    x = torch.randn(3, 512)
    expected = model(x)
    moved = huge_pages.place_weights_on_huge_pages(model)
    assert moved == big.nbytes + table.nbytes  # both multiples of the 64-byte alignment
    assert model[0].weight is big and model.table is table  # same objects, new storage
    assert table.data_ptr() == big.data_ptr() + big.nbytes
    assert small.data_ptr() == small_address
    for name, tensor in [("big", big), ("small", small), ("table", table)]:
        assert torch.equal(tensor, before[name])
    assert torch.equal(model(x), expected)
    assert "hg" in _vm_flags(big.data_ptr())  # MADV_HUGEPAGE is on the arena's mapping


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "0")
    model = _model()
    address = model[0].weight.data_ptr()
    assert huge_pages.place_weights_on_huge_pages(model) == 0
    assert model[0].weight.data_ptr() == address


_REUSE_PROBE = """
import resource, sys, torch
from pagedllm.runner import huge_pages
if sys.argv[1] == "reuse":
    assert huge_pages.reuse_activation_pages()
def faults_writing_a_fresh_buffer() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(48 * 1024 * 1024, dtype=torch.uint8).fill_(1)  # freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_writing_a_fresh_buffer()  # the first one faults in either way
print(min(faults_writing_a_fresh_buffer() for _ in range(3)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_activation_buffers_reuse_their_pages_after_the_first_step():
    """A 48 MB buffer, freed and made again (a step's activations at a 2,048-token chunk of
    a 1B model): glibc's default maps it afresh each time, 12,288 page faults; once the heap
    keeps such buffers, the second one reuses the first one's pages."""

    def faults(mode: str) -> int:
        probe = [sys.executable, "-c", _REUSE_PROBE, mode]
        return int(subprocess.run(probe, capture_output=True, text=True, check=True).stdout)

    pages = 48 * 1024 * 1024 // 4096
    assert faults("default") > pages // 2
    assert faults("reuse") < pages // 20
