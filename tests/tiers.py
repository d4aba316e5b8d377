"""The two test tiers: `make test` runs every test (CI), `make test-fast` (`pytest -m "not
slow"`) leaves out the slow tier, for a run of a few minutes on two cores.

A test is slow (marked `slow` at collection, tests/conftest.py) when it
- lives under one of SLOW_DIRS (multi-rank TP/PP, Ray, fuzzing a live server);
- uses, directly or through other fixtures, a fixture decorated with `@slow_fixture`
  (each fixture that starts an HTTP server or another process is);
- is marked `@pytest.mark.slow` itself (or its module: `pytestmark = pytest.mark.slow`):
  a test that starts a process in its body, or runs a real model, or takes long otherwise.

What stays fast: the scheduler, the KV manager, sampling, the ops kernels, models against
Transformers on tiny random models, offline `LLM` engines in this process.
A test that starts a process through tests/process_guard.py without being slow fails
there, so the fast tier stays free of servers and child processes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

SLOW_DIRS = ("distributed", "fuzz")
_TESTS = Path(__file__).parent
_SLOW_ATTRIBUTE = "_pagedllm_slow_fixture"

F = TypeVar("F", bound=Callable)


def slow_fixture(function: F) -> F:
    """Under `@pytest.fixture`: every test that uses this fixture is slow."""
    setattr(function, _SLOW_ATTRIBUTE, True)
    return function


def is_slow(item: pytest.Item) -> bool:
    if item.get_closest_marker("slow") is not None:
        return True
    path = Path(item.path)
    if path.is_relative_to(_TESTS) and path.relative_to(_TESTS).parts[0] in SLOW_DIRS:
        return True
    fixture_info = getattr(item, "_fixtureinfo", None)
    if fixture_info is None:
        return False
    # Every fixture the test needs, those its fixtures need included.
    return any(
        getattr(definition.func, _SLOW_ATTRIBUTE, False)
        for definitions in fixture_info.name2fixturedefs.values()
        for definition in definitions
    )


def mark_slow_tier(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None and is_slow(item):
            item.add_marker(pytest.mark.slow)
