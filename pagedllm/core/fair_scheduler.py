"""The scheduler's step under the "fair" policy: a tenant that floods the queue cannot starve
another. Mixed into `Scheduler` (core/scheduler.py), whose bookkeeping it shares.

One step, in two phases (the rule is also written out in `Scheduler.schedule`):

1. Claims (seats and KV by dominant share; only while two or more tenants have requests):
   the waiting tenant whose dominant share (`core/fair_share.py`) would be lowest with its
   next request admitted claims a seat and the blocks for that request's first chunk. When
   they are not free, the newest running request of the tenant with the highest dominant
   share is preempted for it, provided the claimant would still hold no more than that
   tenant afterwards (and holds less now), so two tenants never take seats back and forth.
   A tenant preempted from claims nothing this step, and one that claimed is not preempted
   from. Claims stop at the first request that neither fits nor may preempt, and once they
   add up to the step's token budget. What is claimed is kept for the claimant this step:
   other tenants admit nothing into claimed seats, and their requests do not take claimed
   blocks (a running request that would need them waits a step).
2. Tokens by weighted deficit round-robin: from the tenant whose turn it is, around the
   ring, each turn schedules the tenant's running requests (in admission order), then
   admits its waiting ones (oldest first, a preempted one at its head), while the tenant's
   deficit covers each one's tokens this step (what it is behind by, capped by what is left
   of the budget) and max_num_seqs, free blocks and claims allow; a waiting request that
   does not fit ends the tenant's admissions for the step. When a running request finds
   the pool short, the newest not-yet-scheduled running request of the tenant with the
   highest dominant share is preempted (possibly itself), and from then on only claimants
   admit. A round in which no tenant could afford its next request credits every tenant
   the rounds the cheapest one needs at once, so a step costs O(tenants) per turn.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.core.fair_share import FairShare, Holding, Tenant
from pagedllm.core.request import Request
from pagedllm.core.request_queue import FairQueue
from pagedllm.utils import cdiv

if TYPE_CHECKING:
    from pagedllm.config import SchedulerConfig
    from pagedllm.core.kv_cache_manager import KVAllocation, KVCacheManager
    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.structured_output.manager import StructuredOutputManager


@dataclass
class _Step:
    """One fair step's working state."""

    budget: int
    num_seats: int = 0
    holdings: dict[Tenant, Holding] = field(default_factory=dict)
    # Each tenant's running requests not yet scheduled this step, oldest admitted first.
    running: dict[Tenant, deque[Request]] = field(default_factory=dict)
    admission_order: dict[str, int] = field(default_factory=dict)
    claims: dict[Tenant, Holding] = field(default_factory=dict)
    claimed: Holding = field(default_factory=Holding)
    blocked: set[Tenant] = field(default_factory=set)  # no more admissions this step
    only_claimants_admit: bool = False  # set by a preemption for lack of blocks
    skipped: list[Request] = field(default_factory=list)  # grammars still compiling

    def holding(self, tenant: Tenant) -> Holding:
        return self.holdings.setdefault(tenant, Holding())

    def claimed_by_others(self, tenant: Tenant) -> Holding:
        own = self.claims.get(tenant, Holding())
        return Holding(self.claimed.seats - own.seats, self.claimed.blocks - own.blocks)


class FairScheduling:
    """The "fair" policy's step. `Scheduler` provides the attributes below and the helpers
    it shares with the other policies: `_schedule` (put a request's tokens in the step),
    `_preempt`, `_start_running` (a waiting request admitted) and `_grammar_pending`."""

    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    structured_output: StructuredOutputManager | None
    running: list[Request]
    waiting: FairQueue
    fair_share: FairShare

    def _schedule_fair(self, output: SchedulerOutput) -> None:
        kv = self.kv_cache_manager
        step = _Step(self.config.max_num_batched_tokens)
        for index, request in enumerate(self.running):
            holding = step.holding(request.tenant)
            seats = 1 + request.num_unforked_samples
            holding.seats += seats
            holding.blocks += kv.num_held_blocks(request.request_id)
            step.num_seats += seats
            step.running.setdefault(request.tenant, deque()).append(request)
            step.admission_order[request.request_id] = index
        self.fair_share.sync_ring([*step.running, *self.waiting.tenants()])
        if len(self.fair_share.ring) > 1 and len(self.waiting):
            self._claim_fair_shares(step)
        self._take_turns(output, step)
        for request in reversed(step.skipped):  # back at their tenants' heads, in order
            self.waiting.add_preempted(request)

    # ---- phase 1: seats and blocks by dominant share ------------------------------------------
    def _share(self, step: _Step, tenant: Tenant, seats: int = 0, blocks: int = 0) -> float:
        holding = step.holding(tenant)
        claim = step.claims.get(tenant, Holding())
        return self.fair_share.dominant_share(
            tenant, holding.seats + claim.seats + seats, holding.blocks + claim.blocks + blocks
        )

    def _first_chunk(self, request: Request, budget: int) -> tuple[list, int, int]:
        """(prefix-cache hits, their tokens, tokens to compute) if admitted now."""
        hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        return hits, num_hit_tokens, min(request.num_tokens - num_hit_tokens, budget)

    def _claim_fair_shares(self, step: _Step) -> None:
        kv, fair = self.kv_cache_manager, self.fair_share
        free_seats = self.config.max_num_seqs - step.num_seats
        next_index = dict.fromkeys(self.waiting.tenants(), 0)
        # Hits do not change in this phase (it frees blocks, and freed ones stay cached).
        chunks: dict[str, tuple[list, int, int]] = {}
        num_claimed_tokens = 0
        while next_index and num_claimed_tokens < step.budget:
            candidates = []
            for tenant, index in next_index.items():
                request = self.waiting.tenant_queue(tenant)[index]
                if request.request_id not in chunks:
                    chunks[request.request_id] = self._first_chunk(request, step.budget)
                hits, num_hit_tokens, num_tokens = chunks[request.request_id]
                seats = 1 + request.num_unforked_samples
                blocks = cdiv(num_hit_tokens + num_tokens, kv.block_size)
                share = self._share(step, tenant, seats, blocks)
                candidates.append((share, fair.position(tenant), tenant, request, hits, num_tokens))
            share, _, tenant, request, hits, num_tokens = min(candidates, key=lambda c: c[:2])
            if self._grammar_compiling(request):
                del next_index[tenant]  # its turn comes when the grammar is ready
                continue
            seats = 1 + request.num_unforked_samples
            while True:
                needed = kv.num_blocks_to_allocate(request, num_tokens, hits)
                if seats <= free_seats and needed <= kv.num_free_blocks - step.claimed.blocks:
                    break
                victim = self._claim_victim(step, tenant, share)
                if victim is None:
                    break
                next_index.pop(victim.tenant, None)  # it claims nothing this step
                free_seats += 1 + victim.num_unforked_samples
                self._preempt_fair(step, victim)
            if seats > free_seats or needed > kv.num_free_blocks - step.claimed.blocks:
                del next_index[tenant]
                continue
            claim = step.claims.setdefault(tenant, Holding())
            claim.seats += seats
            claim.blocks += needed
            step.claimed.seats += seats
            step.claimed.blocks += needed
            free_seats -= seats
            num_claimed_tokens += num_tokens
            next_index[tenant] += 1
            if next_index[tenant] == len(self.waiting.tenant_queue(tenant)):
                del next_index[tenant]

    def _claim_victim(self, step: _Step, claimant: Tenant, claimant_share: float) -> Request | None:
        """The newest running request of the tenant with the highest dominant share, if the
        claimant may take its place (see the module's docstring), else None."""
        kv = self.kv_cache_manager
        options = [
            (self._share(step, tenant), step.admission_order[queue[-1].request_id], tenant)
            for tenant, queue in step.running.items()
            if queue and tenant != claimant and tenant not in step.claims
        ]
        if not options:
            return None
        share, _, tenant = max(options)
        victim = step.running[tenant][-1]
        seats = 1 + victim.num_unforked_samples
        blocks = kv.num_held_blocks(victim.request_id)
        share_after = self._share(step, tenant, -seats, -blocks)
        if claimant_share <= share_after and self._share(step, claimant) < share:
            return victim
        return None

    def _grammar_compiling(self, request: Request) -> bool:
        manager = self.structured_output
        if manager is None or request.structured_output is None:
            return False
        try:
            return not manager.is_ready(request)
        except Exception:  # the admission (`_grammar_pending`) ends it
            return False

    def _preempt_fair(self, step: _Step, victim: Request) -> None:
        """Preempt a running request not yet scheduled this step."""
        holding = step.holding(victim.tenant)
        holding.seats -= 1 + victim.num_unforked_samples
        holding.blocks -= self.kv_cache_manager.num_held_blocks(victim.request_id)
        step.num_seats -= 1 + victim.num_unforked_samples
        step.running[victim.tenant].remove(victim)
        self.running.remove(victim)
        self._preempt(victim)

    # ---- phase 2: tokens by deficit round-robin -----------------------------------------------
    def _has_work(self, step: _Step, tenant: Tenant) -> bool:
        return bool(step.running.get(tenant)) or (
            tenant not in step.blocked and bool(self.waiting.tenant_queue(tenant))
        )

    def _take_turns(self, output: SchedulerOutput, step: _Step) -> None:
        fair = self.fair_share
        while step.budget > 0 and fair.ring:
            progress = False
            for _ in range(len(fair.ring)):
                tenant = fair.current
                if self._has_work(step, tenant):
                    fair.start_turn()
                    progress |= self._take_turn(output, step, tenant)
                    if step.budget == 0:
                        return  # the turn goes on next step
                fair.end_turn(idle=not self._has_work(step, tenant))
            if not progress:
                active = [tenant for tenant in fair.ring if self._has_work(step, tenant)]
                if not active:
                    return
                rounds = min(
                    fair.rounds_to_afford(tenant, self._next_cost(step, tenant))
                    for tenant in active
                )
                fair.add_rounds(active, rounds - 1)  # the next pass credits the last one

    def _next_cost(self, step: _Step, tenant: Tenant) -> int:
        """Tokens the tenant's next request would take this step."""
        queue = step.running.get(tenant)
        if queue:
            request = queue[0]
            return min(request.num_tokens - request.num_computed_tokens, step.budget)
        return self._first_chunk(self.waiting.tenant_queue(tenant)[0], step.budget)[2]

    def _take_turn(self, output: SchedulerOutput, step: _Step, tenant: Tenant) -> bool:
        """Run the tenant's requests while its deficit covers them; whether anything changed."""
        fair = self.fair_share
        progress = False
        running = step.running.get(tenant)
        while step.budget > 0:
            if running:
                request = running[0]
                num_tokens = min(request.num_tokens - request.num_computed_tokens, step.budget)
                if num_tokens > fair.deficit(tenant):
                    break
                progress = True
                allocation = self._allocate_fair(step, request, num_tokens)
                if running and running[0] is request:
                    running.popleft()
                if allocation is None:
                    continue  # preempted, or waits for blocks claimed by others
                step.holding(tenant).blocks += len(allocation.new_blocks)
                self._schedule(output, request, num_tokens, allocation)
            elif self._has_work(step, tenant):
                request = self.waiting.tenant_queue(tenant)[0]
                if self._grammar_pending(request):
                    if not request.is_finished:  # still compiling: let the ones behind go
                        step.skipped.append(self.waiting.pop_tenant(tenant))
                    progress = True
                    continue
                admitted = self._admit_fair(output, step, request)
                if admitted is None:
                    step.blocked.add(tenant)
                    return True
                if admitted == 0:
                    break
                progress = True
                num_tokens = admitted
            else:
                break
            fair.charge(tenant, num_tokens)
            step.budget -= num_tokens
        return progress

    def _allocate_fair(self, step: _Step, request: Request, num_tokens: int) -> KVAllocation | None:
        """Blocks for a running request's tokens; when the pool is short, preempt the newest
        unscheduled running request of the tenant with the highest dominant share."""
        kv = self.kv_cache_manager
        while True:
            needed = kv.num_blocks_to_allocate(request, num_tokens)
            if needed <= kv.num_free_blocks - step.claimed_by_others(request.tenant).blocks:
                return kv.allocate_slots(request, num_tokens)
            if needed <= kv.num_free_blocks:
                return None  # the free blocks are claimed by tenants below their share
            _, _, tenant = max(
                (self._share(step, tenant), step.admission_order[queue[-1].request_id], tenant)
                for tenant, queue in step.running.items()
                if queue
            )
            victim = step.running[tenant][-1]
            self._preempt_fair(step, victim)
            step.only_claimants_admit = True
            if victim is request:
                return None

    def _admit_fair(self, output: SchedulerOutput, step: _Step, request: Request) -> int | None:
        """Admit a tenant's oldest waiting request: the tokens scheduled, 0 if its deficit
        does not cover them yet, None if it does not fit (the tenant admits no more)."""
        kv = self.kv_cache_manager
        tenant = request.tenant
        claim = step.claims.get(tenant)
        if step.only_claimants_admit and claim is None:
            return None
        others = step.claimed_by_others(tenant)
        seats = 1 + request.num_unforked_samples
        if step.num_seats + seats > self.config.max_num_seqs - others.seats:
            return None
        hits, num_hit_tokens, num_tokens = self._first_chunk(request, step.budget)
        if num_tokens > self.fair_share.deficit(tenant):
            return 0
        needed = kv.num_blocks_to_allocate(request, num_tokens, hits)
        if needed > kv.num_free_blocks - others.blocks:
            return None
        allocation = kv.allocate_slots(request, num_tokens, hits)
        if allocation is None:
            return None
        self.waiting.pop_tenant(tenant)
        self._start_running(request, num_hit_tokens)
        step.num_seats += seats
        holding = step.holding(tenant)
        holding.seats += seats
        holding.blocks += kv.num_held_blocks(request.request_id)
        if claim is not None:
            used = Holding(min(seats, claim.seats), min(needed, claim.blocks))
            claim.seats -= used.seats
            claim.blocks -= used.blocks
            step.claimed.seats -= used.seats
            step.claimed.blocks -= used.blocks
        self._schedule(output, request, num_tokens, allocation)
        return num_tokens
