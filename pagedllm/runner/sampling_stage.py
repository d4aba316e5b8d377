"""One step's sampling on the sampling rank: from the step's logits to its tokens.

`SamplingStage` owns the step's sampling inputs: the logits of each row due a token (and,
with speculative decoding, of each draft it verifies), the rows' places in the runner's
`InputBatch`, their request ids, and the scheduler's output. It adds the samples forked this
step (parallel sampling, n > 1), runs the per-request stages (logits processors, then the
grammar bitmask), then samples one token a row or verifies the drafts, and reports
logprobs. `prompt_logprobs` scores the prompt tokens a step ran, from its hidden states.

Fault isolation: the per-request stages run batched; when they raise, each row is tried
alone (`isolate_row_faults`), the requests at fault are reported in
`ModelRunnerOutput.failed_requests` and dropped, and the other rows sample exactly what they
would have. An error no single request reproduces raises. For tests,
`PAGEDLLM_INJECT_FAULT_SEED=<seed>` makes requests with that seed raise in these stages (a
stand-in for a request-attributable bug; unset in production).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.errors import describe_error
from pagedllm.fault_isolation import isolate_row_faults
from pagedllm.ops.kernel_selection import KernelSelection
from pagedllm.runner.input_batch import InputBatch, to_device
from pagedllm.sample.grammar_bitmask import apply_bitmask
from pagedllm.sample.logits_processors import LogitsProcessorState, apply_logits_processors
from pagedllm.sample.logprobs import token_logprobs
from pagedllm.sample.sampler import Sampler, SamplingMetadata
from pagedllm.spec_decode.runner.proposer import Proposer
from pagedllm.spec_decode.runner.rejection_sampler import rejection_sample

logger = logging.getLogger(__name__)

FAULT_SEED_ENV = "PAGEDLLM_INJECT_FAULT_SEED"

# (logits, batch rows, request ids, each request's drafts) -> the processed logits.
Stages = Callable[[torch.Tensor, np.ndarray, list[str], list[list[int]]], torch.Tensor]


def injected_fault_seed() -> int | None:
    """The seed whose requests the test-only injected fault hits (None: off)."""
    value = os.environ.get(FAULT_SEED_ENV, "")
    return int(value) if value else None


@dataclass(frozen=True)
class SamplingTools:
    """The runner's long-lived parts that a step's sampling uses."""

    input_batch: InputBatch
    sampler: Sampler
    proposer: Proposer | None
    kernels: KernelSelection
    vocab_size: int
    device: torch.device
    faulty: set[str]  # requests the injected fault hits


class SamplingStage:
    """The sampling of one step. Request i owns `counts[i]` consecutive rows of `logits`:
    its last token's, then one after each draft it verifies. Forked samples and failed
    requests change which requests the stage holds; `run` leaves the tokens in `output`."""

    def __init__(
        self,
        tools: SamplingTools,
        scheduler_output: SchedulerOutput,
        output: ModelRunnerOutput,
        logits: torch.Tensor,
        rows: np.ndarray,
        req_ids: list[str],
        num_drafts: np.ndarray,
    ) -> None:
        self.tools = tools
        self.scheduler_output = scheduler_output
        self.output = output
        self.logits = logits
        self.rows = rows
        self.req_ids = req_ids
        self.counts = 1 + num_drafts
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        self.drafts = [spec_tokens.get(request_id, []) for request_id in req_ids]

    @property
    def input_batch(self) -> InputBatch:
        return self.tools.input_batch

    def run(self) -> None:
        if self.scheduler_output.scheduled_spec_decode_tokens:
            self._verify_drafts()
        else:
            self._sample()

    # ---- sampling -----------------------------------------------------------------------
    def _sample(self) -> None:
        """One token for each row that is due one (the step verifies no drafts)."""
        self._add_forked_samples()
        processed = self._process(self._row_stages)
        if not self.req_ids:
            return
        batch, output = self.input_batch, self.output
        wants_logprobs = bool((batch.num_logprobs[self.rows] >= 0).any())
        sampled = self.tools.sampler(
            processed,
            self._sampling_metadata(),
            raw_logits=self.logits,
            compute_logprobs=wants_logprobs,
        )
        token_ids = sampled.token_ids.cpu().numpy()
        batch.append_tokens(self.rows, token_ids)
        output.sampled_token_ids = {
            request_id: [token_id]
            for request_id, token_id in zip(self.req_ids, token_ids.tolist(), strict=True)
        }
        if wants_logprobs:
            asking = batch.num_logprobs[self.rows] >= 0
            output.logprobs = {
                request_id: [logprob]
                for request_id, logprob, ask in zip(
                    self.req_ids, sampled.logprobs.tolist(), asking, strict=True
                )
                if ask
            }
            self._sample_logprobs(sampled.token_ids)

    def _verify_drafts(self) -> None:
        """Speculative decoding: each request has 1 + its drafts' rows of logits (the
        target's scores after its last token and after each draft). The rejection sampler
        emits the accepted drafts and one token after them, distributed exactly as sampling
        one token at a time would be (greedy: the same tokens)."""
        self._add_forked_samples()
        processed = self._process(self._draft_stages)
        if not self.req_ids:
            return
        proposer = self.tools.proposer
        emitted = rejection_sample(
            processed,
            self.drafts,
            proposer.draft_probs(self.req_ids, self.drafts)
            if proposer
            else [None] * len(self.req_ids),
            self._sampling_metadata(),
            self.tools.kernels,
        )
        for row, tokens in zip(self.rows.tolist(), emitted, strict=True):
            for token_id in tokens:  # one at a time: each moves the row's end
                self.input_batch.append_tokens(np.array([row]), np.array([token_id]))
        self.output.sampled_token_ids = dict(zip(self.req_ids, emitted, strict=True))
        self._spec_logprobs(emitted)

    def _add_forked_samples(self) -> None:
        """Parallel sampling: the samples the scheduler forked this step draw their first
        token from their parent's first logits row (a parent verifies no drafts: its prompt
        ends this step), each in a row of its own (own seed, own penalties), after the others."""
        forked = self.scheduler_output.forked_samples
        if not forked:
            return
        batch = self.input_batch
        spec_tokens = self.scheduler_output.scheduled_spec_decode_tokens
        first_rows = _starts(self.counts)
        parent_index, child_rows, child_ids = [], [], []
        for index, request_id in enumerate(self.req_ids):
            for child_id in forked.get(request_id, ()):
                parent_index.append(int(first_rows[index]))
                child_rows.append(batch.row(child_id))
                child_ids.append(child_id)
        if not child_rows:
            return
        parents = self.logits[self._tensor(np.array(parent_index))]
        self.logits = torch.cat([self.logits, parents])
        self.rows = np.concatenate([self.rows, np.array(child_rows, dtype=np.int64)])
        self.req_ids = self.req_ids + child_ids
        self.counts = np.concatenate([self.counts, np.ones(len(child_ids), dtype=np.int64)])
        self.drafts = self.drafts + [spec_tokens.get(child_id, []) for child_id in child_ids]

    def _sampling_metadata(self) -> SamplingMetadata:
        batch, rows, vocab_size = self.input_batch, self.rows, self.tools.vocab_size
        temperature = batch.temperature[rows]
        top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        random = temperature > 0
        generators = {
            i: batch.generators[row]
            for i, row in enumerate(rows.tolist())
            if row in batch.generators
        }
        return SamplingMetadata(
            temperature=self._tensor(temperature),
            top_k=self._tensor(top_k) if (top_k[random] < vocab_size).any() else None,
            top_p=self._tensor(top_p) if (top_p[random] < 1).any() else None,
            min_p=self._tensor(min_p) if (min_p[random] > 0).any() else None,
            generators=generators,
            all_greedy=not random.any(),
            all_random=bool(random.all()),
        )

    # ---- the per-request stages, isolated row by row --------------------------------------
    def _process(self, stages: Stages) -> torch.Tensor:
        """`stages` on the requests that have not failed, batched. When that raises, the
        requests whose rows raise alone are recorded in `failed_requests` and dropped, and the
        rest run batched again (every other row gets exactly the logits it would have had).
        Leaves the stage holding the requests that go on to sampling; returns their
        processed logits."""
        failed = self.output.failed_requests
        self._keep([i for i, request_id in enumerate(self.req_ids) if request_id not in failed])

        def run(indices: list[int]) -> torch.Tensor:
            logits, rows, req_ids, drafts = self._subset(indices)
            return stages(logits, rows, req_ids, drafts) if req_ids else logits

        processed, healthy = isolate_row_faults(run, range(len(self.req_ids)), self._fail)
        self._keep(healthy)
        return processed

    def _fail(self, index: int, error: Exception) -> None:
        request_id = self.req_ids[index]
        logger.exception("Request %s: its logits processing failed", request_id)
        self.output.failed_requests[request_id] = (
            f"logits processing failed: {describe_error(error)}"
        )

    def _subset(self, indices: list[int]) -> tuple[torch.Tensor, np.ndarray, list[str], list]:
        """The logits, rows, request ids and drafts of the requests at `indices` (sorted)."""
        if len(indices) == len(self.req_ids):  # all of them: no copy on the common path
            return self.logits, self.rows, self.req_ids, self.drafts
        logits = self.logits[self._tensor(_expanded_index(self.counts, indices))]
        return (
            logits,
            self.rows[indices],
            [self.req_ids[i] for i in indices],
            [self.drafts[i] for i in indices],
        )

    def _keep(self, indices: list[int]) -> None:
        counts = self.counts[indices]
        self.logits, self.rows, self.req_ids, self.drafts = self._subset(indices)
        self.counts = counts

    def _row_stages(self, logits, rows, req_ids, _drafts) -> torch.Tensor:
        return self._per_request_stages(logits, rows, req_ids)

    def _per_request_stages(self, logits, rows: np.ndarray, req_ids: list[str]) -> torch.Tensor:
        self._raise_injected_fault(req_ids)
        processed = self._apply_logits_processors(logits, rows)
        return self._apply_grammar(processed, logits, req_ids)

    def _apply_logits_processors(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """Penalties, biases and bans on a copy: logprobs are reported from the raw logits."""
        states = self.input_batch.logits_states
        if not states:
            return logits
        row_states = [states.get(row) for row in rows.tolist()]
        if not any(state is not None and state.needs_processing() for state in row_states):
            return logits
        return apply_logits_processors(logits.to(torch.float32).clone(), row_states)

    def _apply_grammar(self, processed, raw_logits, req_ids: list[str]) -> torch.Tensor:
        """Structured output: forbid the tokens each constrained row's grammar does not allow
        (on a copy when no processor made one: logprobs are reported from the raw logits)."""
        return self._mask_by_grammar(processed, raw_logits, req_ids, [[] for _ in req_ids])

    def _draft_stages(self, logits, rows, req_ids, request_drafts) -> torch.Tensor:
        """Logits processors and the grammar bitmask at each position of each request: the
        state at position i has the first i drafts appended (penalties, min_tokens)."""
        self._raise_injected_fault(req_ids)
        states = self.input_batch.logits_states
        position_states = []
        for row, drafts in zip(rows.tolist(), request_drafts, strict=True):
            position_states.extend(_states_after_drafts(states.get(row), drafts))
        processed = logits
        if any(state is not None and state.needs_processing() for state in position_states):
            processed = apply_logits_processors(logits.to(torch.float32).clone(), position_states)
        return self._mask_by_grammar(processed, logits, req_ids, request_drafts)

    def _mask_by_grammar(self, processed, raw_logits, req_ids, request_drafts) -> torch.Tensor:
        """The step's grammar bitmask on each constrained request's rows: its last token's
        and one after each of its drafts, each with the bitmask row of its position."""
        scheduler_output = self.scheduler_output
        bitmask = scheduler_output.grammar_bitmask
        if bitmask is None:
            return processed
        # A sample forked this step starts from its parent's grammar state.
        parent_of = _parents(scheduler_output.forked_samples)
        logits_rows, mask_rows, start = [], [], 0
        for request_id, drafts in zip(req_ids, request_drafts, strict=True):
            first = scheduler_output.grammar_rows.get(parent_of.get(request_id, request_id))
            if first is not None:
                logits_rows.extend(range(start, start + len(drafts) + 1))
                mask_rows.extend(range(first, first + len(drafts) + 1))
            start += len(drafts) + 1
        return _mask_rows(processed, raw_logits, bitmask, logits_rows, mask_rows)

    def _raise_injected_fault(self, req_ids: list[str]) -> None:
        faulty = self.tools.faulty
        if faulty and not faulty.isdisjoint(req_ids):
            raise RuntimeError(f"injected fault ({FAULT_SEED_ENV})")

    # ---- logprobs -------------------------------------------------------------------------
    def _sample_logprobs(self, token_ids: torch.Tensor) -> None:
        """Rank and top alternatives of each sampled token, for the rows that asked."""
        wanted = self.input_batch.num_logprobs[self.rows]
        asking = np.flatnonzero(wanted >= 0)
        if not len(asking):
            return
        index = self._tensor(asking)
        result = token_logprobs(self.logits[index], token_ids[index], int(wanted[asking].max()))
        for i, row_index in enumerate(asking.tolist()):
            self.output.sample_logprobs[self.req_ids[row_index]] = [
                result.row(i, int(wanted[row_index]))
            ]

    def _spec_logprobs(self, emitted: list[list[int]]) -> None:
        """Logprobs of the emitted tokens from the target's raw logits at their positions."""
        wanted = self.input_batch.num_logprobs[self.rows]
        if not (wanted >= 0).any():
            return
        starts = _starts(self.counts)
        for i in np.flatnonzero(wanted >= 0).tolist():
            tokens = emitted[i]
            block = self.logits[int(starts[i]) : int(starts[i]) + len(tokens)]
            result = token_logprobs(block, self._tensor(np.array(tokens)), int(wanted[i]))
            request_id = self.req_ids[i]
            self.output.logprobs[request_id] = result.logprobs.tolist()
            self.output.sample_logprobs[request_id] = [
                result.row(j, int(wanted[i])) for j in range(len(tokens))
            ]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.tools.device)


def prompt_logprobs(
    output: ModelRunnerOutput,
    batch: InputBatch,
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    req_ids: list[str],
    rows: np.ndarray,
    num_scheduled: np.ndarray,
    hidden_states: torch.Tensor,
) -> None:
    """Logprob of each prompt token this step saw the position before (rows that asked)."""
    query_start = 0
    for request_id, row, count in zip(req_ids, rows.tolist(), num_scheduled.tolist(), strict=True):
        num_top = int(batch.num_prompt_logprobs[row])
        start = int(batch.num_computed_tokens[row])
        # Position p's logits score prompt token p + 1; the last prompt position's
        # logits belong to the first sampled token instead.
        end = min(start + count, int(batch.num_prompt_tokens[row]) - 1)
        if num_top >= 0 and end > start:
            logits = compute_logits(hidden_states[query_start : query_start + end - start])
            if logits is None:  # a tensor-parallel peer of the sampling rank
                query_start += count
                continue
            targets = to_device(batch.token_ids[row, start + 1 : end + 1], batch.device)
            result = token_logprobs(logits, targets, num_top)
            output.prompt_logprobs[request_id] = {
                start + 1 + i: result.row(i, num_top) for i in range(end - start)
            }
        query_start += count


def _starts(counts: np.ndarray) -> np.ndarray:
    """Each request's first logits row, where request i owns `counts[i]` rows in order."""
    return np.cumsum(counts) - counts


def _expanded_index(counts: np.ndarray, keep: list[int]) -> np.ndarray:
    """The logits rows of the kept requests, where request i owns `counts[i]` rows in order."""
    if not keep:
        return np.zeros(0, dtype=np.int64)
    starts = _starts(counts)
    return np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in keep])


def _parents(forked_samples: dict[str, list[str]]) -> dict[str, str]:
    """Each sample forked this step -> its parent (whose grammar state it starts from)."""
    return {child: parent for parent, children in forked_samples.items() for child in children}


def _mask_rows(processed, raw_logits, bitmask, logits_rows: list[int], mask_rows: list[int]):
    """Apply bitmask row `mask_rows[i]` to logits row `logits_rows[i]`, on a copy when no
    processor made one (logprobs are reported from the raw logits)."""
    if not logits_rows:
        return processed
    if processed is raw_logits:
        processed = raw_logits.to(torch.float32).clone()
    apply_bitmask(processed, bitmask[mask_rows], torch.tensor(logits_rows))
    return processed


def _states_after_drafts(
    state: LogitsProcessorState | None, drafts: list[int]
) -> list[LogitsProcessorState | None]:
    """A request's logits-processor state at each verified position: as it is, then with
    each draft appended in turn (copies: the drafts are not the request's yet)."""
    states = [state]
    for token_id in drafts:
        if state is not None:
            state = copy.deepcopy(state)
            state.append_output_token(token_id)
        states.append(state)
    return states
