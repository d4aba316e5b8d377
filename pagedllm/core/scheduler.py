"""The scheduler: decides each step which requests run how many tokens, within one budget."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedllm.config import SchedulerConfig
from pagedllm.core.fair_scheduler import FairScheduling
from pagedllm.core.fair_share import FairShare
from pagedllm.core.kv_cache_manager import KVAllocation, KVCacheManager
from pagedllm.core.request import Request, RequestStatus, child_request_id
from pagedllm.core.request_queue import create_request_queue, priority_key
from pagedllm.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.engine.messages import EngineCoreOutput
from pagedllm.errors import describe_error
from pagedllm.kv_transfer.tier_manager import PARKED, KVTierManager, TierHit
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("pagedllm")


class Scheduler(FairScheduling):
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        structured_output: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        kv_tiers: KVTierManager | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        # KV tiers (host memory, disk, swap, a peer instance): None when off.
        self.kv_tiers = kv_tiers
        if kv_tiers is not None:
            kv_cache_manager.block_pool.on_evict = kv_tiers.on_evict
            kv_cache_manager.on_publish = kv_tiers.on_publish
        self.structured_output = structured_output
        self.speculative_config = speculative_config
        # Slots held past each scheduled request's tokens (a draft model's own proposals).
        self.num_lookahead_tokens = (
            speculative_config.num_lookahead_tokens if speculative_config else 0
        )
        self.spec_decoding_stats = SpecDecodingStats.for_config(speculative_config)
        # Requests whose rejected drafts' blocks were freed: their next table is sent whole.
        self._trimmed: set[str] = set()
        # Outputs decided outside a model step (a grammar that failed to compile).
        self._pending_outputs: list[EngineCoreOutput] = []
        # Fault isolation: requests whose own grammar raised while scheduling (id -> what
        # raised); they run this step like the others and end in update_from_output.
        self._failed: dict[str, str] = {}
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        # The "fair" policy's state kept across steps (weights, deficits, whose turn it is).
        self.fair_share = FairShare(
            config.tenant_weights,
            config.fair_quantum,
            config.max_num_seqs,
            kv_cache_manager.block_pool.num_usable_blocks,
        )
        self._seen_by_runner: set[str] = set()
        self._resumed: set[str] = set()
        self._finished_req_ids: set[str] = set()
        self._forked_samples: list[Request] = []
        # Pipeline parallel (max_batches_in_flight > 1): requests in a batch that is still
        # running (scheduled, not yet updated); they are neither scheduled nor preempted.
        self._pipelined = config.max_batches_in_flight > 1
        self._in_flight: set[str] = set()
        self.num_preemptions = 0
        # Prompt tokens actually run through the model (prefix-cache hits excluded).
        self.num_computed_prompt_tokens = 0

    # ---- requests in and out -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; `InputProcessor` has checked it against the engine's limits."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("structured_outputs: this engine has no structured output")
            self.structured_output.add_request(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside (abort); its blocks return to the pool at once."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self._free(request)

    def lora_counts(self, requests: Iterable[Request]) -> dict[str, int] | None:
        """Adapter name -> how many of `requests` run it (None when LoRA is off)."""
        if self.config.max_loras is None:
            return None
        counts: dict[str, int] = {}
        for request in requests:
            if request.lora_request is not None:
                name = request.lora_request.lora_name
                counts[name] = counts.get(name, 0) + 1
        return counts

    def has_unfinished_requests(self) -> bool:
        return bool(len(self.waiting) or self.running or self._pending_outputs)

    # ---- one step ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # The rule: one token budget (max_num_batched_tokens) per step, shared by all.
        # 1. Running requests first, in admission order (in priority order under the
        #    "priority" policy, so the lowest priority sits last). Each is given the tokens it is
        #    behind by (1 for a decode, plus the drafts it verifies under speculative
        #    decoding; the rest of its prompt for a prefill), capped by
        #    what is left of the budget, so long prompts are prefilled in chunks that share
        #    steps with other requests' decodes. When the pool has no blocks for them, the
        #    last running request (the newest; the lowest priority) is preempted (blocks
        #    freed, recomputed later) until the request fits or was itself preempted.
        # 2. Then waiting requests in queue order (fcfs: preempted ones at the head, then
        #    arrivals; priority: by priority, then arrival) while budget, max_num_seqs and
        #    free blocks allow; none in a step that preempted. Each first takes its longest
        #    prefix-cache hit and only the rest is computed.
        # 3. LoRA: at most max_loras adapters run in a step; a running request whose adapter
        #    would be one too many is passed over, a waiting one set aside for those behind it.
        # Under "fair" (core/fair_scheduler.py has the details), requests belong to tenants
        # (None: the default one) and no tenant can starve another:
        # 1. Seats and KV blocks by dominant share (the larger of a tenant's fractions of
        #    max_num_seqs and of the pool, over its weight): the waiting tenant whose share
        #    would be lowest claims a seat and blocks for its next request; if they are not
        #    free, the newest running request of the tenant with the highest share is
        #    preempted for it, as long as the claimant ends no higher than that tenant. Claims
        #    are the claimant's alone for the step.
        # 2. The token budget by weighted deficit round-robin: tenants take turns in a ring
        #    that persists across steps; a turn credits quantum x weight tokens, and runs the
        #    tenant's running requests (admission order) then admits its waiting ones (arrival
        #    order) while its deficit covers each one's tokens this step. A running request
        #    short of blocks preempts the newest unscheduled running request of the tenant
        #    with the highest share (then only claimants admit in this step).
        output = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        if self.config.policy == "fair":
            self._schedule_fair(output)
        else:
            self._schedule_in_order(output)
        self._run_forked_samples()
        self._add_grammar_bitmask(output)
        if self.kv_tiers is not None:
            output.kv_transfer = self.kv_tiers.take_ops()
        return output

    def _schedule_in_order(self, output: SchedulerOutput) -> None:
        """The fcfs and priority policies' step (rule 1 and 2 above)."""
        token_budget = self.config.max_num_batched_tokens
        num_preemptions_before = self.num_preemptions
        if self.config.policy == "priority":
            self.running.sort(key=priority_key)
        speculating = self._speculating()
        step_loras: set[int] = set()  # the LoRA adapters this step runs
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            in_flight = self._pipelined and request.request_id in self._in_flight
            if in_flight or not self._lora_fits(request, step_loras):
                index += 1
                continue
            if not speculating:
                request.spec_token_ids = []
            num_new_tokens = min(
                request.num_tokens - request.num_computed_tokens + len(request.spec_token_ids),
                token_budget,
            )
            allocation = self._allocate_or_preempt(request, num_new_tokens)
            if allocation is None:
                break
            self._schedule(output, request, num_new_tokens, allocation)
            token_budget -= num_new_tokens
            step_loras.add(request.lora_int_id)
            index += 1
        self._run_forked_samples()
        if self.num_preemptions == num_preemptions_before:
            self._admit_waiting(output, token_budget, step_loras)

    def _lora_fits(self, request: Request, step_loras: set[int]) -> bool:
        """Whether the request's adapter can run this step: at most `max_loras` adapters
        run in one (the base model, id 0, takes no slot)."""
        lora_id = request.lora_int_id
        if not lora_id or lora_id in step_loras or self.config.max_loras is None:
            return True
        return len(step_loras - {0}) < self.config.max_loras

    def _speculating(self) -> bool:
        """Whether this step verifies drafts (`disable_by_batch_size` counts the running)."""
        config = self.speculative_config
        return config is not None and config.speculates(len(self.running))

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        if self.structured_output is None:
            return
        # Drafts run past num_tokens until the step's outcome rolls them back.
        sampling = [
            request
            for request_id in output.num_scheduled_tokens
            if (request := self.requests[request_id]).num_computed_tokens >= request.num_tokens
        ]
        result = self._grammar_bitmask(output, sampling)
        if result is not None:
            output.grammar_bitmask, output.grammar_rows = result

    def _grammar_bitmask(self, output: SchedulerOutput, sampling: list[Request]):
        """The step's bitmask; when filling it raises, each request is tried alone and those
        whose matcher raises fail (with the samples they forked this step, which sample from
        their row) and are left out; an error no single request reproduces raises."""
        manager = self.structured_output
        assert manager is not None
        drafts = output.scheduled_spec_decode_tokens
        try:
            return manager.bitmask(sampling, drafts)
        except Exception:
            healthy = []
            for request in sampling:
                try:
                    manager.bitmask([request], drafts)
                    healthy.append(request)
                except Exception as error:
                    logger.exception("Request %s: its grammar bitmask failed", request.request_id)
                    message = f"structured_outputs: the grammar failed: {describe_error(error)}"
                    for request_id in (
                        request.request_id,
                        *output.forked_samples.get(request.request_id, ()),
                    ):
                        self._failed[request_id] = message
            if len(healthy) == len(sampling):
                raise
        return manager.bitmask(healthy, drafts)

    def _grammar_pending(self, request: Request) -> bool:
        """True while the request's grammar compiles; a failed one ends the request here."""
        manager = self.structured_output
        if manager is None or request.structured_output is None:
            return False
        try:
            ready = manager.is_ready(request)
        except Exception as error:  # building its matcher raised: this request's alone
            logger.exception("Request %s: its grammar failed", request.request_id)
            request.structured_output.error = describe_error(error)
            ready = True
        if not ready:
            return True
        if request.structured_output.error is not None:
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ERROR
            del self.requests[request.request_id]
            self._pending_outputs.append(
                EngineCoreOutput(
                    request.request_id,
                    [],
                    True,
                    finish_reason="error",
                    error=f"structured_outputs: the grammar failed: "
                    f"{request.structured_output.error}",
                )
            )
            return True
        return False

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int) -> KVAllocation | None:
        """Blocks for the request's next tokens, preempting the newest requests as needed."""
        while True:
            allocation = self.kv_cache_manager.allocate_slots(
                request,
                num_new_tokens,
                num_lookahead_tokens=self._lookahead(request, num_new_tokens),
            )
            if allocation is not None:
                return allocation
            victim = self._preemption_victim() if self._pipelined else self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None

    def _lookahead(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> int:
        """Slots held past the step's tokens for a draft model's proposals, within the
        context (a block table holds max_model_len tokens)."""
        if not self.num_lookahead_tokens:
            return 0
        num_computed = max(request.num_computed_tokens, num_hit_tokens)
        room = self.config.max_model_len - num_computed - num_new_tokens
        return max(0, min(self.num_lookahead_tokens, room))

    def _preemption_victim(self) -> Request:
        """The newest running request not in flight (the one asking, at worst: those before
        it in `running` are in flight, scheduled this step or earlier)."""
        for index in range(len(self.running) - 1, -1, -1):
            if self.running[index].request_id not in self._in_flight:
                return self.running.pop(index)
        raise AssertionError("every running request is in flight")

    def _preempt(self, request: Request) -> None:
        kv = self.kv_cache_manager
        if self.kv_tiers is not None:  # swap: its blocks go to host memory first
            blocks = kv.req_to_blocks.get(request.request_id, [])
            self.kv_tiers.swap_out(request, blocks, kv.block_pool.null_block)
        kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self._trimmed.discard(request.request_id)
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.request_id in self._seen_by_runner:
            self._resumed.add(request.request_id)
        self.waiting.add_preempted(request)

    def _admit_waiting(
        self, output: SchedulerOutput, token_budget: int, step_loras: set[int]
    ) -> None:
        kv = self.kv_cache_manager
        # Running requests with n > 1 hold seats for the samples they will fork.
        num_seats = len(self.running) + sum(r.num_unforked_samples for r in self.running)
        skipped: list[Request] = []
        while len(self.waiting) and token_budget > 0:
            request = self.waiting.peek()
            if self._grammar_pending(request):
                if not request.is_finished:  # still compiling: let the requests behind go
                    skipped.append(self.waiting.pop())
                continue
            if num_seats + 1 + request.num_unforked_samples > self.config.max_num_seqs:
                break
            if not self._lora_fits(request, step_loras):  # no slot: the requests behind go
                skipped.append(self.waiting.pop())
                continue
            hits, num_hit_tokens, tier_hit = self._computed_blocks(request)
            if tier_hit == PARKED:  # its blocks are read from disk: the requests behind go
                skipped.append(self.waiting.pop())
                continue
            num_loaded = tier_hit.num_tokens if tier_hit is not None else 0
            num_known = num_hit_tokens + num_loaded
            num_new_tokens = min(request.num_tokens - num_known, token_budget)
            allocation = kv.allocate_slots(
                request,
                num_loaded + num_new_tokens,
                hits,
                num_lookahead_tokens=self._lookahead(request, num_new_tokens, num_known),
            )
            if allocation is None:
                break
            self.waiting.pop()
            if tier_hit is not None:  # the blocks get the tiers' bytes before the step runs
                assert self.kv_tiers is not None
                table = kv.get_block_ids(request.request_id)
                self.kv_tiers.load(request.request_id, tier_hit, table)
            self._start_running(request, num_hit_tokens, num_loaded)
            num_seats += 1 + request.num_unforked_samples  # before _schedule forks them
            self._schedule(output, request, num_new_tokens, allocation)
            token_budget -= num_new_tokens
            step_loras.add(request.lora_int_id)
        for request in reversed(skipped):  # back at the head, in their order
            self.waiting.add_preempted(request)

    def _computed_blocks(self, request: Request) -> tuple[list, int, TierHit | str | None]:
        """(prefix-cache hits, their tokens, what the KV tiers hold past them: a `TierHit`,
        `PARKED` while read from disk, or None). A swapped-out request takes back only its
        own blocks."""
        kv, tiers = self.kv_cache_manager, self.kv_tiers
        if tiers is None:
            return (*kv.get_computed_blocks(request), None)
        swapped = tiers.swapped.get(request.request_id)
        if swapped is not None:
            return [], 0, swapped
        hits, num_hit_tokens = kv.get_computed_blocks(request)
        kv.update_block_hashes(request)
        return hits, num_hit_tokens, tiers.find(request, num_hit_tokens)

    def _start_running(self, request: Request, num_hit_tokens: int, num_loaded: int = 0) -> None:
        """A waiting request just given its blocks joins `running`, its prefix-cache hits
        (and the tokens loaded from the KV tiers) computed."""
        self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.num_computed_tokens = num_hit_tokens + num_loaded
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit_tokens
        self.running.append(request)

    def _schedule(
        self,
        output: SchedulerOutput,
        request: Request,
        num_new_tokens: int,
        allocation: KVAllocation,
    ) -> None:
        request_id = request.request_id
        if request_id not in self._seen_by_runner:
            self._seen_by_runner.add(request_id)
            output.scheduled_new_reqs.append(self._new_request_data(request))
        else:
            # A table changed in place (resumed, copied on write, or cut back past rejected
            # drafts) is sent whole.
            preempted = request_id in self._resumed
            rewritten = preempted or bool(allocation.block_copies) or request_id in self._trimmed
            self._resumed.discard(request_id)
            self._trimmed.discard(request_id)
            output.blocks_to_copy.extend(allocation.block_copies)
            output.scheduled_cached_reqs.append(
                CachedRequestData(
                    request_id=request_id,
                    new_block_ids=(
                        self.kv_cache_manager.get_block_ids(request_id)
                        if rewritten
                        else allocation.new_block_ids
                    ),
                    num_computed_tokens=request.num_computed_tokens,
                    resumed_from_preemption=rewritten,
                    preempted=preempted,
                    token_ids=(
                        _token_ids(request, num_new_tokens, to_end=rewritten)
                        if self.config.send_token_ids
                        else None
                    ),
                )
            )
        output.num_scheduled_tokens[request_id] = num_new_tokens
        num_drafts = num_new_tokens - (request.num_tokens - request.num_computed_tokens)
        if num_drafts > 0:
            output.scheduled_spec_decode_tokens[request_id] = request.spec_token_ids[:num_drafts]
        request.spec_token_ids = []
        if self._pipelined:
            self._in_flight.add(request_id)
        computed = request.num_computed_tokens
        self.num_computed_prompt_tokens += max(
            0, min(request.num_prompt_tokens, computed + num_new_tokens) - computed
        )
        request.num_computed_tokens += num_new_tokens
        if (
            self.kv_tiers is not None
            and self.kv_tiers.sends
            and computed < (request.num_prompt_tokens) <= request.num_computed_tokens
        ):
            kv = self.kv_cache_manager
            self.kv_tiers.on_prompt_computed(
                request,
                kv.update_block_hashes(request),
                kv.get_block_ids(request_id),
                kv.block_pool.null_block.block_id,
            )
        if request.num_unforked_samples and request.num_computed_tokens == request.num_tokens:
            self._fork_samples(output, request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        """A request the runner has not seen gets its whole block table (prefix-cache hits,
        fresh blocks, or the parent's shared ones for a forked sample)."""
        return NewRequestData(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            eos_token_ids=request.eos_token_ids,
            bad_words_token_ids=request.bad_words_token_ids,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
        )

    def _fork_samples(self, output: SchedulerOutput, parent: Request) -> None:
        """Parallel sampling (n > 1): in the step that computes the parent's last prompt token,
        its other n - 1 samples become requests of their own that share every block of the
        parent (copy-on-write of the partial one, when each first writes into it) and draw
        their first token from the parent's logits this step."""
        params = parent.sampling_params
        children = []
        for index in range(1, params.n):
            child = Request(
                child_request_id(parent.request_id, index),
                parent.prompt_token_ids,
                dataclasses.replace(
                    params,
                    n=1,
                    seed=None if params.seed is None else params.seed + index,
                    prompt_logprobs=None,  # reported once, with the parent
                ),
                parent.eos_token_ids,
                arrival_time=parent.arrival_time,
                priority=parent.priority,
                cache_salt=parent.cache_salt,
                bad_words_token_ids=parent.bad_words_token_ids,
                tenant=parent.tenant,
                lora_request=parent.lora_request,
            )
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            child.block_hashes = list(parent.block_hashes)
            self.kv_cache_manager.fork(parent, child)
            if self.structured_output is not None and parent.structured_output is not None:
                try:
                    self.structured_output.fork(parent, child)
                except Exception as error:  # its matcher: this sample fails alone
                    logger.exception("Request %s: its grammar failed", child.request_id)
                    self._failed[child.request_id] = (
                        f"structured_outputs: the grammar failed: {describe_error(error)}"
                    )
            self.requests[child.request_id] = child
            if self._pipelined:  # it draws its first token when the parent's batch is back
                self._in_flight.add(child.request_id)
            self._forked_samples.append(child)
            self._seen_by_runner.add(child.request_id)
            output.scheduled_new_reqs.append(self._new_request_data(child))
            children.append(child.request_id)
        parent.samples_forked = True
        output.forked_samples[parent.request_id] = children

    def _run_forked_samples(self) -> None:
        """Forked samples join `running` after the loop that forked them: they have nothing to
        compute this step and must not be preempted before they draw their first token."""
        self.running.extend(self._forked_samples)
        self._forked_samples.clear()

    # ---- after the model ran ----------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply token-level stops, free what finished. A request that
        failed this step (its stage in the runner, or its grammar here) ends alone with
        finish_reason "error" and its blocks freed; the others go on as if it never ran."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.kv_tiers is not None:
            self.kv_tiers.apply_result(runner_output.kv_transfer)
        if self._pipelined:
            self._in_flight.difference_update(scheduler_output.num_scheduled_tokens)
            for children in scheduler_output.forked_samples.values():
                self._in_flight.difference_update(children)
        failed, self._failed = {**self._failed, **runner_output.failed_requests}, {}
        for request_id, message in failed.items():
            request = self.requests.get(request_id)
            if request is not None:  # else aborted while the step ran
                outputs.append(self._fail_request(request, message))
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            pooled = runner_output.pooler_output.get(request_id)
            if request is not None and pooled is not None:
                outputs.append(self._finish_pooled(request, pooled))
                continue
            token_ids = runner_output.sampled_token_ids.get(request_id)
            prompt_logprobs = runner_output.prompt_logprobs.get(request_id)
            # None: aborted or failed while the step ran; or a prefill chunk with nothing to say.
            if request is not None and (token_ids is not None or prompt_logprobs is not None):
                output = EngineCoreOutput(
                    request_id,
                    [],
                    False,
                    new_prompt_logprobs=prompt_logprobs,
                    first_scheduled_time=request.first_scheduled_time,
                )
                if token_ids is not None:
                    drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id, ())
                    self._roll_back_rejected(request, len(drafts), len(token_ids))
                    self._append_tokens(request, token_ids, runner_output, output)
                outputs.append(output)
            # A failed parent's samples go on: each drew from the parent's raw logits.
            for child_id in scheduler_output.forked_samples.get(request_id, ()):
                child = self.requests.get(child_id)
                if child is None:
                    continue
                child_output = EngineCoreOutput(child_id, [], False)
                child_tokens = runner_output.sampled_token_ids[child_id]
                self._append_tokens(child, child_tokens, runner_output, child_output)
                outputs.append(child_output)
        return outputs

    def _finish_pooled(self, request: Request, pooled: list[float]) -> EngineCoreOutput:
        """A pooling request ends with the step that computed its prompt's last token."""
        request.status = RequestStatus.FINISHED_STOPPED
        self.running.remove(request)
        self._free(request)
        return EngineCoreOutput(
            request.request_id,
            [],
            True,
            num_cached_tokens=request.num_cached_tokens,
            finish_reason=request.status.finish_reason,
            first_scheduled_time=request.first_scheduled_time,
            pooling_output=pooled,
        )

    def _roll_back_rejected(self, request: Request, num_drafts: int, num_emitted: int) -> None:
        """Speculative decoding: the step computed the request's last token and `num_drafts`
        drafts; `num_emitted - 1` drafts were accepted. The rejected ones' KV is not the
        request's: they no longer count as computed, and blocks holding only them go back
        to the pool (the runner then gets the request's table whole)."""
        if not num_drafts:
            return
        num_accepted = num_emitted - 1
        self.spec_decoding_stats.observe(num_drafts, num_accepted)
        request.num_computed_tokens -= num_drafts - num_accepted
        if self.kv_cache_manager.trim(request, self._lookahead(request, 0)):
            self._trimmed.add(request.request_id)

    def _append_tokens(
        self,
        request: Request,
        token_ids: list[int],
        runner_output: ModelRunnerOutput,
        output: EngineCoreOutput,
    ) -> None:
        """Append the step's tokens one at a time, each checked for a stop: a stop inside an
        accepted run of drafts drops the tokens after it. A request still running takes the
        tokens proposed to follow."""
        request_id = request.request_id
        logprobs = runner_output.logprobs.get(request_id)
        num_appended = 0
        for index, token_id in enumerate(token_ids):
            request.append_output_token(token_id, logprobs[index] if logprobs else None)
            num_appended += 1
            if self._check_stop_and_grammar(request, token_id, output):
                break
        if output.finished:
            self.running.remove(request)
            self._free(request)
        else:
            request.spec_token_ids = self._usable_drafts(
                request, runner_output.draft_token_ids.get(request_id)
            )
        output.new_token_ids = list(token_ids[:num_appended])
        output.cumulative_logprob = request.cumulative_logprob
        output.num_cached_tokens = request.num_cached_tokens
        output.finish_reason = request.status.finish_reason
        output.stop_reason = request.stop_reason
        if request_id in runner_output.sample_logprobs:
            output.new_logprobs = runner_output.sample_logprobs[request_id][:num_appended]

    def _check_stop_and_grammar(
        self, request: Request, token_id: int, output: EngineCoreOutput
    ) -> bool:
        output.finished = self._check_stop(request)
        if request.structured_output is not None and self.structured_output is not None:
            try:
                grammar_done = self.structured_output.accept(request, token_id)
            except Exception as error:  # its grammar alone: it ends, the batch goes on
                logger.exception("Request %s: its grammar failed", request.request_id)
                request.status = RequestStatus.FINISHED_ERROR
                output.error = f"structured_outputs: the grammar failed: {describe_error(error)}"
                grammar_done = output.finished = True
            if grammar_done and not output.finished:
                request.status = RequestStatus.FINISHED_STOPPED
                output.finished = True
        return output.finished

    def _usable_drafts(self, request: Request, drafts: list[int] | None) -> list[int]:
        """The proposals the next step may verify: none past max_tokens or the context (the
        token after the last draft is emitted too), and only a prefix the grammar allows."""
        if not drafts:
            return []
        params = request.sampling_params
        room = self.config.max_model_len - request.num_tokens
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        drafts = drafts[: max(0, room)]
        if drafts and request.structured_output is not None and self.structured_output:
            try:
                drafts = self.structured_output.valid_prefix(request, drafts)
            except Exception:  # speculation is optional: the grammar's own step reports
                logger.exception("Request %s: checking drafts failed", request.request_id)
                drafts = []
        return drafts

    def _fail_request(self, request: Request, message: str) -> EngineCoreOutput:
        """End a request that failed on its own (fault isolation); its blocks are freed."""
        self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(
            request.request_id,
            [],
            True,
            cumulative_logprob=request.cumulative_logprob,
            num_cached_tokens=request.num_cached_tokens,
            finish_reason=RequestStatus.FINISHED_ERROR.finish_reason,
            first_scheduled_time=request.first_scheduled_time,
            error=message,
        )

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        last_token_id = request.output_token_ids[-1]
        if not params.ignore_eos and last_token_id in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
        elif last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
        elif request.num_tokens >= self.config.max_model_len or (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH
        return request.is_finished

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.kv_tiers is not None:
            self.kv_tiers.request_finished(request.request_id)
        self._trimmed.discard(request.request_id)
        del self.requests[request.request_id]
        if request.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(request.request_id)
            self._resumed.discard(request.request_id)
            self._finished_req_ids.add(request.request_id)


def _token_ids(request: Request, num_new_tokens: int, to_end: bool) -> list[int]:
    """The request's tokens from its first uncomputed one: the `num_new_tokens` it runs now,
    or (`to_end`: resumed after preemption) all of them to its last."""
    start = request.num_computed_tokens
    end = request.num_tokens if to_end else start + num_new_tokens
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    if start >= num_prompt:
        return output[start - num_prompt : end - num_prompt]
    return prompt[start:] + output[: end - num_prompt]
