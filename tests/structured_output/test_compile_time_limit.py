"""A grammar that compiles past the time limit ends its request with an error naming the
field, while the compiles queued behind it move to a fresh thread and finish, and requests
without a grammar run on. A fake backend stands in for xgrammar: no model, no timings
asserted (the slow compile waits on an event the test sets only at the end), and the
manager's clock is the test's: the slow compile passes its time limit when the test moves
that clock, and the quick ones, which it never moves past, never can."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import manager as manager_module
from pagedllm.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from pagedllm.structured_output.manager import StructuredOutputManager

VOCAB, EOS = 40, 39
COMPILE_TIMEOUT_S = 0.5
HANG_GUARD_S = 30.0  # only a bound on waiting, never what decides an outcome


class AnyTokenMatcher(GrammarMatcher):
    def accept_token(self, token_id: int) -> bool:
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        pass  # every token allowed

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False


class SlowBackend(StructuredOutputBackend):
    """The regex "slow" compiles until `release` is set (`started` says it is running); any
    other spec at once."""

    name = "slow"

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def compile(self, spec: StructuredOutputsParams):
        if spec.regex == "slow":
            self.started.set()
            self.release.wait(60)
        return spec.regex

    def matcher(self, compiled) -> AnyTokenMatcher:
        return AnyTokenMatcher()

    def validate(self, spec) -> None:
        pass


class FakeClock:
    """The manager's `time`: its monotonic() moves only when the test advances it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(manager_module, "time", fake)
    return fake


@pytest.fixture
def scheduler(clock):
    manager = StructuredOutputManager(object(), VOCAB, [EOS], compile_timeout_s=COMPILE_TIMEOUT_S)
    manager._backend = SlowBackend()
    yield Scheduler(SchedulerConfig(64, 8, 128, "fcfs"), KVCacheManager(33, 4, False), manager)
    manager._backend.release.set()  # the abandoned compile thread ends
    manager.shutdown()


def add(scheduler: Scheduler, request_id: str, regex: str | None) -> None:
    spec = StructuredOutputsParams(regex=regex) if regex else None
    params = SamplingParams(max_tokens=3, structured_outputs=spec, ignore_eos=True)
    scheduler.add_request(Request(request_id, [1, 2, 3], params, frozenset({EOS})))


def run_until_done(scheduler: Scheduler) -> dict[str, object]:
    """Step with token 3 for every sampling row until nothing is left; the final outputs."""
    finished = {}
    deadline = time.monotonic() + HANG_GUARD_S
    while scheduler.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not finish"
        output = scheduler.schedule()
        sampled = {
            request_id: [3]
            for request_id in output.num_scheduled_tokens
            if (r := scheduler.requests[request_id]).num_computed_tokens == r.num_tokens
        }
        outputs = scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids=sampled))
        finished |= {o.request_id: o for o in outputs if o.finished}
        if not output.num_scheduled_tokens:
            time.sleep(0.01)
    return finished


def past_the_limit(scheduler: Scheduler, clock: FakeClock) -> None:
    """Once the slow compile is running, move the clock past its time limit."""
    assert scheduler.grammar.manager._backend.started.wait(HANG_GUARD_S)
    clock.advance(2 * COMPILE_TIMEOUT_S)


def test_a_compile_past_the_limit_fails_its_request_alone(scheduler, clock):
    add(scheduler, "slow", "slow")
    add(scheduler, "queued-behind", "quick")  # waits for the compile thread "slow" holds
    add(scheduler, "free", None)
    past_the_limit(scheduler, clock)
    finished = run_until_done(scheduler)
    slow = finished["slow"]
    assert slow.finish_reason == "error"
    assert "structured_outputs" in slow.error and "time limit" in slow.error
    assert finished["queued-behind"].finish_reason == "length"
    assert finished["free"].finish_reason == "length"
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


def test_the_same_slow_spec_again_fails_without_a_second_stuck_thread(scheduler, clock):
    add(scheduler, "slow-1", "slow")
    past_the_limit(scheduler, clock)
    assert run_until_done(scheduler)["slow-1"].finish_reason == "error"
    manager = scheduler.grammar.manager
    add(scheduler, "slow-2", "slow")  # shares the still-running compile
    add(scheduler, "quick", "quick")
    finished = run_until_done(scheduler)
    assert finished["slow-2"].finish_reason == "error"
    assert finished["quick"].finish_reason == "length"
    assert len(manager._abandoned) == 1
