"""Waiting queues, one per scheduling policy (`core/policy.py` picks its own).

`fcfs`: arrival order; a preempted request goes back to the head.
`priority`: lowest `priority` value first, ties by arrival time (vLLM's convention).
`fair`: one arrival-order queue per tenant (a preempted request back at its tenant's head);
the fair policy (`core/fair_policy.py`) chooses between tenants. Taken through
`peek`/`pop` alone, tenants take turns.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from pagedllm.core.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def add_preempted(self, request: Request) -> None: ...

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    def take(self, request: Request) -> Request:
        """Take `request`, a head of the queue (the one `peek` gives)."""
        assert self.peek() is request
        return self.pop()

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


def priority_key(request: Request) -> tuple[int, float, str]:
    return (request.priority, request.arrival_time, request.request_id)


class PriorityQueue(RequestQueue):
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (priority_key(request), request))

    def add_preempted(self, request: Request) -> None:
        self.add(request)  # its priority and arrival time already place it

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[1] for entry in sorted(self._heap, key=lambda entry: entry[0]))


class FairQueue(RequestQueue):
    """Waiting requests per tenant (None is the default tenant), each tenant's in arrival
    order; tenants are kept in the order they last became waiting."""

    def __init__(self) -> None:
        self._queues: dict[str | None, deque[Request]] = {}
        self._len = 0

    def add(self, request: Request) -> None:
        self._queues.setdefault(request.tenant, deque()).append(request)
        self._len += 1

    def add_preempted(self, request: Request) -> None:
        self._queues.setdefault(request.tenant, deque()).appendleft(request)
        self._len += 1

    def tenants(self) -> list[str | None]:
        """Tenants with waiting requests."""
        return list(self._queues)

    def tenant_queue(self, tenant: str | None) -> deque[Request]:
        """A tenant's waiting requests, oldest first (empty if it has none); read-only."""
        return self._queues.get(tenant) or deque()

    def peek(self) -> Request:
        return next(iter(self._queues.values()))[0]

    def pop(self) -> Request:
        """The first tenant's oldest request; that tenant then goes last (round-robin)."""
        tenant, queue = next(iter(self._queues.items()))
        request = queue.popleft()
        del self._queues[tenant]
        if queue:
            self._queues[tenant] = queue
        self._len -= 1
        return request

    def take(self, request: Request) -> Request:
        """Take `request`, the head of its tenant's queue."""
        assert self._queues[request.tenant][0] is request
        return self.pop_tenant(request.tenant)

    def pop_tenant(self, tenant: str | None) -> Request:
        """A tenant's oldest request."""
        queue = self._queues[tenant]
        request = queue.popleft()
        if not queue:
            del self._queues[tenant]
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        queue = self._queues[request.tenant]
        queue.remove(request)
        if not queue:
            del self._queues[request.tenant]
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """In the order `pop` would give them: tenants in turn."""
        queues = [list(queue) for queue in self._queues.values()]
        for index in range(max(map(len, queues), default=0)):
            for queue in queues:
                if index < len(queue):
                    yield queue[index]
