"""Per-tenant limits: requests per minute, tokens per minute, requests in flight.

Pure bookkeeping with an injected clock (tests drive it with a fake one). Everything here runs
on the server's event loop, so nothing is locked.

Requests per minute and tokens per minute are token buckets that hold a minute's allowance
and refill continuously (a tenant idle for a minute may spend the whole minute's allowance
at once, then one request every 60/limit seconds). Tokens are the tokens actually processed:
a request's prompt tokens when it is admitted, its generated tokens as they arrive (a
request cut short by its client is charged its whole `max_tokens`). A request is admitted
while its tenant's token budget is not overdrawn, so one long request may overdraw it and the
tenant then waits until the debt is paid back; `--tenant-max-concurrent-requests` bounds how
far concurrent requests can overdraw it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from pagedllm.value_checks import INT64_MAX

Clock = Callable[[], float]
SECONDS_PER_MINUTE = 60.0
# No limit frees a slot at a known time: a refused concurrent request retries after this.
CONCURRENCY_RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits; None means no limit."""

    max_requests_per_minute: int | None = None
    max_tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            # Within 64 bits, as every integer the server takes (a wider one was accepted).
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= INT64_MAX
            ):
                raise ValueError(
                    f"{field.name} must be an integer >= 1 and <= {INT64_MAX} (or none), "
                    f"got {value!r}"
                )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in fields(cls))

    def with_overrides(self, overrides: dict[str, int | None]) -> TenantLimits:
        return replace(self, **overrides)


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused, and when retrying could succeed."""

    limit: str  # the TenantLimits field that refused it
    retry_after_s: float
    message: str

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, rounded up (HTTP's Retry-After has no fractions), at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


class TokenBucket:
    """Holds up to `per_minute` units and refills at `per_minute` a minute; starts full.

    `take` may overdraw it (the level goes below zero); refills pay the debt back first.
    """

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / SECONDS_PER_MINUTE  # units per second
        self.level = self.capacity
        self.updated = now

    def available(self, now: float) -> float:
        # max(): a clock that steps back must not drain the bucket.
        self.level = min(self.capacity, self.level + max(0.0, now - self.updated) * self.rate)
        self.updated = max(self.updated, now)
        return self.level

    def seconds_until(self, amount: float, now: float) -> float:
        """0 when `amount` can be taken now, else how long until it can."""
        missing = amount - self.available(now)
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, amount: float, now: float) -> None:
        self.available(now)
        self.level -= amount


class TenantLimiter:
    """One tenant's counters against its `TenantLimits`."""

    def __init__(self, limits: TenantLimits, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self.limits = TenantLimits()
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.in_flight = 0
        self.update(limits)

    def update(self, limits: TenantLimits) -> None:
        """New limits (a keys-file reload); a bucket whose limit did not change keeps its
        level, and requests in flight stay counted."""
        now = self.clock()
        if self.requests is None or limits.max_requests_per_minute != (
            self.limits.max_requests_per_minute
        ):
            per_minute = limits.max_requests_per_minute
            self.requests = None if per_minute is None else TokenBucket(per_minute, now)
        if self.tokens is None or limits.max_tokens_per_minute != self.limits.max_tokens_per_minute:
            per_minute = limits.max_tokens_per_minute
            self.tokens = None if per_minute is None else TokenBucket(per_minute, now)
        self.limits = limits

    def admit(self) -> Refusal | None:
        """Start a request if every limit allows it (then `release` it when it ends); else
        the refusal. A refused request uses up nothing."""
        now = self.clock()
        limits = self.limits
        concurrent = limits.max_concurrent_requests
        if concurrent is not None and self.in_flight >= concurrent:
            return Refusal(
                "max_concurrent_requests",
                CONCURRENCY_RETRY_AFTER_S,
                f"Rate limit reached: {self.in_flight} requests in flight, the limit is "
                f"{concurrent} (max_concurrent_requests); retry when one has finished",
            )
        buckets = (
            ("tokens", self.tokens, limits.max_tokens_per_minute),
            ("requests", self.requests, limits.max_requests_per_minute),
        )
        for unit, bucket, limit in buckets:
            wait = 0.0 if bucket is None else bucket.seconds_until(1, now)
            if wait > 0:
                name = f"max_{unit}_per_minute"
                return Refusal(
                    name,
                    wait,
                    f"Rate limit reached for {unit} per minute: the limit is {limit} ({name}); "
                    f"retry in {wait:.1f} s",
                )
        if self.requests is not None:
            self.requests.take(1, now)
        self.in_flight += 1
        return None

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def charge_tokens(self, amount: int) -> None:
        if self.tokens is not None and amount > 0:
            self.tokens.take(amount, self.clock())
