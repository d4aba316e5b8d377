"""The engine-core process loop's own guard: a request the core refuses fails alone."""

from __future__ import annotations

import os
import queue

from pagedllm.core.engine_core_proc import EngineCoreProc
from pagedllm.core.messages import EngineCoreOutputs, EngineCoreRequest
from pagedllm.metrics.stats import EngineStats
from pagedllm.sampling_params import SamplingParams

IDLE_STATS = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0)


class RefusingCore:
    """Refuses every request, as the scheduler refuses an id that is already running."""

    def __init__(self) -> None:
        self.added: list[str] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        raise ValueError(f"request_id {request.request_id!r} is already in use")

    def get_stats(self) -> EngineStats:
        return IDLE_STATS


def test_a_request_the_core_refuses_fails_alone():
    proc = EngineCoreProc.__new__(EngineCoreProc)  # no sockets: only the loop's logic
    proc.core = RefusingCore()
    proc.output_queue = queue.Queue()
    request = EngineCoreRequest("dup", [1, 2, 3], SamplingParams(max_tokens=2), [0], 0.0)
    assert proc._apply(request) == 0  # no exception: the core goes on
    event = proc.output_queue.get_nowait()
    assert isinstance(event, EngineCoreOutputs)
    [failed] = event.outputs
    assert failed.request_id == "dup" and failed.finished
    assert failed.finish_reason == "error"
    assert failed.error == "ValueError: request_id 'dup' is already in use"


def test_a_core_whose_api_process_died_while_it_started_exits_at_once(monkeypatch):
    """The API process passes its pid: a core that finds another parent (its own died and
    it was adopted) returns before it loads anything, signal handlers untouched."""
    from pagedllm.core import engine_core_proc as core_proc

    def never(*args, **kwargs):
        raise AssertionError("the core went on starting")

    monkeypatch.setattr(core_proc, "load_engine_config", never)
    monkeypatch.setattr(core_proc.signal, "signal", never)
    dead_parent = os.getppid() + 1 if os.getppid() != 1 else 2
    core_proc.run_engine_core(None, "ipc://unused-in", "ipc://unused-out", 0, dead_parent)
