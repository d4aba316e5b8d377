"""The request timelines every metrics sink reads (`pagedllm.metrics.frontend.timeline`): a
sequence's timeline is let go of when it ends, however it ends, so the API process holds
none for requests that are over (no server: the timelines are driven step by step)."""

from __future__ import annotations

from pagedllm.core.messages import EngineCoreOutput
from pagedllm.core.request import child_request_id
from pagedllm.metrics.frontend.timeline import RequestTimeline, TimelineSink
from pagedllm.metrics.stats import EngineStats

STATS = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0)


class FinishedSink(TimelineSink):
    """Records each finished sequence's (id, reason)."""

    def __init__(self) -> None:
        super().__init__()
        self.finished: list[tuple[str, str]] = []

    def on_finished(self, timeline: RequestTimeline, reason: str, now: float) -> None:
        self.finished.append((timeline.request_id, reason))


def token(request_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [1], False)


def start_parallel(sink: FinishedSink, request_id: str, n: int, now: float) -> list[str]:
    """A request with `n` samples, each of which has had its first token."""
    sink.on_request_added(request_id, now, 5, "t1")
    sample_ids = [child_request_id(request_id, i) for i in range(n)]
    sink.on_step([token(sample_id) for sample_id in sample_ids], [], STATS, now + 0.5)
    return sample_ids


def test_aborting_a_parallel_request_by_its_own_id_ends_every_sample():
    # A core's death forgets the request's samples before its handler aborts it, which then
    # names the request alone: its samples' timelines must end with it all the same.
    sink = FinishedSink()
    sample_ids = start_parallel(sink, "a", 3, 10.0)
    assert sorted(sink.timelines.open) == sorted(sample_ids)
    sink.on_request_aborted(["a"], 11.0)
    assert sink.timelines.open == {}
    assert sorted(sink.finished) == sorted((sample_id, "abort") for sample_id in sample_ids)


def test_aborting_a_parallel_request_whose_first_sample_ended_ends_the_others():
    sink = FinishedSink()
    sample_ids = start_parallel(sink, "a", 3, 10.0)
    finished = EngineCoreOutput("a", [2], True, finish_reason="length")
    sink.on_step([finished], [], STATS, 10.75)
    sink.on_request_aborted(["a"], 11.0)
    assert sink.timelines.open == {}
    assert sorted(sink.finished) == [("a", "length"), *((i, "abort") for i in sample_ids[1:])]


def test_aborting_every_sample_by_id_ends_each_once():
    # The client's abort names the whole family: each sample ends once, none twice.
    sink = FinishedSink()
    sample_ids = start_parallel(sink, "a", 3, 10.0)
    sink.on_request_aborted(sample_ids, 11.0)
    assert sink.timelines.open == {}
    assert sorted(sink.finished) == sorted((sample_id, "abort") for sample_id in sample_ids)


def test_many_aborted_parallel_requests_leave_no_timeline_behind():
    sink = FinishedSink()
    for index in range(200):
        request_id = f"r{index}"
        start_parallel(sink, request_id, 3, float(index))
        sink.on_request_aborted([request_id], index + 0.75)
    assert sink.timelines.open == {}
    assert len(sink.finished) == 600
