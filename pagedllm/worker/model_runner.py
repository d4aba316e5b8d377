"""`ModelRunner`: owns the model and the paged KV cache; turns a `SchedulerOutput` into tokens.

All scheduled tokens of a step run as one flattened batch (no padding to the longest);
the layout (token ids, positions, slot mapping, block tables) is built with numpy from
the persistent `InputBatch`, and logits are computed only for rows that sample.

Fault isolation: the per-request stages (adding a request's row, its logits processors, its
grammar bitmask) run batched; when one raises, each row is tried alone, the requests at fault
are reported in `ModelRunnerOutput.failed_requests` and dropped from sampling, and the other
rows sample exactly what they would have. An error no single request reproduces raises.
For tests, `PAGEDLLM_INJECT_FAULT_SEED=<seed>` makes requests with that seed raise in their
logits-processor stage (a stand-in for a request-attributable bug; unset in production).

Debug mode (`PAGEDLLM_DEBUG=1`): the step's `SchedulerOutput.kv_check` carries the scheduler's
block table of every running request; once the step's updates are applied, before the
forward, every rank checks its KV tensors' shape and its own tables against it
(`check_kv_integrity`) and raises `KVIntegrityError` naming itself on any difference.

Several ranks (`distributed/parallel_state.py` groups): each rank's KV pool holds its own
KV heads (tensor parallel) for its stage's layers (pipeline parallel). Only the sampling
rank (the first tensor-parallel rank of the last stage) holds the sampled tokens; the others
write the tokens each running request runs (`CachedRequestData.token_ids`) into their
batch before laying it out. A stage after the first receives the previous stage's
(hidden, residual) instead of embedding token ids, a stage before the last sends its own
on; the last stage's ranks compute logits together (only the sampling rank gets them) and
only the sampling rank samples.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import weakref

import numpy as np
import torch

from pagedllm.config import EngineConfig, ModelConfig, kv_cache_groups
from pagedllm.core.scheduler_output import KVTableCheck, ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import get_pp_group, get_tp_group
from pagedllm.errors import describe_error
from pagedllm.kv_transfer.tier_worker import KVTierWorker
from pagedllm.lora.model_manager import LoRAModelManager
from pagedllm.model.gguf_loader import release_gguf_readers
from pagedllm.model.layers.gguf_swap import keep_gguf_blocks
from pagedllm.model.layers.onednn import pack_linear_weights
from pagedllm.model.layers.quantization import quantize_model
from pagedllm.model.loader import ModelSource, load_weights
from pagedllm.model.registry import resolve_model_class
from pagedllm.ops.attention import AttentionLayout
from pagedllm.ops.attention_registry import get_attention_backend
from pagedllm.ops.kernel_selection import select_kernels
from pagedllm.ops.kv_quant import KVCache, kv_cache_entry, kv_cache_layout
from pagedllm.parallel_config import num_kv_heads_per_rank, pipeline_stage_layers
from pagedllm.sample.grammar_bitmask import apply_bitmask
from pagedllm.sample.logits_processors import apply_logits_processors
from pagedllm.sample.logprobs import token_logprobs
from pagedllm.sample.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.draft_model import DraftModelDrafts
from pagedllm.spec_decode.proposer import build_proposer
from pagedllm.spec_decode.rejection_sampler import rejection_sample
from pagedllm.utils import cdiv
from pagedllm.worker.compiled_forward import CompiledDecode, compiled_batch_limit
from pagedllm.worker.huge_pages import place_weights_on_huge_pages, release_free_heap
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.kv_prefault import KVCachePrefaulter, prefault_enabled
from pagedllm.worker.pooler import Pooler

logger = logging.getLogger(__name__)

FAULT_SEED_ENV = "PAGEDLLM_INJECT_FAULT_SEED"
# Problems a failed KV integrity check lists before it says how many more there are.
MAX_REPORTED_PROBLEMS = 5
# A request whose own parameters could not be loaded still gets a row (the forward must
# write its prompt's KV, which the prefix cache may already share), with these: it never samples.
_INERT_PARAMS = SamplingParams()


class KVIntegrityError(AssertionError):
    """A rank's KV state disagrees with the scheduler's (debug mode): a bug, never a
    request's fault, so it ends the engine. The message names the rank."""


def _injected_fault_seed() -> int | None:
    value = os.environ.get(FAULT_SEED_ENV, "")
    return int(value) if value else None


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
        self.is_sampling_rank = tp_group.is_first_rank and self.pp_group.is_last_rank
        self.is_first_stage = self.pp_group.is_first_rank
        self.is_last_stage = self.pp_group.is_last_rank
        self.layers = pipeline_stage_layers(
            model_config.num_layers, self.pp_group.world_size, self.pp_group.rank_in_group
        )
        self._prefaulter: KVCachePrefaulter | None = None
        self._fault_seed = _injected_fault_seed()
        self._faulty: set[str] = set()  # requests the injected fault hits
        # Speculative decoding: what proposes each request's next tokens (None: off).
        self.proposer = build_proposer(config.speculative_config)
        # LoRA: the adapters and the model's LoRA layers (None: enable_lora is off).
        self.lora_manager: LoRAModelManager | None = None
        # KV tiers: host memory, disk, a peer instance (None: off).
        self.kv_tiers: KVTierWorker | None = None
        # runner="pooling": prompts become vectors, nothing is sampled (None: generate).
        self.pooler = Pooler(config.pooler_config) if config.pooler_config is not None else None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged pool (K and V per layer) and start faulting its pages in."""
        self.kv_cache_pool = self._allocate_kv_cache(num_blocks)
        slots = self.kv_groups.layer_slots(self.layers)
        self.kv_caches = [self.kv_cache_pool[slot] for _, slot in slots.values()]
        self._prefaulter = self._start_prefault()

    def kv_block_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the main pool, block id on dim 0: a block is row b of each."""
        return [tensor for pair in self.kv_cache_pool for tensor in pair]

    def load_model(self, source: ModelSource) -> None:
        """Load the weights, bind the KV cache, and compile the decode step when asked."""
        self.model = self._load_model(source)
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
        if self.config.draft_model_config is not None:
            self.proposer = self._load_draft_model(self.config.draft_model_config)
        # Eager with several ranks: a compiled graph traces neither the collectives of
        # tensor parallelism nor a later pipeline stage's input from the previous stage.
        compile_decode = self.config.compile and self.config.parallel_config.world_size == 1
        self.compiled_decode = self._compile_decode() if compile_decode else None
        tiers = self.config.kv_tier_config
        if tiers is not None and tiers.enabled:
            self.kv_tiers = KVTierWorker(tiers, self.kv_block_tensors())

    def _load_draft_model(self, draft_config: ModelConfig) -> DraftModelDrafts:
        """The speculative draft model, with a KV pool of the same blocks as the target's."""
        source = ModelSource(draft_config.model, draft_config.model.endswith(".gguf"))
        model, _, attention_backend = self._build_model(source, draft_config)
        num_blocks = self.kv_cache_pool[0][0].shape[0]
        shape = (num_blocks, self.block_size, draft_config.num_kv_heads, draft_config.head_dim)
        dtype = self.config.cache_config.cache_dtype
        self.draft_kv_pool = [
            kv_cache_entry(shape, dtype, self._zeros) for _ in range(draft_config.num_layers)
        ]
        model.bind_kv_cache(self.draft_kv_pool)
        assert self.config.speculative_config is not None
        compiled = self._compile_decode(model, num_kv_groups=1) if self.config.compile else None
        return DraftModelDrafts(
            self.config.speculative_config,
            model,
            attention_backend,
            self.block_size,
            self.config.model_config.max_model_len,
            self.device,
            compiled,
        )

    def _compile_decode(
        self, model: torch.nn.Module | None = None, num_kv_groups: int | None = None
    ) -> CompiledDecode | None:
        """The decode step of `model` (the target's by default; a draft model's chained
        steps) through torch.compile, or None where it cannot be compiled."""
        model = model or self.model
        if not self.attention_backend.traceable:
            # The torch backend reads the step's layout from Python lists, on which a
            # compiled graph would specialize and recompile step after step.
            logger.warning(
                "compile needs attention_backend='cpu' on the CPU; decode steps stay eager"
            )
            return None
        compiled = CompiledDecode(
            model, compiled_batch_limit(model), num_kv_groups or self.num_kv_groups
        )
        try:
            with torch.inference_mode():
                compiled.warm_up(self.device)
        except Exception as error:  # compiling is an optimization: never fail the start
            # e.g. int8's fbgemm weights are script objects the tracer cannot follow
            logger.warning("compile failed (%s); decode steps stay eager", _first_line(error))
            return None
        return compiled

    def _load_model(self, source: ModelSource) -> torch.nn.Module:
        model, self.kernels, self.attention_backend = self._build_model(
            source, self.config.model_config
        )
        return model

    def _build_model(self, source: ModelSource, model_config: ModelConfig):
        """(model with its weights, its kernel selection, its attention backend): the target,
        or a speculative draft model, each with its own config."""
        model_class = resolve_model_class(model_config.hf_config.architectures)
        # The one decision of which kernels run; the model's layers and the sampler keep it.
        kernels = select_kernels(
            self.device,
            model_config.dtype,
            self.config.attention_backend,
            head_dim=model_config.head_dim,
            cache_dtype=self.config.cache_config.cache_dtype,
        )
        logger.debug("kernels: %s", kernels.describe())
        attention_backend = get_attention_backend(kernels.attention)
        with torch.device(self.device):
            model = model_class(
                model_config.hf_config,
                attention_backend,
                model_config.dtype,
                model_config.max_model_len,
                kernels=kernels,
            )
        quantization = model_config.quantization
        # gguf: layers on the file's blocks before any weight is read (see gguf_swap).
        on_blocks = (
            keep_gguf_blocks(model, source.path, model_config.gguf_activation_bits)
            if quantization == "gguf"
            else set()
        )
        load_weights(
            model,
            source,
            model_config.hf_config,
            model_config.load_format,
            seed=model_config.seed,
            # Tensor-parallel ranks read only their shard of each safetensors tensor.
            lazy=self.config.parallel_config.tensor_parallel_size > 1,
            skip=frozenset(on_blocks),
        )
        if source.is_gguf:
            release_gguf_readers()
        if quantization == "int8":
            quantize_model(model, quantization)
        if self.device.type == "cpu":
            pack_linear_weights(model)
            place_weights_on_huge_pages(model)
            release_free_heap()  # what loading and the moves above freed, back to the OS
        return model.eval(), kernels, attention_backend

    def _allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        """(K, V) per tensor pair; an int8 / fp8 cache's entries also hold their scales:
        (K, V, K scale, V scale), see ops/kv_quant.py."""
        shape, dtype = self._kv_cache_shape(num_blocks), self.config.cache_config.cache_dtype
        return [
            kv_cache_entry(shape, dtype, self._zeros)
            for _ in range(self.kv_groups.num_tensor_pairs(self.layers))
        ]

    def _kv_cache_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """One layer's K (or V) pool on this rank: its KV heads (a share, or one replicated
        head when there are more ranks than KV heads). The pool holds one such pair per layer
        of this rank's pipeline stage."""
        model_config = self.config.model_config
        num_kv_heads = num_kv_heads_per_rank(model_config.num_kv_heads, self.tp_size)
        return (num_blocks, self.block_size, num_kv_heads, model_config.head_dim)

    def _start_prefault(self) -> KVCachePrefaulter | None:
        if self.device.type != "cpu" or not prefault_enabled():
            return None
        prefaulter = KVCachePrefaulter(self.kv_block_tensors()).start()
        # Stop with the runner, so a dropped engine's pool is not kept alive and faulted in.
        weakref.finalize(self, prefaulter.stop)
        return prefaulter

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed, not empty: padded decode batches read slots past each sequence's end, and
        masked-out garbage that happens to be NaN would still poison 0 * NaN in softmax @ V.

        On the CPU the zeros come from calloc (numpy), whose pages the OS maps lazily, so a
        4 GiB cache costs no start-up time. A page not yet touched is faulted in by the first
        write to its block, inside a step (5-8% of a 2,048-token prefill step); on this VM
        that is the host's first touch of guest memory, ~0.5 GB/s on small and huge pages
        alike, so touching the whole pool up front would take ~9 s. Instead
        `KVCachePrefaulter` faults the pool in on idle CPU time from here on (while the
        model loads, and while the engine waits for work), in the order blocks are handed
        out; the pool becomes resident as it goes.

        numpy advises MADV_HUGEPAGE for arrays this large (NUMPY_MADVISE_HUGEPAGE=0 turns
        that off), so where transparent huge pages are "madvise" the pool is faulted in as
        huge pages. Nothing here depends on it: on small pages the steady-state decode step
        at 256 sequences measured the same (docs/performance.md, "What bounds decode
        attention").
        """
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        num_bytes = math.prod(shape) * dtype.itemsize
        return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self._execute_model(scheduler_output)
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
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = np.array([len(drafts.get(r, ())) for r in req_ids], dtype=np.int64)
        input_ids, positions, metadata, logits_indices, sample_mask = self._prepare_inputs(
            rows, num_scheduled, num_drafts
        )
        uses_lora = self.lora_manager is not None and self.lora_manager.set_step(
            req_ids, num_scheduled
        )
        hidden_states = self._run_model(input_ids, positions, metadata, num_scheduled, uses_lora)
        if self.kv_tiers is not None:  # the step's blocks are filled: persist and send them
            self.kv_tiers.after_forward(kv_ops)
        output = ModelRunnerOutput(failed_requests=failed)
        if not self.is_last_stage:
            self._send_to_next_stage(hidden_states)
            return output
        if self.pooler is not None:
            if self.is_sampling_rank:
                starts = self.input_batch.num_computed_tokens[rows].tolist()
                output.pooler_output = self.pooler.pool(
                    req_ids, starts, num_scheduled.tolist(), hidden_states
                )
            return output
        self._prompt_logprobs(output, req_ids, rows, num_scheduled, hidden_states)
        if not len(logits_indices):
            return output
        logits = self.model.compute_logits(hidden_states[logits_indices])
        if not self.is_sampling_rank:  # its tensor-parallel peers gathered its shard
            return output
        sample_rows = rows[sample_mask]
        sample_req_ids = [r for r, due in zip(req_ids, sample_mask, strict=True) if due]
        if drafts:
            self._verify_drafts(
                output,
                scheduler_output,
                logits,
                sample_rows,
                sample_req_ids,
                num_drafts[sample_mask],
            )
        else:
            self._sample(output, scheduler_output, logits, sample_rows, sample_req_ids)
        if self.proposer is not None:
            output.draft_token_ids = self.proposer.propose(
                list(output.sampled_token_ids), self.input_batch
            )
        return output

    def _sample(self, output, scheduler_output, logits, sample_rows, sample_req_ids) -> None:
        """One token for each row that is due one (the step verifies no drafts)."""
        if scheduler_output.forked_samples:
            logits, sample_rows = self._add_forked_samples(
                scheduler_output.forked_samples, logits, sample_rows, sample_req_ids
            )
        logits, sample_rows, sample_req_ids, processed = self._process_logits(
            scheduler_output, logits, sample_rows, sample_req_ids, output.failed_requests
        )
        if not sample_req_ids:
            return
        wants_logprobs = bool((self.input_batch.num_logprobs[sample_rows] >= 0).any())
        sampled = self.sampler(
            processed,
            self._sampling_metadata(sample_rows),
            raw_logits=logits,
            compute_logprobs=wants_logprobs,
        )
        token_ids = sampled.token_ids.cpu().numpy()
        self.input_batch.append_tokens(sample_rows, token_ids)
        output.sampled_token_ids = {
            request_id: [token_id]
            for request_id, token_id in zip(sample_req_ids, token_ids.tolist(), strict=True)
        }
        if wants_logprobs:
            asking = self.input_batch.num_logprobs[sample_rows] >= 0
            output.logprobs = {
                request_id: [logprob]
                for request_id, logprob, ask in zip(
                    sample_req_ids, sampled.logprobs.tolist(), asking, strict=True
                )
                if ask
            }
            self._sample_logprobs(output, sample_req_ids, sample_rows, logits, sampled.token_ids)

    def _verify_drafts(
        self, output, scheduler_output, logits, sample_rows, sample_req_ids, num_drafts
    ) -> None:
        """Speculative decoding: each sampling row has 1 + its drafts' rows of logits (the
        target's scores after its last token and after each draft). The rejection sampler
        emits the accepted drafts and one token after them, distributed exactly as sampling
        one token at a time would be (greedy: the same tokens)."""
        if scheduler_output.forked_samples:
            # A parent has no drafts (its prompt ends this step): its row is its first.
            num_parents = len(sample_req_ids)
            logits, sample_rows = self._add_forked_samples(
                scheduler_output.forked_samples,
                logits,
                sample_rows,
                sample_req_ids,
                first_rows=np.cumsum(1 + num_drafts) - (1 + num_drafts),
            )
            num_drafts = np.concatenate(
                [num_drafts, np.zeros(len(sample_req_ids) - num_parents, dtype=np.int64)]
            )
        drafts = scheduler_output.scheduled_spec_decode_tokens
        request_drafts = [drafts.get(r, []) for r in sample_req_ids]
        counts = 1 + num_drafts
        processed, keep = self._process_draft_logits(
            scheduler_output, logits, sample_rows, sample_req_ids, request_drafts, counts, output
        )
        if not keep:
            return
        index = self._tensor(_expanded_index(counts, keep))
        logits, processed = logits[index], processed[index]
        rows = sample_rows[keep]
        req_ids = [sample_req_ids[i] for i in keep]
        request_drafts = [request_drafts[i] for i in keep]
        emitted = rejection_sample(
            processed,
            request_drafts,
            self.proposer.draft_probs(req_ids, request_drafts)
            if self.proposer
            else [None] * len(req_ids),
            self._sampling_metadata(rows),
            self.kernels,
        )
        for row, tokens in zip(rows.tolist(), emitted, strict=True):
            for token_id in tokens:  # one at a time: each moves the row's end
                self.input_batch.append_tokens(np.array([row]), np.array([token_id]))
        output.sampled_token_ids = dict(zip(req_ids, emitted, strict=True))
        self._spec_logprobs(output, req_ids, rows, logits, counts[keep], emitted)

    def _process_draft_logits(
        self, scheduler_output, logits, rows, req_ids, request_drafts, counts, output
    ) -> tuple[torch.Tensor, list[int]]:
        """The per-request stages on every verified position (as `_process_logits` does for
        one): returns the processed logits and the indices of the requests that go on to
        sampling. A request whose stage raises alone is recorded in `failed_requests`."""
        failed = output.failed_requests
        keep = [i for i, request_id in enumerate(req_ids) if request_id not in failed]
        try:
            stages = self._draft_stages(scheduler_output, logits, rows, req_ids, request_drafts)
            return stages, keep
        except Exception as error:
            batch_error = error
        processed = logits.to(torch.float32).clone()
        starts = np.cumsum(counts) - counts
        healthy = []
        for i in keep:
            block = slice(int(starts[i]), int(starts[i] + counts[i]))
            try:
                processed[block] = self._draft_stages(
                    scheduler_output,
                    logits[block],
                    rows[i : i + 1],
                    [req_ids[i]],
                    [request_drafts[i]],
                )
                healthy.append(i)
            except Exception as error:
                logger.exception("Request %s: its logits processing failed", req_ids[i])
                failed[req_ids[i]] = f"logits processing failed: {describe_error(error)}"
        if len(healthy) == len(keep):  # no request reproduces the error alone
            raise batch_error
        return processed, healthy

    def _draft_stages(self, scheduler_output, logits, rows, req_ids, request_drafts):
        """Logits processors and the grammar bitmask at each position of each request: the
        state at position i has the first i drafts appended (penalties, min_tokens)."""
        if self._faulty and not self._faulty.isdisjoint(req_ids):
            raise RuntimeError(f"injected fault ({FAULT_SEED_ENV})")
        states = self.input_batch.logits_states
        position_states = []
        for row, drafts in zip(rows.tolist(), request_drafts, strict=True):
            position_states.extend(_states_after_drafts(states.get(row), drafts))
        processed = logits
        if any(state is not None and state.needs_processing() for state in position_states):
            processed = apply_logits_processors(logits.to(torch.float32).clone(), position_states)
        bitmask = scheduler_output.grammar_bitmask
        if bitmask is None:
            return processed
        logits_rows, mask_rows, start = [], [], 0
        parent_of = _parents(scheduler_output.forked_samples)
        for request_id, drafts in zip(req_ids, request_drafts, strict=True):
            first = scheduler_output.grammar_rows.get(parent_of.get(request_id, request_id))
            if first is not None:
                logits_rows.extend(range(start, start + len(drafts) + 1))
                mask_rows.extend(range(first, first + len(drafts) + 1))
            start += len(drafts) + 1
        return _mask_rows(processed, logits, bitmask, logits_rows, mask_rows)

    def _spec_logprobs(self, output, req_ids, rows, logits, counts, emitted) -> None:
        """Logprobs of the emitted tokens from the target's raw logits at their positions."""
        wanted = self.input_batch.num_logprobs[rows]
        if not (wanted >= 0).any():
            return
        starts = np.cumsum(counts) - counts
        for i in np.flatnonzero(wanted >= 0).tolist():
            tokens = emitted[i]
            block = logits[int(starts[i]) : int(starts[i]) + len(tokens)]
            result = token_logprobs(block, self._tensor(np.array(tokens)), int(wanted[i]))
            request_id = req_ids[i]
            output.logprobs[request_id] = result.logprobs.tolist()
            output.sample_logprobs[request_id] = [
                result.row(j, int(wanted[i])) for j in range(len(tokens))
            ]

    def check_kv_integrity(self, expected: KVTableCheck) -> None:
        """Raise `KVIntegrityError` naming this rank unless its KV tensors have the shape its
        heads and stage imply, and its block table of every running request equals the
        scheduler's, with no block the null block or outside the pool."""
        problems = self._kv_shape_problems(expected.num_blocks)
        batch = self.input_batch
        for request_id, want in expected.block_tables.items():
            row = batch.req_id_to_row.get(request_id)
            if row is None:
                problems.append(f"no row for running request {request_id!r}")
                continue
            got = batch.block_table[row, : batch.num_blocks[row]].tolist()
            # A block a window has freed is the null block in the scheduler's table; the
            # runner keeps the old id there, which no kernel reads.
            null = expected.null_block_id
            got = [w if w == null else g for g, w in zip(got, want, strict=False)] + got[
                len(want) :
            ]
            if got != want:
                problems.append(
                    f"request {request_id!r}: block table {got} != the scheduler's {want}"
                )
            wrong = [
                b
                for b, w in zip(got, want, strict=False)
                if (b == null and w != null) or not 0 <= b < expected.num_blocks
            ]
            if wrong:
                problems.append(
                    f"request {request_id!r}: block(s) {wrong} are the null block "
                    f"({expected.null_block_id}) or outside the pool of {expected.num_blocks}"
                )
        if problems:
            more = len(problems) - MAX_REPORTED_PROBLEMS
            raise KVIntegrityError(
                f"KV integrity check failed on {self.rank_name}: "
                + "; ".join(problems[:MAX_REPORTED_PROBLEMS])
                + (f"; and {more} more" if more > 0 else "")
            )

    def _kv_shape_problems(self, num_blocks: int) -> list[str]:
        shape, dtype = self._kv_cache_shape(num_blocks), self.config.cache_config.cache_dtype
        if len(self.kv_caches) != len(self.layers):
            return [
                f"{len(self.kv_caches)} layers of KV cache for the {len(self.layers)} "
                f"layers of its stage ({self.layers.start}-{self.layers.stop - 1})"
            ]
        # What each entry holds: K and V, and a quantized cache's scales.
        names = ("K", "V", "K scale", "V scale")
        expected = list(zip(names, kv_cache_layout(shape, dtype), strict=False))
        problems = []
        for layer, entry in zip(self.layers, self.kv_caches, strict=True):
            if len(entry) != len(expected):
                problems.append(f"layer {layer} has {len(entry)} KV tensors, not {len(expected)}")
                continue
            for (name, (want_shape, want_dtype)), tensor in zip(expected, entry, strict=True):
                if tuple(tensor.shape) != want_shape or tensor.dtype != want_dtype:
                    problems.append(
                        f"layer {layer}'s {name} cache is {tuple(tensor.shape)} {tensor.dtype}, "
                        f"not {want_shape} {want_dtype}"
                    )
        return problems

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
        return hidden, residual

    def _send_to_next_stage(self, intermediate: tuple[torch.Tensor, torch.Tensor]) -> None:
        hidden, residual = intermediate
        self.pp_group.send(hidden)
        self.pp_group.send(residual)

    def _add_forked_samples(
        self, forked_samples, logits, sample_rows, sample_req_ids, first_rows=None
    ):
        """Parallel sampling: the samples the scheduler forked this step draw their first token
        from their parent's logits row, each in a row of its own (own seed, own penalties),
        appended after the others. Extends `sample_req_ids` in place; returns the widened
        logits and rows. `first_rows[i]`: request i's logits row, where rows are not one a
        request (drafts being verified)."""
        batch = self.input_batch
        parent_index, child_rows = [], []
        for index, request_id in enumerate(list(sample_req_ids)):
            for child_id in forked_samples.get(request_id, ()):
                parent_index.append(index if first_rows is None else int(first_rows[index]))
                child_rows.append(batch.row(child_id))
                sample_req_ids.append(child_id)
        if not child_rows:
            return logits, sample_rows
        widened = torch.cat([logits, logits[self._tensor(np.array(parent_index))]])
        return widened, np.concatenate([sample_rows, np.array(child_rows, dtype=np.int64)])

    def _process_logits(self, scheduler_output, logits, rows, req_ids, failed):
        """The per-request stages (logits processors, then the grammar bitmask), batched.

        When the batched call raises, each row is tried alone; the requests whose row raises
        are recorded in `failed` and dropped, and the rest run batched again, so every other
        row gets exactly the logits it would have had (each stage works row by row). An error
        no single row reproduces is not any request's: it raises. Returns the raw logits,
        rows and request ids that go on to sampling, and their processed logits."""
        keep = [i for i, request_id in enumerate(req_ids) if request_id not in failed]
        if len(keep) < len(req_ids):  # rows that failed before this step's sampling
            logits, rows, req_ids = self._select_rows(keep, logits, rows, req_ids)
        if not req_ids:
            return logits, rows, req_ids, logits
        try:
            processed = self._per_request_stages(scheduler_output, logits, rows, req_ids)
            return logits, rows, req_ids, processed
        except Exception:
            faults = self._find_faulty_rows(scheduler_output, logits, rows, req_ids)
            if not faults:
                raise
        failed.update(faults)
        keep = [i for i, request_id in enumerate(req_ids) if request_id not in faults]
        logits, rows, req_ids = self._select_rows(keep, logits, rows, req_ids)
        if not req_ids:
            return logits, rows, req_ids, logits
        processed = self._per_request_stages(scheduler_output, logits, rows, req_ids)
        return logits, rows, req_ids, processed

    def _find_faulty_rows(self, scheduler_output, logits, rows, req_ids) -> dict[str, str]:
        faults = {}
        for i, request_id in enumerate(req_ids):
            try:
                self._per_request_stages(
                    scheduler_output, logits[i : i + 1], rows[i : i + 1], [request_id]
                )
            except Exception as error:
                logger.exception("Request %s: its logits processing failed", request_id)
                faults[request_id] = f"logits processing failed: {describe_error(error)}"
        return faults

    def _select_rows(self, keep: list[int], logits, rows, req_ids):
        index = self._tensor(np.array(keep, dtype=np.int64))
        return logits[index], rows[keep], [req_ids[i] for i in keep]

    def _per_request_stages(self, scheduler_output, logits, rows, req_ids) -> torch.Tensor:
        if self._faulty and not self._faulty.isdisjoint(req_ids):
            raise RuntimeError(f"injected fault ({FAULT_SEED_ENV})")
        processed = self._apply_logits_processors(logits, rows)
        return self._apply_grammar(scheduler_output, processed, logits, req_ids)

    def _apply_logits_processors(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """Penalties, biases and bans on a copy: logprobs are reported from the raw logits."""
        states = self.input_batch.logits_states
        if not states:
            return logits
        row_states = [states.get(row) for row in rows.tolist()]
        if not any(state is not None and state.needs_processing() for state in row_states):
            return logits
        return apply_logits_processors(logits.to(torch.float32).clone(), row_states)

    def _apply_grammar(self, scheduler_output, processed, raw_logits, sample_req_ids):
        """Structured output: forbid the tokens each constrained row's grammar does not allow
        (on a copy when no processor made one: logprobs are reported from the raw logits)."""
        bitmask = scheduler_output.grammar_bitmask
        if bitmask is None:
            return processed
        grammar_rows = scheduler_output.grammar_rows
        # A sample forked this step starts from its parent's grammar state.
        parent_of = _parents(scheduler_output.forked_samples)
        logits_rows, mask_rows = [], []
        for index, request_id in enumerate(sample_req_ids):
            row = grammar_rows.get(parent_of.get(request_id, request_id))
            if row is not None:
                logits_rows.append(index)
                mask_rows.append(row)
        return _mask_rows(processed, raw_logits, bitmask, logits_rows, mask_rows)

    def _sample_logprobs(self, output, req_ids, rows, logits, token_ids) -> None:
        """Rank and top alternatives of each sampled token, for the rows that asked."""
        wanted = self.input_batch.num_logprobs[rows]
        asking = np.flatnonzero(wanted >= 0)
        if not len(asking):
            return
        index = self._tensor(asking)
        result = token_logprobs(logits[index], token_ids[index], int(wanted[asking].max()))
        for i, row_index in enumerate(asking.tolist()):
            output.sample_logprobs[req_ids[row_index]] = [result.row(i, int(wanted[row_index]))]

    def _prompt_logprobs(self, output, req_ids, rows, num_scheduled, hidden_states) -> None:
        """Logprob of each prompt token this step saw the position before (rows that asked)."""
        batch = self.input_batch
        query_start = 0
        for request_id, row, count in zip(
            req_ids, rows.tolist(), num_scheduled.tolist(), strict=True
        ):
            num_top = int(batch.num_prompt_logprobs[row])
            start = int(batch.num_computed_tokens[row])
            # Position p's logits score prompt token p + 1; the last prompt position's
            # logits belong to the first sampled token instead.
            end = min(start + count, int(batch.num_prompt_tokens[row]) - 1)
            if num_top >= 0 and end > start:
                logits = self.model.compute_logits(
                    hidden_states[query_start : query_start + end - start]
                )
                if logits is None:  # a tensor-parallel peer of the sampling rank
                    query_start += count
                    continue
                targets = self._tensor(batch.token_ids[row, start + 1 : end + 1])
                result = token_logprobs(logits, targets, num_top)
                output.prompt_logprobs[request_id] = {
                    start + 1 + i: result.row(i, num_top) for i in range(end - start)
                }
            query_start += count

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: a request gets its own copy of a shared block before writing it."""
        if not copies:
            return
        sources = self._tensor(np.array([source for source, _ in copies]))
        destinations = self._tensor(np.array([destination for _, destination in copies]))
        for entry in self.kv_cache_pool + self.draft_kv_pool:
            for tensor in entry:  # K and V, and a quantized cache's scales
                tensor[destinations] = tensor[sources]

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

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        batch = self.input_batch
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
            top_k=self._tensor(top_k) if (top_k[random] < self.vocab_size).any() else None,
            top_p=self._tensor(top_p) if (top_p[random] < 1).any() else None,
            min_p=self._tensor(min_p) if (min_p[random] > 0).any() else None,
            generators=generators,
            all_greedy=not random.any(),
            all_random=bool(random.all()),
        )

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)


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


def _expanded_index(counts: np.ndarray, keep: list[int]) -> np.ndarray:
    """The logits rows of the kept requests, where request i owns `counts[i]` rows in order."""
    starts = np.cumsum(counts) - counts
    return np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in keep])


def _states_after_drafts(state, drafts: list[int]) -> list:
    """A request's logits-processor state at each verified position: as it is, then with
    each draft appended in turn (copies: the drafts are not the request's yet)."""
    states = [state]
    for token_id in drafts:
        if state is not None:
            state = copy.deepcopy(state)
            state.append_output_token(token_id)
        states.append(state)
    return states


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
