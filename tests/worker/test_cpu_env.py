from __future__ import annotations

from pagedllm.worker import cpu_env


def test_tune_malloc_applies_on_glibc():
    assert cpu_env.tune_malloc() is True


def test_tune_malloc_can_be_disabled(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_MALLOC_TUNING", "0")
    assert cpu_env.tune_malloc() is False
