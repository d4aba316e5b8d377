"""Waiting queues, one per scheduling policy, chosen by name.

`fcfs`: arrival order; a preempted request goes back to the head.
`priority`: lowest `priority` value first, ties by arrival time (vLLM's convention).
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


SCHEDULING_POLICIES = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def create_request_queue(policy: str) -> RequestQueue:
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(
            f"scheduling_policy {policy!r} is unknown; choose one of {sorted(SCHEDULING_POLICIES)}"
        )
    return SCHEDULING_POLICIES[policy]()
