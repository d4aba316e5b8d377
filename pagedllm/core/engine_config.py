"""Resolve `EngineArgs` against a model into the frozen `EngineConfig` (and size the KV cache)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from pagedllm.config import (
    CHECKPOINT_QUANTIZATION_METHODS,
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineArgs,
    EngineConfig,
    KVCacheGroups,
    ModelConfig,
    SchedulerConfig,
    kv_cache_groups,
    parse_memory_size,
    resolve_dtype,
    verify_quantization,
)
from pagedllm.core.kv_tier_setup import build_kv_tier_config
from pagedllm.lora.config import LORA_ARCHITECTURES
from pagedllm.model.layers.attention import layer_sliding_windows
from pagedllm.model.layers.onednn import available_memory_bytes
from pagedllm.model.loader import ModelSource, load_hf_config, load_tokenizer, resolve_model
from pagedllm.model.quantization.registry import (
    checkpoint_quantization,
    quantization_config,
)
from pagedllm.model.registry import resolve_model_class
from pagedllm.ops.attention_registry import check_attention_backend
from pagedllm.ops.cpu_features import cpu_features
from pagedllm.ops.kv_quant import bytes_per_row
from pagedllm.parallel_config import (
    ParallelConfig,
    num_kv_heads_per_rank,
    pipeline_stage_layers,
    verify_cpu_binding,
    verify_parallel_layout,
)
from pagedllm.spec_decode.core.head_config import build_head_config, check_medusa_head

logger = logging.getLogger("pagedllm")

# Without `kv_cache_memory` the pool takes at most this share of the memory available when
# the engine starts, as vLLM's CPU backend takes half the machine's memory when
# VLLM_CPU_KVCACHE_SPACE is unset. Available rather than total memory: on a machine shared
# with other engines (or a test suite's several), what they already hold is not ours.
DEFAULT_KV_MEMORY_FRACTION = 0.5


def derive_max_model_len(hf_config: Any, requested: int | None) -> int:
    """The model's context window (a sliding window does not narrow it: those layers mask)."""
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} is longer than the model's context window ({limit})"
        )
    return requested


def eos_token_ids(hf_config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for value in (
        getattr(hf_config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def kv_bytes_per_block(
    model_config: ModelConfig,
    block_size: int,
    cache_dtype: torch.dtype,
    parallel_config: ParallelConfig | None = None,
    kv_groups: KVCacheGroups | None = None,
) -> int:
    """One block's K and V on one rank: its KV heads (tensor parallel: a share, or one
    replicated head) for the tensor pairs its stage's layers need (pipeline parallel: the
    largest stage's, so every rank's pool of `num_blocks` fits its `kv_cache_memory`). One
    group of every layer needs a pair per layer; several groups share pairs."""
    parallel_config = parallel_config or ParallelConfig()
    num_kv_heads = num_kv_heads_per_rank(
        model_config.num_kv_heads, parallel_config.tensor_parallel_size
    )
    groups = kv_groups or kv_cache_groups([None] * model_config.num_layers)
    num_layers = max(
        groups.num_tensor_pairs(
            pipeline_stage_layers(
                model_config.num_layers, parallel_config.pipeline_parallel_size, r
            )
        )
        for r in range(parallel_config.pipeline_parallel_size)
    )
    # K and V rows of each token, with a quantized cache's scales (ops/kv_quant.py).
    row_bytes = bytes_per_row(cache_dtype, model_config.head_dim)
    return 2 * num_layers * num_kv_heads * row_bytes * block_size


def model_kv_groups(hf_config: Any, max_model_len: int) -> KVCacheGroups:
    """The model's KV cache groups. A window no shorter than `max_model_len` never drops a
    key, so such layers count as full attention."""
    windows = [
        None if window is None or window >= max_model_len else window
        for window in layer_sliding_windows(hf_config)
    ]
    return kv_cache_groups(windows)


def _describe_groups(kv_groups: KVCacheGroups) -> str:
    if kv_groups.num_groups == 1 and not kv_groups.has_windows:
        return ""
    kinds = ", ".join(
        f"layers {list(g.layers)}: "
        + ("full" if g.sliding_window is None else f"window {g.sliding_window}")
        for g in kv_groups.groups
    )
    return f" in {kv_groups.num_groups} KV cache groups ({kinds})"


def load_engine_config(args: EngineArgs, log: bool = True) -> tuple[ModelSource, Any, Any]:
    """(model source, tokenizer or None, EngineConfig) for `args`; the model is not loaded."""
    source = resolve_model(args.model)
    hf_config = load_hf_config(source)
    resolve_model_class(getattr(hf_config, "architectures", None))
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(source, args.tokenizer)
    return source, tokenizer, build_engine_config(args, source, hf_config, tokenizer, log)


def checkpoint_dtype(hf_config: Any, is_gguf: bool) -> torch.dtype:
    """The dtype the checkpoint's weights are stored in (a GGUF file's are dequantized to
    float32); float32 where the config does not say."""
    if is_gguf:
        return torch.float32
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) else torch.float32


def model_dtype(args: EngineArgs, hf_config: Any, is_gguf: bool, log: bool = True) -> torch.dtype:
    """`dtype`, with "auto" resolved by vLLM's rule: the checkpoint's dtype, except that on
    the CPU bfloat16 is kept only where the CPU has bf16 arithmetic (AVX512-BF16 or AMX;
    elsewhere every bf16 product is converted to fp32 and runs slower than fp32 itself) and
    float16, which the CPU kernels do not take, becomes float32 (exact: every fp16 value is
    an fp32 value). Quantized models compute in float32 (a 16-bit embedding and head stay in
    their stored dtype, converted exactly: model/layers/stored_vocab.py)."""
    if args.dtype != "auto":
        return resolve_dtype(args.dtype)
    stored = checkpoint_dtype(hf_config, is_gguf)
    quantized = args.quantization is not None or quantization_config(hf_config) is not None
    if quantized or stored == torch.float32:
        return torch.float32
    on_cpu = torch.device(args.device).type == "cpu"
    if stored == torch.bfloat16 and (not on_cpu or cpu_features().bf16_arithmetic):
        chosen, why = torch.bfloat16, "the checkpoint's dtype"
    elif stored == torch.bfloat16:
        chosen, why = torch.float32, "this CPU has no bf16 arithmetic (AVX512-BF16 or AMX)"
    else:
        chosen, why = torch.float32, f"the kernels take float32 or bfloat16, not {stored}"
    if log:
        logger.info("dtype=auto: %s for a %s checkpoint (%s)", chosen, stored, why)
    return chosen


def build_engine_config(
    args: EngineArgs, source: ModelSource, hf_config: Any, tokenizer: Any, log: bool = True
):
    parallel_config = args.parallel_config()
    verify_parallel_layout(hf_config, parallel_config)
    verify_cpu_binding(parallel_config)
    quantization = checkpoint_quantization(hf_config, args.quantization)
    verify_checkpoint_quantization(args, quantization)
    model_config = ModelConfig(
        model=source.path,
        hf_config=hf_config,
        dtype=model_dtype(args, hf_config, source.is_gguf, log),
        max_model_len=derive_max_model_len(hf_config, args.max_model_len),
        eos_token_ids=eos_token_ids(hf_config, tokenizer),
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        quantization=quantization,
        load_format=args.load_format,
        gguf_activation_bits=args.gguf_activation_bits,
    )
    lora_config = args.lora_config()
    verify_lora_config(args, model_config)
    draft_model_config = build_draft_model_config(args, model_config)
    cache_config = _cache_config(args, model_config, parallel_config, log, draft_model_config)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=model_config.max_model_len,
        policy=args.scheduling_policy,
        tenant_weights=args.tenant_weights,
        max_loras=lora_config.max_loras if lora_config is not None else None,
    )
    check_attention_backend(args.attention_backend)
    kv_tier_config = build_kv_tier_config(
        args,
        model_config,
        cache_config,
        parallel_config,
        kv_bytes_per_block(
            model_config,
            cache_config.block_size,
            cache_config.cache_dtype,
            parallel_config,
            cache_config.kv_groups,
        ),
        log,
    )
    return EngineConfig(
        model_config,
        cache_config,
        scheduler_config,
        args.attention_backend,
        args.device,
        compile=False if args.enforce_eager else args.compile,
        parallel_config=parallel_config,
        speculative_config=args.speculative_config,
        draft_model_config=draft_model_config,
        lora_config=lora_config,
        kv_tier_config=kv_tier_config,
        pooler_config=args.pooler_config if args.runner == "pooling" else None,
    )


def verify_checkpoint_quantization(args: EngineArgs, quantization: str | None) -> None:
    """What a checkpoint stored quantized cannot be combined with yet, refused by name."""
    if quantization not in CHECKPOINT_QUANTIZATION_METHODS:
        return
    refused = [
        (torch.device(args.device).type != "cpu", f"device={args.device!r} (CPU kernels)"),
        (resolve_dtype(args.dtype) != torch.float32, f"dtype={args.dtype!r} (float32 compute)"),
    ]
    for is_refused, what in refused:
        if is_refused:
            raise ValueError(
                f"a checkpoint stored quantized with {quantization!r} is not served with "
                f"{what} (yet)"
            )


def verify_lora_config(args: EngineArgs, model_config: ModelConfig) -> None:
    """What LoRA cannot be combined with yet is refused here, by name. Tensor parallelism
    is not: each rank applies its cut of the adapters (`lora/model/layers.py`, `RankCut`)."""
    if not args.enable_lora:
        return
    refused = [
        (
            not hasattr(model_config.hf_config, "intermediate_size")
            or model_config.architecture not in LORA_ARCHITECTURES,
            f"architecture {model_config.architecture} (LoRA serves "
            f"{', '.join(LORA_ARCHITECTURES)})",
        ),
        (
            # Its row-parallel layers gather their input as the packed ones do, but a rank's
            # gathered LoRA delta has not been checked on GGUF blocks.
            model_config.quantization == "gguf" and args.tensor_parallel_size > 1,
            f"quantization='gguf' and tensor_parallel_size={args.tensor_parallel_size}",
        ),
    ]
    for is_refused, what in refused:
        if is_refused:
            raise ValueError(f"enable_lora is not supported with {what} (yet)")


def build_draft_model_config(args: EngineArgs, target: ModelConfig) -> ModelConfig | None:
    """The model that proposes for method "draft_model" (its own path), "self_quantized"
    (the target's own file, quantized) or an EAGLE head ("eagle3", "eagle": its directory,
    spec_decode/head_config.py); None for the model-free methods and Medusa heads (checked
    here, but they keep no KV to size). Refused: another vocabulary, a shorter context than
    the target's, sliding windows."""
    spec = args.speculative_config
    if spec is not None and spec.method == "medusa":
        check_medusa_head(spec, target)
        return None
    if spec is None or not spec.uses_draft_model:
        return None
    if spec.uses_head:
        head = build_head_config(spec, target)
        _check_no_windows(target)
        return head
    if spec.method == "self_quantized":
        source = resolve_model(target.model)
        if target.quantization is not None:
            raise ValueError(
                f"speculative_config method 'self_quantized' drafts for an unquantized target; "
                f"the model already runs with quantization={target.quantization!r}"
            )
        if spec.quantization == "gguf" and not source.is_gguf:
            raise ValueError(
                "speculative_config quantization 'gguf' keeps a GGUF file's blocks: the model "
                f"{target.model!r} is not a .gguf file (use quantization 'int8')"
            )
    else:
        source = resolve_model(spec.model)
    verify_quantization(spec.quantization)
    hf_config = load_hf_config(source)
    # A draft stored quantized runs on its packed weights, as a target does.
    quantization = _draft_quantization(args, hf_config, spec.quantization, source.path)
    resolve_model_class(getattr(hf_config, "architectures", None))
    draft = ModelConfig(
        model=source.path,
        hf_config=hf_config,
        dtype=torch.float32 if quantization else target.dtype,
        max_model_len=target.max_model_len,
        eos_token_ids=target.eos_token_ids,
        seed=target.seed,
        max_logprobs=target.max_logprobs,
        quantization=quantization,
        load_format=target.load_format,
    )
    _check_draft_fits_target(draft, target, source.path)
    return draft


def _draft_quantization(
    args: EngineArgs, hf_config: Any, requested: str | None, path: str
) -> str | None:
    """The draft's quantization: its checkpoint's method (refused by name as a target's
    would be, `checkpoint_quantization`), else `requested`; a draft stored quantized runs on
    the CPU kernels, and takes dummy weights as a target does."""
    quantization = checkpoint_quantization(hf_config, requested)
    if quantization not in CHECKPOINT_QUANTIZATION_METHODS:
        return quantization
    refused = [(torch.device(args.device).type != "cpu", f"device={args.device!r}")]
    for is_refused, what in refused:
        if is_refused:
            raise ValueError(
                f"speculative_config: the draft model {path!r}, stored quantized with "
                f"{quantization!r}, is not served with {what} (yet)"
            )
    return quantization


def _check_draft_fits_target(draft: ModelConfig, target: ModelConfig, path: str) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {path!r} has a vocabulary of "
            f"{draft.vocab_size} tokens, the target {target.vocab_size}: a draft must share "
            "the target's tokenizer"
        )
    draft_len = derive_max_model_len(draft.hf_config, None)
    if draft_len < target.max_model_len:
        raise ValueError(
            f"speculative_config: the draft model's context ({draft_len} tokens) is shorter "
            f"than max_model_len={target.max_model_len}; lower max_model_len"
        )
    _check_no_windows(target, draft)


def _check_no_windows(target: ModelConfig, draft: ModelConfig | None = None) -> None:
    models = [("target", target)] + ([("draft", draft)] if draft is not None else [])
    for name, config in models:
        groups = model_kv_groups(config.hf_config, target.max_model_len)
        if groups.num_groups > 1 or groups.has_windows:
            raise ValueError(
                f"speculative_config: the {name} model has sliding-window attention, which a "
                "draft model or head does not support yet (use method 'ngram' or 'suffix')"
            )


def default_kv_cache_memory(
    bytes_per_block: int,
    blocks_per_request: int,
    max_num_seqs: int,
    available_bytes: int,
    memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION,
) -> int:
    """The pool's bytes when `kv_cache_memory` is not given: what the engine can use, within
    `memory_fraction` of `available_bytes`, and never less than one full-length request.

    What it can use: `max_num_seqs` requests at full length, one more full request's
    blocks, and the null block. The extra request is the prefix cache's margin: a finished
    request's blocks stay cached until a new one needs them, so with every running request
    at full length the last finished conversation (the one whose next turn comes back
    first) is still there to reuse. More blocks than that could only ever hold older cached
    prefixes. The fraction bounds it on a small machine; the floor lets a model start
    wherever one request fits (if even that is beyond the machine, the pages are only
    faulted in as requests use them, and the OS says no then)."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    usable_blocks = (max_num_seqs + 1) * blocks_per_request + 1
    machine_blocks = int(available_bytes * memory_fraction) // bytes_per_block
    one_request_blocks = blocks_per_request + 1
    return max(one_request_blocks, min(usable_blocks, machine_blocks)) * bytes_per_block


def _available_memory_per_pool(parallel_config: ParallelConfig) -> int:
    """The available memory's share of each pool this engine's processes hold: every rank of
    every data-parallel core holds one (taken as all on this host, so Ray's ranks on other
    hosts get less than they might; `kv_cache_memory` sizes them exactly)."""
    pools = parallel_config.world_size * parallel_config.data_parallel_size
    return available_memory_bytes() // pools


def _cache_config(
    args: EngineArgs,
    model_config: ModelConfig,
    parallel_config: ParallelConfig,
    log: bool,
    draft_model_config: ModelConfig | None = None,
) -> CacheConfig:
    """The pool's geometry; `kv_cache_memory` is each rank's (every rank holds `num_blocks`
    blocks of its own heads and layers; the sampling rank also holds a speculative draft
    model's KV of them, of all its heads and layers, and every rank is sized for that one)."""
    block_size = args.block_size
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    cache_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype] or model_config.dtype
    max_len = model_config.max_model_len
    kv_groups = model_kv_groups(model_config.hf_config, max_len)
    bytes_per_block = kv_bytes_per_block(
        model_config, block_size, cache_dtype, parallel_config, kv_groups
    )
    if draft_model_config is not None:
        # The draft runs whole on the sampling rank: its KV is not split over the ranks.
        bytes_per_block += kv_bytes_per_block(draft_model_config, block_size, cache_dtype)
    blocks_per_request = kv_groups.max_blocks_per_request(max_len, block_size)
    if args.kv_cache_memory is None:
        memory = default_kv_cache_memory(
            bytes_per_block,
            blocks_per_request,
            args.max_num_seqs,
            _available_memory_per_pool(parallel_config),
            # vLLM's --gpu-memory-utilization, read as its CPU backend reads its KV space.
            args.gpu_memory_utilization or DEFAULT_KV_MEMORY_FRACTION,
        )
    else:
        memory = parse_memory_size(args.kv_cache_memory)
    num_blocks = memory // bytes_per_block
    cache_config = CacheConfig(
        block_size,
        num_blocks,
        memory,
        # A pooling request keeps no KV after its prefill (last-token pooling could share
        # prefixes, but mean and cls need every token's hidden state computed).
        args.enable_prefix_caching and args.runner != "pooling",
        cache_dtype,
        kv_groups if kv_groups.num_groups > 1 or kv_groups.has_windows else None,
    )
    num_tokens = (num_blocks - 1) // kv_groups.num_groups * block_size
    if num_blocks - 1 < blocks_per_request:
        raise ValueError(
            f"kv_cache_memory={memory} bytes holds {num_blocks - 1} blocks, fewer than the "
            f"{blocks_per_request} one request of max_model_len={max_len} tokens needs; "
            "raise kv_cache_memory or lower max_model_len"
        )
    if not log:
        return cache_config
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)%s; max concurrency at "
        "max_model_len=%d: %.2fx",
        num_blocks - 1,
        block_size,
        num_tokens,
        num_blocks * bytes_per_block / 1024**3,
        _describe_groups(kv_groups),
        max_len,
        (num_blocks - 1) / blocks_per_request,
    )
    return cache_config
