"""benchmarks.soak's API RSS series: readings until the deadline, and the baseline growth is
measured from (the first reading at least N seconds into the traffic)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from benchmarks.soak import baseline_rss, sample_api


class _Process:
    """RSS growing by one MB a reading."""

    def __init__(self) -> None:
        self.readings = 0

    def memory_info(self) -> SimpleNamespace:
        self.readings += 1
        return SimpleNamespace(rss=self.readings * 1_000_000)


def test_the_baseline_is_the_first_reading_at_or_after_its_age():
    series = [[0, 100], [60, 110], [120, 130], [180, 131]]
    assert baseline_rss(series, 60) == 110
    assert baseline_rss(series, 61) == 130
    assert baseline_rss(series, 0) == 100


def test_a_baseline_later_than_the_traffic_is_its_last_reading():
    assert baseline_rss([[0, 100], [60, 120]], 300) == 120


def test_the_api_is_read_every_period_until_the_deadline():
    process, series = _Process(), []
    started = time.monotonic()
    asyncio.run(sample_api(process, started, started + 0.25, 0.1, series))
    assert [rss for _, rss in series] == [1_000_000 * (i + 1) for i in range(len(series))]
    assert 1 <= len(series) <= 4  # never past the deadline (fewer on a loaded machine)
    assert time.monotonic() - started < 5.0
    assert all(at == 0 for at, _ in series)  # whole seconds into the traffic
