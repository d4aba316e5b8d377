"""What the model runner holds of each request, from the scheduler's side: which requests
it has seen (a new one gets everything, `NewRequestData`; a known one only what changed,
`CachedRequestData`), whose block table it must take whole (resumed after preemption,
copied on write, cut back past rejected drafts), and which finished since the last step."""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.core.kv_cache_manager import KVAllocation
from pagedllm.core.request import Request
from pagedllm.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


class RunnerView:
    def __init__(
        self,
        block_ids: Callable[[str], list[int]],
        take_trimmed: Callable[[str], bool],
        send_token_ids: bool,
    ) -> None:
        self._block_ids = block_ids
        # Whether a request's table was cut back past rejected drafts since it last ran.
        self._take_trimmed = take_trimmed
        # Several ranks run the model: those that do not sample learn tokens from the step.
        self._send_token_ids = send_token_ids
        self._seen: set[str] = set()
        self._resumed: set[str] = set()
        self._finished: set[str] = set()

    def take_finished(self) -> set[str]:
        """Requests the runner held that finished since the last call."""
        finished, self._finished = self._finished, set()
        return finished

    def add_new(self, output: SchedulerOutput, request: Request) -> None:
        """A request the runner has not seen gets its whole block table (prefix-cache hits,
        fresh blocks, or the parent's shared ones for a forked sample)."""
        self._seen.add(request.request_id)
        block_ids = self._block_ids(request.request_id)
        output.scheduled_new_reqs.append(NewRequestData.of(request, block_ids))

    def add(
        self,
        output: SchedulerOutput,
        request: Request,
        num_new_tokens: int,
        allocation: KVAllocation,
    ) -> None:
        """The request's entry in the step, before its computed tokens advance."""
        request_id = request.request_id
        if request_id not in self._seen:
            self.add_new(output, request)
            return
        preempted = request_id in self._resumed
        self._resumed.discard(request_id)
        trimmed = self._take_trimmed(request_id)
        # A table changed in place is sent whole.
        rewritten = preempted or bool(allocation.block_copies) or trimmed
        output.blocks_to_copy.extend(allocation.block_copies)
        output.scheduled_cached_reqs.append(
            CachedRequestData(
                request_id=request_id,
                new_block_ids=(
                    self._block_ids(request_id) if rewritten else allocation.new_block_ids
                ),
                num_computed_tokens=request.num_computed_tokens,
                resumed_from_preemption=rewritten,
                preempted=preempted,
                token_ids=self._token_ids(request, num_new_tokens, rewritten),
            )
        )

    def _token_ids(self, request: Request, num_new_tokens: int, to_end: bool) -> list[int] | None:
        """The tokens from the first uncomputed one: the `num_new_tokens` run now or
        (`to_end`: a table sent whole) all of them to the last."""
        if not self._send_token_ids:
            return None
        start = request.num_computed_tokens
        end = request.num_tokens if to_end else start + num_new_tokens
        return request.token_ids_between(start, end)

    def preempted(self, request_id: str) -> None:
        if request_id in self._seen:
            self._resumed.add(request_id)

    def freed(self, request_id: str) -> None:
        if request_id in self._seen:
            self._seen.discard(request_id)
            self._resumed.discard(request_id)
            self._finished.add(request_id)
