"""benchmarks.arithmetic_peak: its loops build, run and are read back as per-cycle rates
that a core can actually issue."""

from __future__ import annotations

import shutil

import pytest

from benchmarks import arithmetic_peak


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the loops are built with gcc")
def test_rates_are_per_cycle_issue_rates():
    figures = arithmetic_peak.measure(seconds=0.02, threads=1)
    # The add chain defines the cycle, so it is exactly one a cycle by construction.
    assert figures["clock"]["per_cycle_per_core"] == pytest.approx(1.0)
    assert figures["clock"]["per_second"] > 1e8
    assert "fp32_fma_256" in figures  # every x86-64 CPU this runs on has AVX2 and FMA
    # The clock is measured apart from each rate, and a shared VM's core speed moves between
    # the two (70.6 FLOP a cycle read on a 64-FLOP core), so the ceilings carry a quarter's
    # slack: still below what a loop miscounted by a factor of two would report.
    slack = 1.25
    for name in ("fp32_fma_256", "fp32_fma_512"):
        if name in figures:  # 512-bit only where the CPU has AVX-512
            # At least one 8-lane FMA every other cycle; no x86 core issues more than two
            # 16-lane FMAs a cycle (64 FLOP).
            assert 4 <= figures[name]["per_cycle_per_core"] <= 64 * slack, (name, figures)
    for name in ("int8_vnni_256", "int8_vnni_512"):
        if name in figures:  # only where the CPU has AVX-512 VNNI
            assert 8 <= figures[name]["per_cycle_per_core"] <= 128 * slack, (name, figures)
    for name in ("bf16_dot_256", "bf16_dot_512"):
        if name in figures:  # only where the CPU has AVX512-BF16
            # Four FLOP per fp32 lane; from one 8-lane dot product every eighth cycle to two
            # 16-lane ones a cycle.
            assert 4 <= figures[name]["per_cycle_per_core"] <= 128 * slack, (name, figures)
    if "int8_amx_tile" in figures:  # only where the CPU has AMX-INT8 and Linux grants it
        # A tile multiply is 16 x 16 x 64 MACs; Sapphire Rapids issues one every 16 cycles
        # (1,024 a cycle); a quarter of that at least, or the loop is not on the tiles.
        assert 256 <= figures["int8_amx_tile"]["per_cycle_per_core"] <= 1024 * slack, figures
