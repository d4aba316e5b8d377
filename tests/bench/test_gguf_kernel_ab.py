"""benchmarks.gguf_kernel_ab: each build's ops under a namespace of their own, and the builds
timed in turn."""

from __future__ import annotations

import pytest

from benchmarks import gguf_kernel_ab
from pagedllm.ops import build_spec


def test_the_kernel_source_registers_every_op_under_the_new_namespace():
    text = (build_spec.CSRC / gguf_kernel_ab.KERNEL_SOURCE).read_text()
    renamed = gguf_kernel_ab.namespaced_source(text, "gguf_ab_new")
    assert "(pagedllm," not in renamed
    assert renamed.count("(gguf_ab_new,") == text.count("(pagedllm,") >= 3


def test_a_source_registering_ops_otherwise_is_refused():
    with pytest.raises(ValueError, match="registers ops"):
        gguf_kernel_ab.namespaced_source("TORCH_LIBRARY(pagedllm, m) {}", "gguf_ab_x")


def test_the_builds_run_in_turn_and_the_warm_up_is_left_out():
    order: list[str] = []
    medians = gguf_kernel_ab.interleaved_medians(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3
    )
    assert order == ["a", "b"] * 4
    assert set(medians) == {"a", "b"} and all(s >= 0 for s in medians.values())
