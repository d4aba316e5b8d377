"""Tenants' shares under the "fair" scheduling policy, and the state kept between steps.

Two measures, both divided by the tenant's weight (a tenant not named in `tenant_weights`,
and the default tenant None, weigh 1):

- the *dominant share* of what a tenant holds: the larger of its fraction of the seats
  (`max_num_seqs`) and its fraction of the KV blocks (dominant resource fairness). Seats and
  blocks go to the waiting tenant whose share is lowest, taken by preemption from the tenant
  whose share is highest (`core/fair_policy.py`);
- the token budget, shared by weighted deficit round-robin: tenants take turns in a ring;
  a turn credits the tenant `quantum × weight` tokens (its deficit), and its requests run
  while the deficit covers their tokens this step. The ring, whose turn it is and every
  deficit persist across steps, so a turn cut short by the end of a step's budget goes on
  in the next; a tenant whose turn finds nothing to run forfeits its deficit (an idle tenant
  banks nothing), and a tenant without requests leaves the ring.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

Tenant = str | None


@dataclass
class Holding:
    """What a tenant holds: seats (a request and the samples it will fork) and KV blocks."""

    seats: int = 0
    blocks: int = 0


class FairShare:
    def __init__(
        self,
        weights: Iterable[tuple[str, float]],
        quantum: int,
        max_num_seqs: int,
        num_blocks: int,
    ) -> None:
        self.weights = dict(weights)
        self.quantum = quantum
        self.max_num_seqs = max_num_seqs
        self.num_blocks = max(1, num_blocks)
        self.deficits: dict[Tenant, float] = {}
        self.ring: list[Tenant] = []
        self.cursor = 0  # index in `ring` of the tenant whose turn it is
        self.credited = False  # whether that tenant has had this turn's quantum

    def weight(self, tenant: Tenant) -> float:
        return 1.0 if tenant is None else self.weights.get(tenant, 1.0)

    def dominant_share(self, tenant: Tenant, seats: int, blocks: int) -> float:
        fraction = max(seats / self.max_num_seqs, blocks / self.num_blocks)
        return fraction / self.weight(tenant)

    # ---- the ring --------------------------------------------------------------------------
    def sync_ring(self, tenants: Iterable[Tenant]) -> None:
        """`tenants`: those with requests now. New ones join at the ring's end (their first
        turn after everyone already in it); those gone leave it with their deficit."""
        present = dict.fromkeys(tenants)
        for index in range(len(self.ring) - 1, -1, -1):
            tenant = self.ring[index]
            if tenant in present:
                continue
            del self.ring[index]
            self.deficits.pop(tenant, None)
            if index < self.cursor:
                self.cursor -= 1
            elif index == self.cursor:
                self.credited = False
        known = set(self.ring)
        for tenant in present:
            if tenant not in known:
                self.ring.append(tenant)
                self.deficits[tenant] = 0.0
        if self.cursor >= len(self.ring):
            self.cursor = 0

    def position(self, tenant: Tenant) -> int:
        """Turns until `tenant`'s (0: it is its turn now); ties between tenants go to the
        one whose turn comes first."""
        return (self.ring.index(tenant) - self.cursor) % len(self.ring)

    @property
    def current(self) -> Tenant:
        return self.ring[self.cursor]

    # ---- deficits --------------------------------------------------------------------------
    def deficit(self, tenant: Tenant) -> float:
        return self.deficits[tenant]

    def start_turn(self) -> None:
        """Credit the current tenant its quantum, once per turn."""
        if not self.credited:
            tenant = self.current
            self.deficits[tenant] += self.quantum * self.weight(tenant)
            self.credited = True

    def end_turn(self, idle: bool) -> None:
        """Pass the turn on; a tenant that found nothing to run forfeits its deficit."""
        if idle:
            self.deficits[self.current] = 0.0
        self.credited = False
        self.cursor = (self.cursor + 1) % len(self.ring)

    def charge(self, tenant: Tenant, num_tokens: int) -> None:
        self.deficits[tenant] -= num_tokens

    def rounds_to_afford(self, tenant: Tenant, num_tokens: int) -> int:
        """Rounds of quanta until the tenant's deficit covers `num_tokens` (at least 1)."""
        missing = num_tokens - self.deficits[tenant]
        return max(1, math.ceil(missing / (self.quantum * self.weight(tenant))))

    def add_rounds(self, tenants: Iterable[Tenant], rounds: int) -> None:
        """Credit `rounds` quanta at once: the rounds in which no tenant could run anything."""
        for tenant in tenants:
            self.deficits[tenant] += rounds * self.quantum * self.weight(tenant)
