"""The responses a follow-up may continue (`previous_response_id`): per tenant, the last N
responses (least recently used first out), each with its whole conversation as chat messages
(the input it was given, its predecessors' included, then its output).

Tenants never see each other's responses: an id stored by one tenant is unknown to another.
Held in the API process's memory only; a restart forgets every response.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response_id: str
    # The conversation so far as chat messages; `instructions` are not part of it (OpenAI
    # does not carry them into a follow-up).
    messages: tuple[dict[str, Any], ...]


class ResponsesStore:
    def __init__(self, size_per_tenant: int) -> None:
        if size_per_tenant < 1:
            raise ValueError(f"responses_store_size must be >= 1, got {size_per_tenant}")
        self.size_per_tenant = size_per_tenant
        self._by_tenant: dict[str, OrderedDict[str, StoredResponse]] = {}

    def put(self, tenant: str, stored: StoredResponse) -> None:
        responses = self._by_tenant.setdefault(tenant, OrderedDict())
        responses[stored.response_id] = stored
        responses.move_to_end(stored.response_id)
        while len(responses) > self.size_per_tenant:
            responses.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response of that id (now the most recently used), else None."""
        responses = self._by_tenant.get(tenant)
        if responses is None or response_id not in responses:
            return None
        responses.move_to_end(response_id)
        return responses[response_id]

    def __len__(self) -> int:
        return sum(len(responses) for responses in self._by_tenant.values())
