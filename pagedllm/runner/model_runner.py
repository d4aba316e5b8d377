"""`ModelRunner`: one rank's step: turns a `SchedulerOutput` into tokens.

A step applies the scheduler's updates to the persistent `InputBatch`, copies blocks
(copy-on-write), lays the step out, runs the stage's forward and, on the sampling rank,
hands the logits to the step's `SamplingStage`. What the runner runs on is built once by
`ModelBuilder` (model_building.py); the debug-mode KV check is kv_integrity.py's.

All scheduled tokens of a step run as one flattened batch (no padding to the longest);
the layout (token ids, positions, slot mapping, block tables) is built with numpy from
the persistent `InputBatch`, and logits are computed only for rows that sample.

Fault isolation: a request whose own row cannot be added (its parameters raise) gets an
inert row that runs the forward but never samples, and is reported in
`ModelRunnerOutput.failed_requests`; the per-request sampling stages isolate their faults
the same way (sampling_stage.py).

Several ranks (`distributed/parallel_state.py` groups): each rank's KV pool holds its own
KV heads (tensor parallel) for its stage's layers (pipeline parallel). Only the sampling
rank (the first tensor-parallel rank of the last stage) holds the sampled tokens; the others
write the tokens each running request runs (`CachedRequestData.token_ids`) into their
batch before laying it out. A stage after the first receives the previous stage's
(hidden, residual) instead of embedding token ids, a stage before the last sends its own
on; the last stage's ranks compute logits together (only the sampling rank gets them) and
only the sampling rank samples. It alone proposes speculative drafts: a draft model is
loaded there only, whole (model_building.py), with its own KV of every layer and head, and
reads the full token history the sampling rank's batch holds. An EAGLE or Medusa head is
also handed the target's hidden states of every forward (`_hand_target_states`: the output,
or the layers `StageTap` keeps, carried from the stages that run them; whole on every
tensor-parallel rank), so it needs no second pass, and reads them in the same step; it
shares whole copies of the target's embedding and lm_head where they are sharded or on
another stage (whole_target_parts.py).

Observers (`add_forward_observer`) see every forward with its inputs and wall time, so
benchmarks time and capture steps without patching the runner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.config import EngineConfig, kv_cache_groups
from pagedllm.core.scheduler_output import KVTableCheck, ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import get_pp_group, get_tp_group, get_world_group
from pagedllm.errors import describe_error
from pagedllm.kv_transfer.runner.tier_worker import KVTierWorker
from pagedllm.lora.runner.model_manager import LoRAModelManager
from pagedllm.model.loader import ModelSource
from pagedllm.ops.attention import AttentionLayout
from pagedllm.parallel_config import pipeline_stage_layers
from pagedllm.runner import kv_integrity
from pagedllm.runner.compile_choice import eager_reason
from pagedllm.runner.input_batch import InputBatch, to_device
from pagedllm.runner.kv_pool_ranges import publish_kv_pool_ranges
from pagedllm.runner.kv_prefault import KVCachePrefaulter
from pagedllm.runner.model_building import BuiltModel, ModelBuilder
from pagedllm.runner.pooler import Pooler
from pagedllm.runner.sampling_stage import (
    SamplingStage,
    SamplingTools,
    injected_fault_seed,
    prompt_logprobs,
)
from pagedllm.runner.stage_tap import StageTap
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.head_layers import aux_layers
from pagedllm.spec_decode.runner.eagle_head import TargetParts
from pagedllm.spec_decode.runner.proposer import build_proposer
from pagedllm.spec_decode.runner.whole_target_parts import target_parts
from pagedllm.utils import cdiv

logger = logging.getLogger(__name__)

# A request whose own parameters could not be loaded still gets a row (the forward must
# write its prompt's KV, which the prefix cache may already share), with these: it never samples.
_INERT_PARAMS = SamplingParams()


@dataclass(frozen=True)
class ForwardStep:
    """One forward of a runner, as its observers see it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: Any  # the attention backend's (a tuple of them with several KV cache groups)
    num_scheduled_tokens: int
    # Wall time of the forward, a pipeline stage's receive included; on an accelerator the
    # kernels may still run after it returns.
    seconds: float

    @property
    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(input_ids, positions, metadata): the forward's arguments, to run it again."""
        return self.input_ids, self.positions, self.metadata


ForwardObserver = Callable[[ForwardStep], None]


class ModelRunner:
    """Built in stages by its `Worker`: `initialize_kv_cache`, then `load_model`."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        model_config = config.model_config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.vocab_size = model_config.vocab_size
        # One table per KV cache group, interleaved in each row (see core/kv_cache_manager.py).
        self.kv_groups = config.cache_config.kv_groups or kv_cache_groups(
            [None] * model_config.num_layers
        )
        self.num_kv_groups = self.kv_groups.num_groups
        max_blocks = cdiv(model_config.max_model_len, self.block_size) * self.num_kv_groups
        self.input_batch = InputBatch(model_config.max_model_len, max_blocks, device=self.device)
        # One (K, V) pair per layer of the stage; layers of different groups share pairs.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_cache_pool: list[tuple[torch.Tensor, torch.Tensor]] = []
        # A speculative draft model's own pool of the same blocks (empty without one).
        self.draft_kv_pool: list[tuple[torch.Tensor, torch.Tensor]] = []
        tp_group, self.pp_group = get_tp_group(), get_pp_group()
        self.tp_size = tp_group.world_size
        self.rank_name = (
            f"rank {tp_group.global_rank} (tensor-parallel rank {tp_group.rank_in_group} of "
            f"{self.tp_size}, pipeline stage {self.pp_group.rank_in_group} of "
            f"{self.pp_group.world_size})"
        )
        # The rank that samples; every other rank returns an empty output.
        self.is_first_tp_rank = tp_group.is_first_rank
        self.is_sampling_rank = self.is_first_tp_rank and self.pp_group.is_last_rank
        self.is_first_stage = self.pp_group.is_first_rank
        self.is_last_stage = self.pp_group.is_last_rank
        self.layers = pipeline_stage_layers(
            model_config.num_layers, self.pp_group.world_size, self.pp_group.rank_in_group
        )
        self.builder = ModelBuilder(config, device, self.tp_size, self.layers, self.kv_groups)
        self._prefaulter: KVCachePrefaulter | None = None
        self._fault_seed = injected_fault_seed()
        self._faulty: set[str] = set()  # requests the injected fault hits
        self._forward_observers: list[ForwardObserver] = []
        # Speculative decoding: what proposes each request's next tokens (None: off).
        self.proposer = build_proposer(config.speculative_config)
        # The target's layers an EAGLE-3 head reads, kept by this stage during each forward
        # and carried to the last (None: none here).
        self._stage_tap: StageTap | None = None
        # LoRA: the adapters and the model's LoRA layers (None: enable_lora is off).
        self.lora_manager: LoRAModelManager | None = None
        # KV tiers: host memory, disk, a peer instance (None: off).
        self.kv_tiers: KVTierWorker | None = None
        # runner="pooling": prompts become vectors, nothing is sampled (None: generate).
        self.pooler = Pooler(config.pooler_config) if config.pooler_config is not None else None

    # ---- start-up -----------------------------------------------------------------------
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged pool (K and V per layer) and start faulting its pages in."""
        self.kv_cache_pool = self.builder.allocate_kv_cache(num_blocks)
        slots = self.kv_groups.layer_slots(self.layers)
        self.kv_caches = [self.kv_cache_pool[slot] for _, slot in slots.values()]

    def kv_block_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the main pool, block id on dim 0: a block is row b of each."""
        return [tensor for pair in self.kv_cache_pool for tensor in pair]

    def load_model(self, source: ModelSource) -> None:
        """Load the weights, bind the KV cache, and compile the decode step when asked."""
        builder = self.builder
        self.model, self.kernels, self.attention_backend = builder.build_model(
            source, self.config.model_config
        )
        if self.config.lora_config is not None:
            self.lora_manager = LoRAModelManager(
                self.model, self.config.lora_config, self.config.model_config, self.device
            )
        if self.num_kv_groups == 1:
            self.model.bind_kv_cache(self.kv_caches)
        else:
            groups = [group for group, _ in self.kv_groups.layer_slots(self.layers).values()]
            self.model.bind_kv_cache(self.kv_caches, groups)
        self.sampler = Sampler(self.kernels)
        draft_config = self.config.draft_model_config
        shared = self._head_target_parts()
        self._stage_tap = self._build_stage_tap()
        # Drafts are proposed where tokens are sampled and verified; the other ranks run the
        # verification step's rows from the scheduler's token ids, as with ngram.
        if draft_config is not None and self.is_sampling_rank:
            self._build_draft(draft_config, shared)
        elif self._uses_medusa and self.is_sampling_rank:  # heads without KV of their own
            assert shared is not None
            target = BuiltModel(self.model, self.kernels, self.attention_backend)
            self.proposer = self.builder.build_medusa(target, shared)
        self.compiled_decode = (
            builder.compile_decode(self.model, self.attention_backend, self.num_kv_groups)
            if self._compiles_decode()
            else None
        )
        tiers = self.config.kv_tier_config
        if tiers is not None and tiers.enabled:
            # Every rank moves its own bytes; disk reads are agreed on over all ranks.
            self.kv_tiers = KVTierWorker(tiers, self.kv_block_tensors(), get_world_group())
        host_tier = self.kv_tiers.host if self.kv_tiers is not None else []
        publish_kv_pool_ranges([*self.kv_block_tensors(), *host_tier])  # only where a soak asks
        # Only now: faulting the pool in beside the load slowed it (kv_prefault.py). The
        # first blocks are faulted in here, before the engine takes requests.
        self._prefaulter = self.builder.start_prefault(self, self.kv_block_tensors())

    def _compiles_decode(self) -> bool:
        """Whether decode steps get a compiled graph: compile=True asks for it, None leaves
        it to `eager_reason` (compiled where the graph is tested bit-equal to eager)."""
        if self.config.compile is None:
            why = eager_reason(self.config, self.attention_backend.traceable)
            if why is not None:
                logger.info("Decode steps run eagerly: %s", why)
            return why is None
        # Eager with several ranks: a compiled graph traces neither the collectives of
        # tensor parallelism nor a later pipeline stage's input from the previous stage.
        if not self.config.compile or self.config.parallel_config.world_size > 1:
            return False
        if self._stage_tap is not None:
            # The compiled graph would not hand the tapped layers' states over.
            logger.warning("compile: an EAGLE-3 head reads the target's layers; steps stay eager")
            return False
        return True

    def _head_target_parts(self) -> TargetParts | None:
        """The target's embedding and logits whole on the sampling rank, for a head (None
        elsewhere, or without one); every rank of the first and last stages takes part
        (sharded ones are joined from the ranks' rows, the embedding sent to the last)."""
        spec = self.config.speculative_config
        if spec is None or not spec.uses_head:
            return None
        return target_parts(self.model, self.kernels, needs_embedding=spec.method != "medusa")

    def _build_stage_tap(self) -> StageTap | None:
        """On each stage's first tensor-parallel rank, the tap on the layers of this stage
        an EAGLE-3 head reads (the others' are carried in from the stages before)."""
        spec, head = self.config.speculative_config, self.config.draft_model_config
        if spec is None or spec.method != "eagle3" or head is None or not self.is_first_tp_rank:
            return None
        num_layers = self.config.model_config.num_layers
        stage_tap = StageTap(
            aux_layers(head.hf_config, num_layers),
            self.layers,
            num_layers,
            self.is_last_stage,
            self.config.model_config.hf_config.hidden_size,
        )
        self.model.model.hidden_tap = stage_tap.tap  # None where this stage keeps no layer
        return stage_tap

    def _build_draft(self, draft_config, shared: TargetParts | None) -> None:
        """The draft model or EAGLE head with its KV pool."""
        num_blocks = self.kv_cache_pool[0][0].shape[0]
        spec = self.config.speculative_config
        assert spec is not None
        if not spec.uses_head:
            self.proposer, self.draft_kv_pool = self.builder.build_draft_model(
                draft_config, num_blocks, self.attention_backend
            )
            return
        assert shared is not None
        target = BuiltModel(self.model, self.kernels, self.attention_backend)
        self.proposer, self.draft_kv_pool = self.builder.build_head(
            draft_config, num_blocks, target, shared
        )

    @property
    def _uses_medusa(self) -> bool:
        spec = self.config.speculative_config
        return spec is not None and spec.method == "medusa"

    def _hand_target_states(self, req_ids, rows, num_scheduled, hidden_states) -> None:
        """The step's target hidden states to a proposer that reads them (an EAGLE head)."""
        proposer = self.proposer
        if proposer is None or proposer.target_states is None:
            return
        tap = self._stage_tap
        states = tap.take() if tap is not None else hidden_states
        first_positions = self.input_batch.num_computed_tokens[rows]
        proposer.observe_target(req_ids, first_positions, num_scheduled, states)

    # ---- observers and checks -----------------------------------------------------------
    def add_forward_observer(self, observer: ForwardObserver) -> None:
        """Call `observer` after each forward of this rank, inside the step (keep it quick)."""
        self._forward_observers.append(observer)

    def remove_forward_observer(self, observer: ForwardObserver) -> None:
        self._forward_observers.remove(observer)

    @contextmanager
    def forward_observer(self, observer: ForwardObserver) -> Iterator[None]:
        """`observer` sees the forwards run inside the `with` block."""
        self.add_forward_observer(observer)
        try:
            yield
        finally:
            self.remove_forward_observer(observer)

    def check_kv_integrity(self, expected: KVTableCheck) -> None:
        """Raise `KVIntegrityError` naming this rank unless its KV tensors and block tables
        agree with the scheduler's (debug mode; see kv_integrity.py)."""
        kv_integrity.check_kv_integrity(
            expected,
            self.input_batch,
            self.kv_caches,
            self.layers,
            self.builder.kv_cache_shape(expected.num_blocks),
            self.config.cache_config.cache_dtype,
            self.rank_name,
        )

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # The prefaulter faults the pool in ahead only between steps that run the model (an
        # empty step, while grammars compile, runs nothing it could hold up).
        prefaulter = self._prefaulter if scheduler_output.num_scheduled_tokens else None
        if prefaulter is not None:
            prefaulter.step_started()
        try:
            output = self._execute_model(scheduler_output)
        finally:
            if prefaulter is not None:
                prefaulter.step_finished()
        if self.kv_tiers is not None:
            if not scheduler_output.num_scheduled_tokens:  # nothing else to do: not a spin
                self.kv_tiers.wait_for_fetches(timeout_s=0.01)
            output.kv_transfer = self.kv_tiers.take_result()
        return output

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        failed: dict[str, str] = {}  # request id -> what raised for it alone
        self._update_states(scheduler_output, failed)
        if scheduler_output.kv_check is not None:  # debug mode only
            self.check_kv_integrity(scheduler_output.kv_check)
        kv_ops = scheduler_output.kv_transfer
        if self.kv_tiers is not None:  # before copies-on-write: saves read freed blocks
            self.kv_tiers.before_forward(kv_ops)
        self._copy_blocks(scheduler_output.blocks_to_copy)
        if not scheduler_output.num_scheduled_tokens:
            if self.kv_tiers is not None:
                self.kv_tiers.after_forward(kv_ops)
            return ModelRunnerOutput(failed_requests=failed)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        rows = np.array([self.input_batch.row(r) for r in req_ids], dtype=np.int64)
        num_scheduled = np.array(list(scheduler_output.num_scheduled_tokens.values()))
        if self.proposer is not None:
            self.proposer.begin_step(scheduler_output.speculating)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = np.array([len(drafts.get(r, ())) for r in req_ids], dtype=np.int64)
        input_ids, positions, metadata, logits_indices, sample_mask = self._prepare_inputs(
            rows, num_scheduled, num_drafts
        )
        uses_lora = self.lora_manager is not None and self.lora_manager.set_step(
            req_ids, num_scheduled
        )
        hidden_states = self._forward(input_ids, positions, metadata, num_scheduled, uses_lora)
        if self.kv_tiers is not None:  # the step's blocks are filled: persist and send them
            self.kv_tiers.after_forward(kv_ops)
        output = ModelRunnerOutput(failed_requests=failed)
        if not self.is_last_stage:
            self._send_to_next_stage(hidden_states)
            return output
        self._hand_target_states(req_ids, rows, num_scheduled, hidden_states)
        if self.pooler is not None:
            if self.is_sampling_rank:
                starts = self.input_batch.num_computed_tokens[rows].tolist()
                output.pooler_output = self.pooler.pool(
                    req_ids, starts, num_scheduled.tolist(), hidden_states
                )
            return output
        prompt_logprobs(
            output,
            self.input_batch,
            self.model.compute_logits,
            req_ids,
            rows,
            num_scheduled,
            hidden_states,
        )
        if len(logits_indices):
            logits = self.model.compute_logits(hidden_states[logits_indices])
            if not self.is_sampling_rank:  # its tensor-parallel peers gathered its shard
                return output
            sample_req_ids = [r for r, due in zip(req_ids, sample_mask, strict=True) if due]
            SamplingStage(
                self._sampling_tools(),
                scheduler_output,
                output,
                logits,
                rows[sample_mask],
                sample_req_ids,
                num_drafts[sample_mask],
            ).run()
        if self.proposer is not None and self.is_sampling_rank:
            # Every step, a step of prompt chunks alone included: a head reads the step's
            # target states now (eagle_proposer.py), so none are held past it.
            output.draft_token_ids = self.proposer.propose(
                list(output.sampled_token_ids), self.input_batch
            )
        return output

    def _sampling_tools(self) -> SamplingTools:
        # Read anew each step: benchmarks and tests may wrap the sampler after start-up.
        return SamplingTools(
            self.input_batch,
            self.sampler,
            self.proposer,
            self.kernels,
            self.vocab_size,
            self.device,
            self._faulty,
        )

    def _forward(self, input_ids, positions, metadata, num_scheduled, uses_lora):
        """`_run_model`, timed and shown to the observers when there are any."""
        if not self._forward_observers:
            return self._run_model(input_ids, positions, metadata, num_scheduled, uses_lora)
        started = time.perf_counter()
        hidden_states = self._run_model(input_ids, positions, metadata, num_scheduled, uses_lora)
        step = ForwardStep(
            input_ids,
            positions,
            metadata,
            int(num_scheduled.sum()),
            time.perf_counter() - started,
        )
        for observer in list(self._forward_observers):
            observer(step)
        return hidden_states

    def _update_states(self, scheduler_output: SchedulerOutput, failed: dict[str, str]) -> None:
        batch = self.input_batch
        for request_id in scheduler_output.finished_req_ids:
            batch.remove_request(request_id)
            self._faulty.discard(request_id)
            if self.proposer is not None:
                self.proposer.remove_request(request_id)
            if self.lora_manager is not None:
                self.lora_manager.remove_request(request_id)
            if self.pooler is not None:
                self.pooler.remove_request(request_id)
        for new in scheduler_output.scheduled_new_reqs:
            row = self._add_request(new, failed)
            if self.pooler is not None:
                self.pooler.add_request(
                    new.request_id, new.pooling_params, len(new.prompt_token_ids)
                )
            batch.set_blocks(row, new.block_ids, replace=True)
            batch.num_computed_tokens[row] = new.num_computed_tokens
            if self.proposer is not None:
                self.proposer.add_request(new.request_id, new.prompt_token_ids)
        for cached in scheduler_output.scheduled_cached_reqs:
            row = batch.row(cached.request_id)
            batch.set_blocks(row, cached.new_block_ids, replace=cached.resumed_from_preemption)
            batch.num_computed_tokens[row] = cached.num_computed_tokens
            if self.proposer is not None and cached.resumed_from_preemption:
                kept = 0 if cached.preempted else int(batch.num_blocks[row]) * self.block_size
                self.proposer.truncate(cached.request_id, kept)
            if cached.token_ids is not None and not self.is_sampling_rank:
                batch.write_tokens(
                    row,
                    cached.num_computed_tokens,
                    cached.token_ids,
                    cached.resumed_from_preemption,
                )
        # Drafts sit after a request's tokens without counting among them.
        for request_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            row = batch.row(request_id)
            start = int(batch.num_tokens[row])
            batch.token_ids[row, start : start + len(drafts)] = drafts

    def _add_request(self, new, failed: dict[str, str]) -> int:
        """The request's row; if its own parameters raise (e.g. a seed its generator refuses,
        a forked sample's included), an inert row that runs the forward but never samples."""
        batch = self.input_batch
        try:
            row = batch.add_request(
                new.request_id,
                new.prompt_token_ids,
                new.sampling_params,
                self.vocab_size,
                new.eos_token_ids,
                new.bad_words_token_ids,
            )
        except Exception as error:
            logger.exception("Request %s: adding it to the batch failed", new.request_id)
            failed[new.request_id] = f"adding the request failed: {describe_error(error)}"
            batch.remove_request(new.request_id)
            return batch.add_request(
                new.request_id, new.prompt_token_ids, _INERT_PARAMS, self.vocab_size
            )
        if self._fault_seed is not None and new.sampling_params.seed == self._fault_seed:
            self._faulty.add(new.request_id)
        if new.lora_request is not None:
            self._add_lora(new, failed)
        return row

    def _add_lora(self, new, failed: dict[str, str]) -> None:
        """The request's adapter, read now if it is not loaded; one that cannot be read
        fails this request alone (it runs on the base model until it ends)."""
        try:
            if self.lora_manager is None:
                raise ValueError("this engine was started without enable_lora")
            self.lora_manager.add_request(new.request_id, new.lora_request)
        except Exception as error:
            logger.exception("Request %s: loading its LoRA adapter failed", new.request_id)
            failed[new.request_id] = f"loading the LoRA adapter failed: {describe_error(error)}"

    def _prepare_inputs(self, rows: np.ndarray, num_scheduled: np.ndarray, num_drafts):
        batch = self.input_batch
        num_computed = batch.num_computed_tokens[rows]
        query_start_loc = np.concatenate(([0], np.cumsum(num_scheduled)))
        token_req = np.repeat(np.arange(len(rows)), num_scheduled)
        positions = (
            num_computed[token_req] + np.arange(query_start_loc[-1]) - query_start_loc[token_req]
        )
        token_rows = rows[token_req]
        input_ids = batch.token_ids[token_rows, positions]
        seq_lens = num_computed + num_scheduled
        sample_mask = seq_lens >= batch.num_tokens[rows]
        num_blocks = cdiv(int(seq_lens.max()), self.block_size)
        metadata = []
        for group in range(self.num_kv_groups):
            table = batch.block_table[:, group :: self.num_kv_groups]
            layout = AttentionLayout(
                slot_mapping=table[token_rows, positions // self.block_size] * self.block_size
                + positions % self.block_size,
                block_tables=table[rows, :num_blocks],
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
            )
            # The backend builds only the metadata its forward reads.
            metadata.append(self.attention_backend.build_metadata(layout, self.device))
        metadata = metadata[0] if self.num_kv_groups == 1 else tuple(metadata)
        # A sampling row's logits: its last token's, and each draft's after it.
        ends = query_start_loc[1:][sample_mask]
        counts = 1 + num_drafts[sample_mask]
        logits_indices = self._tensor(
            np.repeat(ends - counts, counts)
            + np.arange(counts.sum())
            - np.repeat(np.cumsum(counts) - counts, counts)
        )
        return (
            self._tensor(input_ids),
            self._tensor(positions),
            metadata,
            logits_indices,
            sample_mask,
        )

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: a request gets its own copy of a shared block before writing it."""
        if not copies:
            return
        sources = self._tensor(np.array([source for source, _ in copies]))
        destinations = self._tensor(np.array([destination for _, destination in copies]))
        for entry in self.kv_cache_pool + self.draft_kv_pool:
            for tensor in entry:  # K and V, and a quantized cache's scales
                tensor[destinations] = tensor[sources]

    def _run_model(self, input_ids, positions, metadata, num_scheduled, uses_lora=False):
        """The stage's forward: hidden states on the last stage, else (hidden, residual).
        A step that runs LoRA adapters stays eager (the compiled graph has no LoRA)."""
        if not self.is_first_stage:
            return self.model(
                input_ids,
                positions,
                metadata,
                intermediate_tensors=self._recv_from_prev_stage(len(input_ids)),
            )
        compiled = self.compiled_decode
        if compiled is not None and not uses_lora and compiled.applies(num_scheduled):
            return self.compiled_decode(input_ids, positions, metadata)
        return self.model(input_ids, positions, metadata)

    def _recv_from_prev_stage(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        model_config = self.config.model_config
        shape = (num_tokens, model_config.hf_config.hidden_size)
        hidden = self.pp_group.recv(shape, model_config.dtype)
        residual = self.pp_group.recv(shape, model_config.dtype)
        if self._stage_tap is not None:  # the tapped layers of the stages before, after them
            self._stage_tap.receive(self.pp_group, num_tokens, model_config.dtype)
        return hidden, residual

    def _send_to_next_stage(self, intermediate: tuple[torch.Tensor, torch.Tensor]) -> None:
        hidden, residual = intermediate
        self.pp_group.send(hidden)
        self.pp_group.send(residual)
        if self._stage_tap is not None:
            self._stage_tap.send(self.pp_group)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
