"""Scheduling policies: who goes next in a step, what is kept for others, who is preempted.

The scheduler (`core/scheduler.py`) owns the one loop of a step: it takes each candidate a
policy offers, runs it through the same mechanics (blocks, preemption, LoRA slots, KV tiers,
drafts, the pipeline's batches in flight) and tells the policy the outcome. A policy only
orders and charges:

- `candidates(step)`: a generator of requests, running ones (to continue) and waiting ones
  (to admit); each `yield` receives the `Outcome` of the request it offered;
- `reserved_for_others(step, request)`: seats and blocks the request may not take;
- `affords(step, request, num_tokens)`: whether the request may spend the tokens now;
- `preemption_victim(step, request)`: the running request to preempt when `request` finds
  the pool short (possibly itself), and `before_preempt` just before it is;
- `charge(step, request, ...)`: what a scheduled request cost.

`fcfs` and `priority` are below; `fair` is in `core/fair_policy.py`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from pagedllm.core.fair_share import Holding
from pagedllm.core.kv_cache_manager import KVAllocation
from pagedllm.core.request import Request
from pagedllm.core.request_queue import FCFSQueue, PriorityQueue, RequestQueue, priority_key


class Outcome(enum.Enum):
    """What became of a candidate."""

    SCHEDULED = enum.auto()  # its tokens are in the step
    SKIPPED = enum.auto()  # passed over this step (in flight, no LoRA slot, grammar or
    # KV read pending); the candidates behind it may go
    NO_ROOM = enum.auto()  # a waiting request that does not fit (seats or blocks)
    UNAFFORDABLE = enum.auto()  # the policy does not let it spend the tokens now
    WAITING = enum.auto()  # a running request whose blocks are kept for others this step
    PREEMPTED = enum.auto()  # a running request preempted to find its own blocks


@dataclass
class StepState:
    """One step's working state, shared by the scheduler and its policy."""

    budget: int
    running: list[Request]  # the scheduler's running requests (admission order)
    in_flight: set[str]  # pipeline parallel: requests in a batch still running
    speculating: bool
    # The scheduler's preemption of a request already out of `running` (frees its blocks,
    # queues it again).
    release: Callable[[Request], None]
    num_seats: int = 0  # seats held: each running request and the samples it will fork
    num_preemptions: int = 0
    loras: set[int] = field(default_factory=set)  # LoRA adapters this step runs
    skipped: list[Request] = field(default_factory=list)  # waiting ones passed over

    def tokens_due(self, request: Request) -> int:
        """Tokens a running request would run now: what it is behind by, plus the drafts
        it verifies when this step speculates, within what is left of the budget."""
        if not self.speculating:
            request.spec_token_ids = []
        behind = request.num_tokens - request.num_computed_tokens
        return min(behind + len(request.spec_token_ids), self.budget)

    def preempt(self, victim: Request) -> None:
        """Preempt a running request not scheduled this step."""
        self.num_seats -= seats_of(victim)
        self.num_preemptions += 1
        self.running.remove(victim)
        self.release(victim)


Candidates = Generator[Request, Outcome, None]


def seats_of(request: Request) -> int:
    """Seats a request holds: itself and the samples it will fork (n > 1)."""
    return 1 + request.num_unforked_samples


class SchedulingPolicy:
    """First come, first served: running requests in admission order, then waiting ones in
    queue order, none after a preemption; the newest running request is preempted."""

    name = "fcfs"

    def __init__(self) -> None:
        self.waiting: RequestQueue = self.new_queue()

    def new_queue(self) -> RequestQueue:
        return FCFSQueue()

    def begin_step(self, step: StepState) -> None:
        """Called before `candidates`; the default keeps the running order."""

    def candidates(self, step: StepState) -> Candidates:
        index = 0
        while index < len(step.running):
            outcome = yield step.running[index]
            if outcome is Outcome.PREEMPTED:
                return  # the pool is short: no one else runs or joins this step
            index += 1
        if step.num_preemptions:
            return
        while len(self.waiting):
            if (yield self.waiting.peek()) is Outcome.NO_ROOM:
                return

    def reserved_for_others(self, step: StepState, request: Request) -> Holding:
        return Holding()

    def affords(self, step: StepState, request: Request, num_tokens: int) -> bool:
        return True

    def preemption_victim(self, step: StepState, request: Request) -> Request:
        """The newest running request not in flight (the one asking, at worst: those
        before it are in flight or scheduled this step)."""
        for victim in reversed(step.running):
            if victim.request_id not in step.in_flight:
                return victim
        raise AssertionError("every running request is in flight")

    def may_admit(self, step: StepState, request: Request) -> bool:
        return True

    def before_preempt(self, step: StepState, victim: Request) -> None:
        """`victim` is about to be preempted for a request's blocks (it still holds them)."""

    def charge(
        self,
        step: StepState,
        request: Request,
        num_tokens: int,
        allocation: KVAllocation,
        num_admitted_blocks: int | None,
    ) -> None:
        """`request` runs `num_tokens` on `allocation`; `num_admitted_blocks`: the free blocks
        its admission took (None for a running request)."""


class PriorityPolicy(SchedulingPolicy):
    """Lowest `priority` value first (ties by arrival), running and waiting alike; the
    lowest-priority running request is preempted."""

    name = "priority"

    def new_queue(self) -> RequestQueue:
        return PriorityQueue()

    def begin_step(self, step: StepState) -> None:
        step.running.sort(key=priority_key)


def create_policy(name: str, make_fair: Callable[[], SchedulingPolicy]) -> SchedulingPolicy:
    """The policy called `name`; `make_fair` builds "fair" (it needs the pool's size)."""
    if name == "fair":
        return make_fair()
    policies = {policy.name: policy for policy in (SchedulingPolicy, PriorityPolicy)}
    if name not in policies:
        choices = sorted([*policies, "fair"])
        raise ValueError(f"scheduling_policy {name!r} is unknown; choose one of {choices}")
    return policies[name]()
