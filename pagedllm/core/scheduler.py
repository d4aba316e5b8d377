"""The scheduler: decides each step which requests run how many tokens, within one budget,
and applies each step's outcome.

The rule: one token budget (max_num_batched_tokens) per step, shared by all. The policy
offers candidates in its order, and each is handled alike. A running one is given the
tokens it is behind by (1 for a decode, plus the drafts it verifies; the rest of its
prompt for a prefill) within what is left of the budget, so long prompts are prefilled in
chunks beside other requests' decodes; when the pool is short, the policy's victim (fcfs:
the newest running request; priority: the lowest; fair: the newest of the tenant furthest
above its share) is preempted until the request fits or was itself preempted. A waiting
one is admitted while max_num_seqs and free blocks allow, taking its longest prefix-cache
hit (and what the KV tiers hold past it) first. Passed over for a step, with those behind
it going on: a request in a pipeline batch still in flight, one whose LoRA adapter would
be one too many, one whose grammar compiles or whose KV is read from disk. What a policy
keeps for others (fair: seats and blocks claimed by tenants below their share) is not taken.

The loop is the same for every policy and feature. The policy (`core/policy.py`) offers
candidates and charges them; each feature meets the loop through its participant:
structured output (`structured_output/scheduling.py`), speculative decoding
(`spec_decode/core/scheduling.py`), the KV tiers (`kv_transfer/core/scheduling.py`), and parallel
sampling through `Request.fork`. None of them branches on another.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagedllm.config import SchedulerConfig
from pagedllm.core.fair_policy import FairPolicy
from pagedllm.core.kv_cache_manager import KVAllocation, KVCacheManager
from pagedllm.core.messages import EngineCoreOutput
from pagedllm.core.policy import Outcome, StepState, create_policy, seats_of
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner_view import RunnerView
from pagedllm.core.scheduler_output import (
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagedllm.core.stop_checks import check_stop
from pagedllm.kv_transfer.core.scheduling import kv_tier_participant
from pagedllm.kv_transfer.core.tier_manager import KVTierManager
from pagedllm.lora.core.scheduling import LoRASlots
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.core.scheduling import DraftScheduling
from pagedllm.structured_output.scheduling import GrammarScheduling, GrammarStatus

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import StructuredOutputManager


class Scheduler:
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
        # The features' scheduler sides (each a no-op when its feature is off).
        self.grammar = GrammarScheduling(structured_output)
        self.drafts = DraftScheduling(speculative_config, kv_cache_manager, config.max_model_len)
        self.kv_tiers = kv_tier_participant(kv_cache_manager, kv_tiers)
        self.lora = LoRASlots(config.max_loras)
        # Who goes next, what is kept for others, who is preempted.
        self.policy = create_policy(
            config.policy, lambda: FairPolicy(config, kv_cache_manager, self.grammar)
        )
        self.requests: dict[str, Request] = {}
        self.waiting = self.policy.waiting
        self.running: list[Request] = []
        # Outputs decided outside a model step (a grammar that failed to compile).
        self._pending_outputs: list[EngineCoreOutput] = []
        # Fault isolation: requests whose own grammar raised while scheduling (id -> what
        # raised); they run this step like the others and end in update_from_output.
        self._failed: dict[str, str] = {}
        self.runner_view = RunnerView(
            kv_cache_manager.get_block_ids, self.drafts.take_trimmed, config.send_token_ids
        )
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
        self.grammar.add_request(request)
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

    def has_unfinished_requests(self) -> bool:
        return bool(len(self.waiting) or self.running or self._pending_outputs)

    # ---- one step ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_req_ids=self.runner_view.take_finished())
        step = StepState(
            budget=self.config.max_num_batched_tokens,
            running=self.running,
            in_flight=self._in_flight,
            speculating=self.drafts.speculating(len(self.running)),
            release=self._preempt,
            num_seats=sum(seats_of(request) for request in self.running),
        )
        output.speculating = step.speculating
        self.policy.begin_step(step)
        self._fill_step(output, step)
        for request in reversed(step.skipped):  # back at the head, in their order
            self.waiting.add_preempted(request)
        # Forked samples join `running` after the loop that forked them: they have nothing
        # to compute this step and must not be preempted before they draw their first token.
        self.running.extend(self._forked_samples)
        self._forked_samples.clear()
        self.grammar.add_bitmask(output, self.requests, self._failed)
        output.kv_transfer = self.kv_tiers.take_ops()
        return output

    def _fill_step(self, output: SchedulerOutput, step: StepState) -> None:
        """The one loop: each candidate the policy offers is run or admitted by the same
        rules, and the policy hears what became of it."""
        candidates = self.policy.candidates(step)
        outcome = None
        while step.budget > 0:
            try:
                request = candidates.send(outcome)
            except StopIteration:
                return
            if request.status == RequestStatus.RUNNING:
                outcome = self._continue_running(output, step, request)
            else:
                outcome = self._admit(output, step, request)
        candidates.close()

    def _continue_running(self, output: SchedulerOutput, step: StepState, request: Request):
        if request.request_id in step.in_flight or not self.lora.fits(request, step.loras):
            return Outcome.SKIPPED
        num_new_tokens = step.tokens_due(request)
        allocation = self._allocate_running(step, request, num_new_tokens)
        if isinstance(allocation, Outcome):
            return allocation
        self._run(output, step, request, num_new_tokens, allocation)
        return Outcome.SCHEDULED

    def _allocate_running(
        self, step: StepState, request: Request, num_new_tokens: int
    ) -> KVAllocation | Outcome:
        """Blocks for a running request's tokens, preempting the policy's victims as needed;
        blocks the policy keeps for others are not taken (the request waits a step)."""
        kv = self.kv_cache_manager
        while True:
            lookahead = self.drafts.lookahead(request, num_new_tokens)
            reserved = self.policy.reserved_for_others(step, request).blocks
            needed = (
                kv.num_blocks_to_allocate(request, num_new_tokens + lookahead) if reserved else 0
            )
            if needed <= kv.num_free_blocks - reserved:
                allocation = kv.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=lookahead
                )
                if allocation is not None:
                    return allocation
            elif needed <= kv.num_free_blocks:
                return Outcome.WAITING
            victim = self.policy.preemption_victim(step, request)
            self.policy.before_preempt(step, victim)
            step.preempt(victim)
            if victim is request:
                return Outcome.PREEMPTED

    def _admit(self, output: SchedulerOutput, step: StepState, request: Request) -> Outcome:
        """Admit a waiting request: its known blocks are taken, only the rest is computed."""
        kv = self.kv_cache_manager
        if self._grammar_pending(request):
            if not request.is_finished:  # still compiling: let the requests behind go
                step.skipped.append(self.waiting.take(request))
            return Outcome.SKIPPED
        if not self.policy.may_admit(step, request):
            return Outcome.NO_ROOM
        reserved = self.policy.reserved_for_others(step, request)
        seats = seats_of(request)
        if step.num_seats + seats > self.config.max_num_seqs - reserved.seats:
            return Outcome.NO_ROOM
        lookup = self.kv_tiers.lookup(request) if self.lora.fits(request, step.loras) else None
        parked = request.status is RequestStatus.WAITING_FOR_KV
        if lookup is None or parked:  # no LoRA slot, or its KV read from disk: skip it
            step.skipped.append(self.waiting.take(request))
            return Outcome.SKIPPED
        num_known = lookup.num_hit_tokens + lookup.num_loaded_tokens
        num_new_tokens = min(request.num_tokens - num_known, step.budget)
        if not self.policy.affords(step, request, num_new_tokens):
            return Outcome.UNAFFORDABLE
        lookahead = self.drafts.lookahead(request, num_new_tokens, num_known)
        num_slots = lookup.num_loaded_tokens + num_new_tokens
        needed = kv.num_blocks_to_allocate(request, num_slots + lookahead, lookup.hits)
        if needed > kv.num_free_blocks - reserved.blocks:
            return Outcome.NO_ROOM
        allocation = kv.allocate_slots(request, num_slots, lookup.hits, lookahead)
        if allocation is None:
            return Outcome.NO_ROOM
        self.waiting.take(request)
        self.kv_tiers.load(request, lookup)  # the tiers' bytes arrive before the step runs
        self._start_running(request, lookup.num_hit_tokens, lookup.num_loaded_tokens)
        step.num_seats += seats  # before _schedule forks them
        self._run(output, step, request, num_new_tokens, allocation, needed)
        return Outcome.SCHEDULED

    def _run(
        self,
        output: SchedulerOutput,
        step: StepState,
        request: Request,
        num_new_tokens: int,
        allocation: KVAllocation,
        num_admitted_blocks: int | None = None,
    ) -> None:
        self.policy.charge(step, request, num_new_tokens, allocation, num_admitted_blocks)
        self._schedule(output, request, num_new_tokens, allocation)
        step.budget -= num_new_tokens
        step.loras.add(request.lora_int_id)

    def _grammar_pending(self, request: Request) -> bool:
        """True while the request's grammar compiles; a failed one ends the request here."""
        status = self.grammar.status(request)
        if status is GrammarStatus.FAILED:
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ERROR
            del self.requests[request.request_id]
            self._pending_outputs.append(
                self._final_output(request, error=self.grammar.error(request))
            )
        return status is not GrammarStatus.READY

    def _preempt(self, request: Request) -> None:
        """A request already out of `running` gives its blocks back and waits again."""
        self.kv_tiers.on_preempt(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self.drafts.take_trimmed(request.request_id)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.runner_view.preempted(request.request_id)
        self.waiting.add_preempted(request)

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
        """Put the request's next `num_new_tokens` (and the drafts among them) in the step."""
        request_id = request.request_id
        self.runner_view.add(output, request, num_new_tokens, allocation)
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
        self.kv_tiers.on_scheduled(request, computed)
        if request.num_unforked_samples and request.num_computed_tokens == request.num_tokens:
            self._fork_samples(output, request)

    def _fork_samples(self, output: SchedulerOutput, parent: Request) -> None:
        """Parallel sampling (n > 1): in the step that computes the parent's last prompt token,
        its other n - 1 samples become requests of their own that share every block of the
        parent (copy-on-write of the partial one, when each first writes into it) and draw
        their first token from the parent's logits this step."""
        children = [parent.fork(index) for index in range(1, parent.sampling_params.n)]
        for child in children:
            self.kv_cache_manager.fork(parent, child)
            error = self.grammar.fork(parent, child)
            if error is not None:
                self._failed[child.request_id] = error
            self.requests[child.request_id] = child
            if self._pipelined:  # it draws its first token when the parent's batch is back
                self._in_flight.add(child.request_id)
            self._forked_samples.append(child)
            self.runner_view.add_new(output, child)
        parent.samples_forked = True
        output.forked_samples[parent.request_id] = [child.request_id for child in children]

    # ---- after the model ran ----------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply token-level stops, free what finished. A request that
        failed this step (its stage in the runner, or its grammar here) ends alone with
        finish_reason "error" and its blocks freed; the others go on as if it never ran."""
        outputs, self._pending_outputs = self._pending_outputs, []
        self.kv_tiers.apply_result(runner_output.kv_transfer)
        self._in_flight.difference_update(
            scheduler_output.num_scheduled_tokens, *scheduler_output.forked_samples.values()
        )
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
                    self.drafts.roll_back_rejected(request, len(drafts), len(token_ids))
                    self._append_tokens(request, token_ids, runner_output, output)
                outputs.append(output)
            # A failed parent's samples go on: each drew from the parent's raw logits.
            for child_id in scheduler_output.forked_samples.get(request_id, ()):
                if (child := self.requests.get(child_id)) is not None:
                    tokens = runner_output.sampled_token_ids[child_id]
                    outputs.append(child_output := EngineCoreOutput(child_id, [], False))
                    self._append_tokens(child, tokens, runner_output, child_output)
        return outputs

    def _finish_pooled(self, request: Request, pooled: list[float]) -> EngineCoreOutput:
        """A pooling request ends with the step that computed its prompt's last token."""
        request.status = RequestStatus.FINISHED_STOPPED
        self.running.remove(request)
        self._free(request)
        return self._final_output(request, pooling_output=pooled)

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
            request.spec_token_ids = self.drafts.usable_drafts(
                request, runner_output.draft_token_ids.get(request_id), self.grammar.valid_prefix
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
        output.finished = check_stop(request, self.config.max_model_len)
        grammar_done, error = self.grammar.accept(request, token_id)
        if error is not None:  # its grammar alone: it ends, the batch goes on
            request.status = RequestStatus.FINISHED_ERROR
            output.error = error
            output.finished = True
        elif grammar_done and not output.finished:
            request.status = RequestStatus.FINISHED_STOPPED
            output.finished = True
        return output.finished

    def _fail_request(self, request: Request, message: str) -> EngineCoreOutput:
        """End a request that failed on its own (fault isolation); its blocks are freed."""
        self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        return self._final_output(
            request, cumulative_logprob=request.cumulative_logprob, error=message
        )

    def _final_output(self, request: Request, **fields) -> EngineCoreOutput:
        """The last output of a request that ended outside the token loop."""
        return EngineCoreOutput(
            request.request_id,
            [],
            True,
            num_cached_tokens=request.num_cached_tokens,
            finish_reason=request.status.finish_reason,
            first_scheduled_time=request.first_scheduled_time,
            **fields,
        )

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.kv_tiers.request_finished(request.request_id)
        self.drafts.take_trimmed(request.request_id)
        del self.requests[request.request_id]
        self.runner_view.freed(request.request_id)
