"""benchmarks.gguf_matmul --whole-model: every layer on tables of its own (so a step streams
them from memory) and the same numbers as the layer it copies."""

from __future__ import annotations

import argparse

import torch

from benchmarks import gguf_matmul
from benchmarks.random_gguf import TINY


def test_a_copied_layer_holds_its_own_tables_and_computes_the_same():
    _, n, k, qtype = gguf_matmul.projections(TINY)[0]
    layer = gguf_matmul.random_layer(n, k, qtype, digits=2)
    twin = gguf_matmul._copy(layer)
    for name, table in layer.named_buffers():
        assert twin.get_buffer(name).data_ptr() != table.data_ptr()
    x = torch.randn(3, k)
    want, got = torch.empty(3, n), torch.empty(3, n)
    layer.matmul_into(x, want)
    twin.matmul_into(x, got)
    assert torch.equal(want, got)


def test_whole_model_prints_a_step_for_each_row_count(capsys):
    args = argparse.Namespace(rows="1,3", digits=2, repeats=1, isa=gguf_matmul.gguf_kernel_isa())
    gguf_matmul.time_whole_model(TINY, args)
    lines = capsys.readouterr().out.splitlines()
    assert f"{TINY.num_layers} layers and the head" in lines[0]
    assert [int(line.removeprefix("rows=").split()[0]) for line in lines[1:]] == [1, 3]
    assert all("ms a step" in line and "GB/s" in line for line in lines[1:])
