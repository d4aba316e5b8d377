"""The "fair" scheduling policy: a tenant that floods the queue cannot starve another.

It orders and charges (`core/policy.py`); the scheduler's loop does the rest, as for every
policy, so LoRA slots, KV tiers, speculative drafts (charged to their tenant) and the
pipeline's batches in flight (neither scheduled nor preempted) work as under `fcfs`.

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
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.core.fair_share import FairShare, Holding, Tenant
from pagedllm.core.policy import Candidates, Outcome, SchedulingPolicy, StepState, seats_of
from pagedllm.core.request import Request
from pagedllm.core.request_queue import FairQueue, RequestQueue
from pagedllm.utils import cdiv

if TYPE_CHECKING:
    from pagedllm.config import SchedulerConfig
    from pagedllm.core.kv_cache_manager import KVAllocation, KVCacheManager
    from pagedllm.structured_output.scheduling import GrammarScheduling


@dataclass
class _FairStep:
    """One step's working state under the fair policy."""

    holdings: dict[Tenant, Holding] = field(default_factory=dict)
    # Each tenant's running requests not yet scheduled this step, oldest admitted first
    # (those in flight are left out: they are neither scheduled nor preempted).
    running: dict[Tenant, deque[Request]] = field(default_factory=dict)
    admission_order: dict[str, int] = field(default_factory=dict)
    claims: dict[Tenant, Holding] = field(default_factory=dict)
    claimed: Holding = field(default_factory=Holding)
    blocked: set[Tenant] = field(default_factory=set)  # no more admissions this step
    only_claimants_admit: bool = False  # set by a preemption for lack of blocks

    def holding(self, tenant: Tenant) -> Holding:
        return self.holdings.setdefault(tenant, Holding())

    def claimed_by_others(self, tenant: Tenant) -> Holding:
        own = self.claims.get(tenant, Holding())
        return Holding(self.claimed.seats - own.seats, self.claimed.blocks - own.blocks)


class FairPolicy(SchedulingPolicy):
    name = "fair"
    waiting: FairQueue

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        grammar: GrammarScheduling,
    ) -> None:
        super().__init__()
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.grammar = grammar
        # Weights, deficits and whose turn it is, kept across steps.
        self.fair_share = FairShare(
            config.tenant_weights,
            config.fair_quantum,
            config.max_num_seqs,
            kv_cache_manager.block_pool.num_usable_blocks,
        )
        self._fair = _FairStep()

    def new_queue(self) -> RequestQueue:
        return FairQueue()

    def begin_step(self, step: StepState) -> None:
        kv = self.kv_cache_manager
        fair = self._fair = _FairStep()
        for index, request in enumerate(step.running):
            holding = fair.holding(request.tenant)
            holding.seats += seats_of(request)
            holding.blocks += kv.num_held_blocks(request.request_id)
            queue = fair.running.setdefault(request.tenant, deque())
            if request.request_id not in step.in_flight:
                queue.append(request)
            fair.admission_order[request.request_id] = index
        self.fair_share.sync_ring([*fair.running, *self.waiting.tenants()])
        if len(self.fair_share.ring) > 1 and len(self.waiting):
            self._claim_fair_shares(step)

    # ---- what the scheduler asks ----------------------------------------------------------------
    def reserved_for_others(self, step: StepState, request: Request) -> Holding:
        return self._fair.claimed_by_others(request.tenant)

    def affords(self, step: StepState, request: Request, num_tokens: int) -> bool:
        return num_tokens <= self.fair_share.deficit(request.tenant)

    def may_admit(self, step: StepState, request: Request) -> bool:
        return not self._fair.only_claimants_admit or request.tenant in self._fair.claims

    def preemption_victim(self, step: StepState, request: Request) -> Request:
        """The newest unscheduled running request of the tenant with the highest share."""
        fair = self._fair
        _, _, tenant = max(
            (self._share(tenant), fair.admission_order[queue[-1].request_id], tenant)
            for tenant, queue in fair.running.items()
            if queue
        )
        return fair.running[tenant][-1]

    def before_preempt(self, step: StepState, victim: Request) -> None:
        self._forget(victim)
        self._fair.only_claimants_admit = True

    def charge(
        self,
        step: StepState,
        request: Request,
        num_tokens: int,
        allocation: KVAllocation,
        num_admitted_blocks: int | None,
    ) -> None:
        tenant = request.tenant
        self.fair_share.charge(tenant, num_tokens)
        holding = self._fair.holding(tenant)
        if num_admitted_blocks is None:
            holding.blocks += len(allocation.new_blocks)
            return
        seats = seats_of(request)
        holding.seats += seats
        holding.blocks += self.kv_cache_manager.num_held_blocks(request.request_id)
        claim = self._fair.claims.get(tenant)
        if claim is not None:
            used = Holding(min(seats, claim.seats), min(num_admitted_blocks, claim.blocks))
            claim.seats -= used.seats
            claim.blocks -= used.blocks
            self._fair.claimed.seats -= used.seats
            self._fair.claimed.blocks -= used.blocks

    # ---- phase 1: seats and blocks by dominant share ------------------------------------------
    def _share(self, tenant: Tenant, seats: int = 0, blocks: int = 0) -> float:
        holding = self._fair.holding(tenant)
        claim = self._fair.claims.get(tenant, Holding())
        return self.fair_share.dominant_share(
            tenant, holding.seats + claim.seats + seats, holding.blocks + claim.blocks + blocks
        )

    def _first_chunk(self, request: Request, budget: int) -> tuple[list, int, int]:
        """(prefix-cache hits, their tokens, tokens to compute) if admitted now."""
        hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        return hits, num_hit_tokens, min(request.num_tokens - num_hit_tokens, budget)

    def _claim_fair_shares(self, step: StepState) -> None:
        kv, fair, claims = self.kv_cache_manager, self.fair_share, self._fair
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
                blocks = cdiv(num_hit_tokens + num_tokens, kv.block_size)
                share = self._share(tenant, seats_of(request), blocks)
                candidates.append((share, fair.position(tenant), tenant, request, hits, num_tokens))
            share, _, tenant, request, hits, num_tokens = min(candidates, key=lambda c: c[:2])
            if self.grammar.compiling(request):
                del next_index[tenant]  # its turn comes when the grammar is ready
                continue
            seats = seats_of(request)
            while True:
                needed = kv.num_blocks_to_allocate(request, num_tokens, hits)
                if seats <= free_seats and needed <= kv.num_free_blocks - claims.claimed.blocks:
                    break
                victim = self._claim_victim(tenant, share)
                if victim is None:
                    break
                next_index.pop(victim.tenant, None)  # it claims nothing this step
                free_seats += seats_of(victim)
                self._forget(victim)
                step.preempt(victim)
            if seats > free_seats or needed > kv.num_free_blocks - claims.claimed.blocks:
                del next_index[tenant]
                continue
            claim = claims.claims.setdefault(tenant, Holding())
            claim.seats += seats
            claim.blocks += needed
            claims.claimed.seats += seats
            claims.claimed.blocks += needed
            free_seats -= seats
            num_claimed_tokens += num_tokens
            next_index[tenant] += 1
            if next_index[tenant] == len(self.waiting.tenant_queue(tenant)):
                del next_index[tenant]

    def _claim_victim(self, claimant: Tenant, claimant_share: float) -> Request | None:
        """The newest running request of the tenant with the highest dominant share, if the
        claimant may take its place (see the module's docstring), else None."""
        fair = self._fair
        options = [
            (self._share(tenant), fair.admission_order[queue[-1].request_id], tenant)
            for tenant, queue in fair.running.items()
            if queue and tenant != claimant and tenant not in fair.claims
        ]
        if not options:
            return None
        share, _, tenant = max(options)
        victim = fair.running[tenant][-1]
        blocks = self.kv_cache_manager.num_held_blocks(victim.request_id)
        share_after = self._share(tenant, -seats_of(victim), -blocks)
        if claimant_share <= share_after and self._share(claimant) < share:
            return victim
        return None

    def _forget(self, victim: Request) -> None:
        """Take a running request about to be preempted (still holding its blocks) out of
        the step's accounts."""
        holding = self._fair.holding(victim.tenant)
        holding.seats -= seats_of(victim)
        holding.blocks -= self.kv_cache_manager.num_held_blocks(victim.request_id)
        self._fair.running[victim.tenant].remove(victim)

    # ---- phase 2: tokens by deficit round-robin -----------------------------------------------
    def _has_work(self, tenant: Tenant) -> bool:
        return bool(self._fair.running.get(tenant)) or (
            tenant not in self._fair.blocked and bool(self.waiting.tenant_queue(tenant))
        )

    def candidates(self, step: StepState) -> Candidates:
        fair = self.fair_share
        while step.budget > 0 and fair.ring:
            progress = False
            for _ in range(len(fair.ring)):
                tenant = fair.current
                if self._has_work(tenant):
                    fair.start_turn()
                    progress |= yield from self._turn(step, tenant)
                    if step.budget == 0:
                        return  # the turn goes on next step
                fair.end_turn(idle=not self._has_work(tenant))
            if not progress:
                active = [tenant for tenant in fair.ring if self._has_work(tenant)]
                if not active:
                    return
                rounds = min(
                    fair.rounds_to_afford(tenant, self._next_cost(step, tenant))
                    for tenant in active
                )
                fair.add_rounds(active, rounds - 1)  # the next pass credits the last one

    def _next_cost(self, step: StepState, tenant: Tenant) -> int:
        """Tokens the tenant's next request would take this step."""
        queue = self._fair.running.get(tenant)
        if queue:
            return step.tokens_due(queue[0])
        return self._first_chunk(self.waiting.tenant_queue(tenant)[0], step.budget)[2]

    def _turn(self, step: StepState, tenant: Tenant) -> Generator[Request, Outcome, bool]:
        """Offer the tenant's requests while its deficit covers them; whether anything
        changed."""
        progress = False
        running = self._fair.running.get(tenant)
        while step.budget > 0:
            if running:
                request = running[0]
                if step.tokens_due(request) > self.fair_share.deficit(tenant):
                    break
                progress = True
                yield request  # scheduled, preempted, or waiting for blocks claimed by others
                if running and running[0] is request:
                    running.popleft()
            elif self._has_work(tenant):
                outcome = yield self.waiting.tenant_queue(tenant)[0]
                if outcome is Outcome.NO_ROOM:
                    self._fair.blocked.add(tenant)
                    return True
                if outcome is Outcome.UNAFFORDABLE:
                    break
                progress = True
            else:
                break
        return progress
