"""Admission by cost: the engine requests that wait for their first token, and what they cost.

One HTTP request becomes several engine requests (one per prompt), and each of those counts
its `n` parallel samples. `AdmissionQueue.admit` takes all of them or none, against the
server's `--max-num-queued-requests` (prompts x n) and `--max-num-queued-tokens` (prompt
tokens: the n samples of a prompt share one prefill, so its tokens count once). An engine
request leaves the queue at its first token, or when it finishes, is aborted or fails.

The caller holds a `Reservation` for what it admitted and releases it when its stream ends;
a stream that is dropped before it ever started (a client gone between the answer's headers
and its first chunk) releases it when the reservation is collected.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

# How much one new observation moves the queue-wait estimate behind `Retry-After`.
WAIT_SMOOTHING = 0.2
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class QueueLimits:
    max_num_queued_requests: int | None = None
    max_num_queued_tokens: int | None = None


@dataclass(frozen=True)
class Cost:
    num_requests: int  # the request's parallel samples (n)
    num_tokens: int  # its prompt tokens


@dataclass
class _Entry:
    cost: Cost
    owner: int  # the reservation that admitted it (0: added without one)
    admitted_at: float


class QueueFullError(Exception):
    """Admitting would pass a limit. `retry_after_s` is None when the request alone is over
    the limit, so waiting cannot help."""

    def __init__(self, message: str, param: str | None, retry_after_s: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s


class Reservation:
    """What one `admit` took; `release` gives back whatever of it is still queued."""

    def __init__(self, queue: AdmissionQueue, key: int, request_ids: tuple[str, ...]) -> None:
        self._queue = queue
        self.key = key
        self.request_ids = request_ids
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._queue._release_owned(self.key, self.request_ids)

    def __del__(self) -> None:
        # Collection can interrupt any code, the queue's own included: only note it here
        # and let the queue release it at its next use.
        if not self.released:
            self._queue._orphans.append((self.key, self.request_ids))


class AdmissionQueue:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._num_requests = 0
        self._num_tokens = 0
        self._orphans: list[tuple[int, tuple[str, ...]]] = []
        self._next_key = 1
        self._wait_s: float | None = None  # smoothed time from admission to first token

    @property
    def num_requests(self) -> int:
        self._release_orphans()
        return self._num_requests

    @property
    def num_tokens(self) -> int:
        self._release_orphans()
        return self._num_tokens

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    @property
    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: how long admitted requests have lately
        waited for their first token (1 s before any has)."""
        if self._wait_s is None:
            return 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self._wait_s)))

    def check(self, cost: Cost, limits: QueueLimits) -> None:
        """Raise `QueueFullError` unless `cost` fits next to what is queued now."""
        self._release_orphans()
        checks = (
            (
                self._num_requests,
                cost.num_requests,
                limits.max_num_queued_requests,
                "--max-num-queued-requests",
                "requests (prompts x n)",
                "n",
            ),
            (
                self._num_tokens,
                cost.num_tokens,
                limits.max_num_queued_tokens,
                "--max-num-queued-tokens",
                "prompt tokens",
                "prompt",
            ),
        )
        for queued, needed, limit, flag, unit, param in checks:
            if limit is None:
                continue
            if needed > limit:
                raise QueueFullError(
                    f"this request needs {needed} queued {unit} but the server admits at "
                    f"most {limit} ({flag}): it can never be admitted as it is; send it in "
                    "smaller parts",
                    param,
                    None,
                )
            if queued + needed > limit:
                raise QueueFullError(
                    f"server is busy: {queued} queued {unit} of the {limit} allowed ({flag}) "
                    f"leave no room for this request's {needed}; retry later",
                    None,
                    self.retry_after_s,
                )

    def admit(self, costs: dict[str, Cost], limits: QueueLimits) -> Reservation:
        """Queue every engine request of one HTTP request, or none (`QueueFullError`)."""
        total = Cost(
            sum(c.num_requests for c in costs.values()), sum(c.num_tokens for c in costs.values())
        )
        self.check(total, limits)
        key = self._next_key
        self._next_key += 1
        now = time.monotonic()
        for request_id, cost in costs.items():
            self._add(request_id, cost, key, now)
        return Reservation(self, key, tuple(costs))

    def add(self, request_id: str, cost: Cost) -> None:
        """Queue a request that was not admitted through `admit` (no-op if it was)."""
        if request_id not in self._entries:
            self._add(request_id, cost, 0, time.monotonic())

    def first_token(self, request_id: str) -> None:
        entry = self._pop(request_id)
        if entry is not None:
            waited = time.monotonic() - entry.admitted_at
            previous = waited if self._wait_s is None else self._wait_s
            self._wait_s = previous + WAIT_SMOOTHING * (waited - previous)

    def release(self, request_id: str) -> None:
        self._pop(request_id)

    def clear(self) -> None:
        self._entries.clear()
        self._orphans.clear()
        self._num_requests = self._num_tokens = 0

    # ---- internals --------------------------------------------------------------------------
    def _add(self, request_id: str, cost: Cost, owner: int, now: float) -> None:
        self._pop(request_id)  # callers refuse ids already queued; never count one twice
        self._entries[request_id] = _Entry(cost, owner, now)
        self._num_requests += cost.num_requests
        self._num_tokens += cost.num_tokens

    def _pop(self, request_id: str) -> _Entry | None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._num_requests -= entry.cost.num_requests
            self._num_tokens -= entry.cost.num_tokens
        return entry

    def _release_owned(self, key: int, request_ids: tuple[str, ...]) -> None:
        # Only this reservation's own: the id may since have been admitted again by another.
        for request_id in request_ids:
            entry = self._entries.get(request_id)
            if entry is not None and entry.owner == key:
                self._pop(request_id)

    def _release_orphans(self) -> None:
        while self._orphans:
            self._release_owned(*self._orphans.pop())
