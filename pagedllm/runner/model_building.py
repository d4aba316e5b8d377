"""What a `ModelRunner` runs on, built once at start-up: the paged KV pool, the model with its
weights, kernels and attention backend, a speculative draft model (or EAGLE head) with a
pool of its own, and the decode step through torch.compile.

`ModelBuilder` owns the decisions of that build (which kernels, which layout, zeroed memory
and its prefaulting, when compiling is given up); the runner keeps what it returns.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import NamedTuple

import torch

from pagedllm.config import EngineConfig, KVCacheGroups, ModelConfig
from pagedllm.distributed.parallel_state import get_tp_group, single_rank_groups
from pagedllm.model.gguf_loader import release_gguf_readers
from pagedllm.model.layers.awq_swap import keep_awq_weights
from pagedllm.model.layers.ct_pack_swap import keep_pack_quantized_weights
from pagedllm.model.layers.gguf_swap import keep_gguf_blocks
from pagedllm.model.layers.gptq_swap import keep_gptq_weights
from pagedllm.model.layers.onednn import pack_linear_weights
from pagedllm.model.layers.packed_dummy import keep_dummy_packed_weights
from pagedllm.model.layers.quantization import quantize_model
from pagedllm.model.layers.stored_vocab import (
    keep_vocab_in_stored_dtype,
    stored_vocab_dtype,
    stored_vocab_enabled,
)
from pagedllm.model.layers.w8a8_dummy import keep_dummy_w8a8_weights
from pagedllm.model.layers.w8a8_swap import checkpoint_scheme, keep_w8a8_weights
from pagedllm.model.loader import ModelSource, load_weights, resolve_model
from pagedllm.model.quantization.compressed_tensors import is_pack_quantized
from pagedllm.model.quantization.registry import quantization_config
from pagedllm.model.registry import resolve_model_class
from pagedllm.ops.attention_registry import get_attention_backend
from pagedllm.ops.kernel_selection import KernelSelection, select_kernels
from pagedllm.ops.kv_quant import KVCache, kv_cache_entry
from pagedllm.parallel_config import num_kv_heads_per_rank
from pagedllm.runner.compiled_forward import CompiledDecode, compiled_batch_limit
from pagedllm.runner.huge_pages import (
    mapped_zeros,
    place_weights_on_huge_pages,
    release_free_heap,
    reuse_activation_pages,
)
from pagedllm.runner.kv_prefault import KVCachePrefaulter, prefault_enabled
from pagedllm.spec_decode.medusa_config import read_medusa_config
from pagedllm.spec_decode.runner import eagle_loading, medusa_loading
from pagedllm.spec_decode.runner.draft_model import DraftModelDrafts
from pagedllm.spec_decode.runner.eagle_head import TargetParts
from pagedllm.spec_decode.runner.eagle_proposer import EagleDrafts
from pagedllm.spec_decode.runner.medusa_proposer import MedusaDrafts

logger = logging.getLogger(__name__)


def keep_compressed_tensors_weights(
    model: torch.nn.Module, directory: str, config: dict
) -> set[str]:
    """pack-quantized checkpoints on the packed layers, the 8-bit formats on W8A8 / FP8."""
    if is_pack_quantized(config):
        return keep_pack_quantized_weights(model, directory, config)
    return keep_w8a8_weights(model, directory, checkpoint_scheme("compressed-tensors", config))


def keep_fp8_weights(model: torch.nn.Module, directory: str, config: dict) -> set[str]:
    return keep_w8a8_weights(model, directory, checkpoint_scheme("fp8", config))


def keep_dummy_weights(model: torch.nn.Module, method: str, config: dict, seed: int) -> set[str]:
    """Random quantized layers of a config's scheme (`load_format="dummy"`): the 8-bit ones
    for fp8 and compressed-tensors' 8-bit formats, the packed ones for the rest."""
    if method == "fp8" or (method == "compressed-tensors" and not is_pack_quantized(config)):
        return keep_dummy_w8a8_weights(model, method, config, seed)
    return keep_dummy_packed_weights(model, method, config, seed)


# Checkpoints stored quantized: method -> what swaps in its layers before the loader runs.
KEEP_PACKED_WEIGHTS = {
    "gptq": keep_gptq_weights,
    "awq": keep_awq_weights,
    "compressed-tensors": keep_compressed_tensors_weights,
    "fp8": keep_fp8_weights,
}


class BuiltModel(NamedTuple):
    """A model with its weights, the kernels its layers run, and its attention backend."""

    model: torch.nn.Module
    kernels: KernelSelection
    attention_backend: object


class ModelBuilder:
    """Builds the model and KV pool of one rank: `tp_size` tensor-parallel ranks share each
    layer's KV heads, and this rank's pipeline stage holds `layers`."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        tp_size: int,
        layers: range,
        kv_groups: KVCacheGroups,
    ) -> None:
        self.config = config
        self.device = device
        self.tp_size = tp_size
        self.layers = layers
        self.kv_groups = kv_groups
        self.block_size = config.cache_config.block_size

    # ---- the KV pool ------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        """(K, V) per tensor pair; an int8 / fp8 cache's entries also hold their scales:
        (K, V, K scale, V scale), see ops/kv_quant.py."""
        shape, dtype = self.kv_cache_shape(num_blocks), self.config.cache_config.cache_dtype
        return [
            kv_cache_entry(shape, dtype, self.zeros)
            for _ in range(self.kv_groups.num_tensor_pairs(self.layers))
        ]

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """One layer's K (or V) pool on this rank: its KV heads (a share, or one replicated
        head when there are more ranks than KV heads). The pool holds one such pair per layer
        of this rank's pipeline stage."""
        model_config = self.config.model_config
        num_kv_heads = num_kv_heads_per_rank(model_config.num_kv_heads, self.tp_size)
        return (num_blocks, self.block_size, num_kv_heads, model_config.head_dim)

    def start_prefault(
        self, owner: object, tensors: list[torch.Tensor]
    ) -> KVCachePrefaulter | None:
        """Fault the first of `tensors`' blocks in now and more between steps, stopping when
        `owner` is collected (a dropped engine's pool must be neither kept alive nor faulted
        in)."""
        if self.device.type != "cpu" or not prefault_enabled():
            return None
        prefaulter = KVCachePrefaulter(tensors).start()
        weakref.finalize(owner, prefaulter.stop)
        return prefaulter

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed, not empty: padded decode batches read slots past each sequence's end, and
        masked-out garbage that happens to be NaN would still poison 0 * NaN in softmax @ V.

        On the CPU the zeros are an anonymous mapping of their own (`mapped_zeros`), whose
        pages the OS maps lazily, so a 4 GiB cache costs no start-up time. A page not yet
        touched is faulted in by the first write to its block, inside a step (5-8% of a
        2,048-token prefill step); on this VM that is the host's first touch of guest
        memory, ~0.5 GB/s on small and huge pages alike, so touching the whole pool up
        front would take ~9 s. Instead `KVCachePrefaulter` faults the pool's first GiB in on
        idle CPU time once the model is loaded (while the engine waits for work), in the
        order blocks are handed out.

        The mapping is advised MADV_HUGEPAGE, so where transparent huge pages are "madvise"
        the pool is faulted in as huge pages. Nothing here depends on it: on small pages the
        steady-state decode step at 256 sequences measured the same (docs/performance.md,
        "What bounds decode attention").
        """
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        num_bytes = math.prod(shape) * dtype.itemsize
        return torch.from_numpy(mapped_zeros(num_bytes)).view(dtype).view(shape)

    # ---- models -----------------------------------------------------------------------------
    def build_model(self, source: ModelSource, model_config: ModelConfig) -> BuiltModel:
        """The target, or a speculative draft model, each with its own config."""
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
        attention_backend = get_attention_backend(kernels.attention, tiles=kernels.attention_tiles)
        with torch.device(self.device):
            model = model_class(
                model_config.hf_config,
                attention_backend,
                model_config.dtype,
                model_config.max_model_len,
                kernels=kernels,
            )
        self._load_weights(model, source, model_config)
        return BuiltModel(model.eval(), kernels, attention_backend)

    def _load_weights(
        self, model: torch.nn.Module, source: ModelSource, model_config: ModelConfig
    ) -> None:
        quantization = model_config.quantization
        # gguf: layers on the file's blocks before any weight is read (see gguf_swap).
        # gptq, awq, compressed-tensors, fp8: layers on the checkpoint's stored integer or
        # fp8 weights, the same way (packed_swap, w8a8_swap).
        on_blocks: set[str] = set()
        if quantization == "gguf":
            on_blocks = keep_gguf_blocks(model, source.path, model_config.gguf_activation_bits)
        elif quantization in KEEP_PACKED_WEIGHTS and model_config.load_format == "dummy":
            # Random packed or 8-bit weights of the config's layers.
            config = quantization_config(model_config.hf_config)
            on_blocks = keep_dummy_weights(model, quantization, config, model_config.seed)
        elif quantization in KEEP_PACKED_WEIGHTS:
            config = quantization_config(model_config.hf_config)
            on_blocks = KEEP_PACKED_WEIGHTS[quantization](model, source.path, config)
        if quantization in KEEP_PACKED_WEIGHTS and stored_vocab_enabled():
            # Their embedding and head stay in the checkpoint's 16-bit dtype (stored_vocab).
            directory = None if model_config.load_format == "dummy" else source.path
            vocab_dtype = stored_vocab_dtype(directory, model_config.hf_config)
            if vocab_dtype is not None:
                keep_vocab_in_stored_dtype(model, vocab_dtype)
        load_weights(
            model,
            source,
            model_config.hf_config,
            model_config.load_format,
            seed=model_config.seed,
            # Tensor-parallel ranks read only their shard of each safetensors tensor (a model
            # built whole under `single_rank_groups` reads all of it).
            lazy=get_tp_group().world_size > 1,
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
            reuse_activation_pages()

    def build_draft_model(
        self, draft_config: ModelConfig, num_blocks: int, target_backend
    ) -> tuple[DraftModelDrafts, list[KVCache]]:
        """The speculative draft model's proposer, and its KV pool of the same `num_blocks`
        blocks as the target's (block ids are shared, so copies-on-write cover both).
        Whether its steps compile is `target_backend`'s call, as for the target's step.

        The draft is built whole, every head and layer, even on a rank of several: only the
        sampling rank runs it, between steps, so it must call no collective its peers would
        wait in (and a small draft gains nothing from being split)."""
        source = ModelSource(draft_config.model, draft_config.model.endswith(".gguf"))
        with single_rank_groups():
            model, _, attention_backend = self.build_model(source, draft_config)
        shape = (num_blocks, self.block_size, draft_config.num_kv_heads, draft_config.head_dim)
        dtype = self.config.cache_config.cache_dtype
        pool = [kv_cache_entry(shape, dtype, self.zeros) for _ in range(draft_config.num_layers)]
        model.bind_kv_cache(pool)
        speculative_config = self.config.speculative_config
        assert speculative_config is not None
        compiled = (
            self.compile_decode(model, target_backend, num_kv_groups=1)
            if self.config.compile
            else None
        )
        proposer = DraftModelDrafts(
            speculative_config,
            model,
            attention_backend,
            self.block_size,
            self.config.model_config.max_model_len,
            self.device,
            compiled,
        )
        return proposer, pool

    def build_head(
        self, head_config: ModelConfig, num_blocks: int, target: BuiltModel, shared: TargetParts
    ) -> tuple[EagleDrafts, list[KVCache]]:
        """An EAGLE head's proposer (method "eagle3" / "eagle"), on the target's kernels and
        sharing what its checkpoint lacks with the target (`shared`: whole on this rank,
        whole_target_parts.py), and its KV pool of the same `num_blocks` blocks as the
        target's (as a draft model's). Built whole, as a draft model is, even on a rank of
        several: only the sampling rank runs it."""
        speculative_config = self.config.speculative_config
        assert speculative_config is not None
        tensors = eagle_loading.read_head_tensors(head_config.model)
        with torch.device(self.device), single_rank_groups():
            head, target_states = eagle_loading.build_head(
                speculative_config.method,
                head_config.hf_config,
                tensors,
                target.model.config,
                shared,
                target.attention_backend,
                head_config.dtype,
                head_config.max_model_len,
                target.kernels,
                head_config.model,
            )
        if self.device.type == "cpu":
            pack_linear_weights(head)  # its own layers only: what it shares is packed already
        shape = (num_blocks, self.block_size, head_config.num_kv_heads, head_config.head_dim)
        dtype = self.config.cache_config.cache_dtype
        pool = [kv_cache_entry(shape, dtype, self.zeros) for _ in range(head_config.num_layers)]
        head.bind_kv_cache(pool)
        proposer = EagleDrafts(
            speculative_config,
            head,
            target_states,
            target.attention_backend,
            self.block_size,
            self.config.model_config.max_model_len,
            self.device,
        )
        return proposer, pool

    def build_medusa(self, target: BuiltModel, shared: TargetParts) -> MedusaDrafts:
        """Medusa heads' proposer (method "medusa"): the first `num_speculative_tokens`
        heads, on the target's kernels, scoring with the target's lm_head (`shared`: whole
        on this rank) where the checkpoint has none. No KV pool: the heads are
        position-wise."""
        spec = self.config.speculative_config
        assert spec is not None and spec.model is not None
        directory = resolve_model(spec.model).path
        config = read_medusa_config(directory)
        tensors = medusa_loading.read_medusa_tensors(directory, config)
        model_config = self.config.model_config
        with torch.device(self.device):
            heads = medusa_loading.build_medusa_heads(
                config,
                tensors,
                spec.num_speculative_tokens,
                model_config.hf_config.hidden_size,
                model_config.vocab_size,
                model_config.dtype,
                target.kernels,
            )
        heads.share_target_logits(shared.compute_logits)
        if self.device.type == "cpu":
            pack_linear_weights(heads)  # its own layers only: the target's are packed already
        return MedusaDrafts(spec, heads, self.device)

    def compile_decode(
        self, model: torch.nn.Module, attention_backend, num_kv_groups: int
    ) -> CompiledDecode | None:
        """The decode step of `model` (the target's; a draft model's chained steps) through
        torch.compile, or None where it cannot be compiled."""
        if not attention_backend.traceable:
            # The torch backend reads the step's layout from Python lists, on which a
            # compiled graph would specialize and recompile step after step.
            logger.warning(
                "compile needs attention_backend='cpu' on the CPU; decode steps stay eager"
            )
            return None
        compiled = CompiledDecode(model, compiled_batch_limit(model), num_kv_groups)
        try:
            with torch.inference_mode():
                compiled.warm_up(self.device)
        except Exception as error:  # compiling is an optimization: never fail the start
            # e.g. int8's fbgemm weights are script objects the tracer cannot follow
            logger.warning("compile failed (%s); decode steps stay eager", _first_line(error))
            return None
        return compiled


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
