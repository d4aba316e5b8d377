"""Speculative decoding's scheduler side as a participant of the scheduling loop: whether a
step verifies drafts, the slots held past a request's tokens for a draft model's proposals,
rejected drafts rolled back (their KV freed), and which proposals the next step may verify.
With no speculative config every answer is "none"."""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.metrics import SpecDecodingStats


class DraftScheduling:
    def __init__(
        self,
        config: SpeculativeConfig | None,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        # Slots held past each scheduled request's tokens (a draft model's own proposals).
        self.num_lookahead_tokens = config.num_lookahead_tokens if config else 0
        self.stats = SpecDecodingStats.for_config(config)
        # Requests whose rejected drafts' blocks were freed: their next table is sent whole.
        self._trimmed: set[str] = set()

    def speculating(self, num_running: int) -> bool:
        """Whether this step verifies drafts (`disable_by_batch_size` counts the running)."""
        return self.config is not None and self.config.speculates(num_running)

    def lookahead(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> int:
        """Slots held past the step's tokens for a draft model's proposals, within the
        context (a block table holds max_model_len tokens)."""
        if not self.num_lookahead_tokens:
            return 0
        num_computed = max(request.num_computed_tokens, num_hit_tokens)
        room = self.max_model_len - num_computed - num_new_tokens
        return max(0, min(self.num_lookahead_tokens, room))

    def roll_back_rejected(self, request: Request, num_drafts: int, num_emitted: int) -> None:
        """The step computed the request's last token and `num_drafts` drafts; `num_emitted
        - 1` drafts were accepted. The rejected ones' KV is not the request's: they no longer
        count as computed, and blocks holding only them go back to the pool (the runner then
        gets the request's table whole)."""
        if not num_drafts:
            return
        num_accepted = num_emitted - 1
        self.stats.observe(num_drafts, num_accepted)
        request.num_computed_tokens -= num_drafts - num_accepted
        if self.kv_cache_manager.trim(request, self.lookahead(request, 0)):
            self._trimmed.add(request.request_id)

    def take_trimmed(self, request_id: str) -> bool:
        """Whether the request's table was cut back since it was last scheduled."""
        trimmed = request_id in self._trimmed
        self._trimmed.discard(request_id)
        return trimmed

    def usable_drafts(
        self,
        request: Request,
        drafts: list[int] | None,
        grammar_prefix: Callable[[Request, list[int]], list[int]],
    ) -> list[int]:
        """The proposals the next step may verify: none past max_tokens or the context (the
        token after the last draft is emitted too), and only the prefix the request's
        grammar allows (`grammar_prefix`)."""
        if not drafts:
            return []
        params = request.sampling_params
        room = self.max_model_len - request.num_tokens
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        drafts = drafts[: max(0, room)]
        return grammar_prefix(request, drafts) if drafts else drafts
