"""Resolve the KV tier flags (`kv_offload_memory`, `kv_offload_dir`, `preemption_mode`,
`kv_transfer_config`) against the model and the pool into one `KVTierConfig`.

A block's bytes mean something only for one model, cache dtype, block size and layout;
`cache_identity` digests those, and the disk tier keys its folder by it and a peer refuses
blocks of another. With several ranks the layout includes how the model is split (each rank
keeps its own share of a block in files of its own: disk_layout.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from pagedllm.config import CacheConfig, EngineArgs, ModelConfig, parse_memory_size
from pagedllm.kv_transfer.config import DEFAULT_SWAP_SPACE, KVTierConfig
from pagedllm.parallel_config import ParallelConfig, num_kv_heads_per_rank

logger = logging.getLogger("pagedllm")

# The host staging a disk tier gets without --kv-offload-memory (its reads land there).
DEFAULT_DISK_STAGING = 1024**3
# Bytes of a weight file read into its fingerprint (its start and its end).
FINGERPRINT_BYTES = 1 << 20
FORMAT_VERSION = 1


def build_kv_tier_config(
    args: EngineArgs,
    model_config: ModelConfig,
    cache_config: CacheConfig,
    parallel_config: ParallelConfig,
    bytes_per_block: int,
    log: bool = True,
) -> KVTierConfig | None:
    """None when no tier is asked for; what cannot be combined yet is refused by name."""
    if not args.uses_kv_tiers:
        return None
    refused = [
        (
            parallel_config.world_size > 1 and args.kv_transfer_config is not None,
            "kv_transfer_config with tensor_parallel_size or pipeline_parallel_size > 1 (each "
            "rank's blocks would need a link of its own; host memory, swap and the disk tier "
            "work)",
        ),
        (
            args.speculative_config is not None and args.speculative_config.uses_draft_model,
            "a speculative draft model (its own KV is not moved; 'ngram' and 'suffix' work)",
        ),
        (
            args.kv_transfer_config is not None and parallel_config.data_parallel_size > 1,
            "kv_transfer_config with data_parallel_size > 1 (one receiver port per instance)",
        ),
    ]
    for is_refused, what in refused:
        if is_refused:
            raise ValueError(f"KV tiers (offload, swap, transfer) are not supported with {what}")
    transfer = args.kv_transfer_config
    if args.kv_offload_memory is not None:
        host_bytes = parse_memory_size(args.kv_offload_memory, "kv_offload_memory")
    elif args.preemption_mode == "swap":
        host_bytes = DEFAULT_SWAP_SPACE
    elif transfer is not None and transfer.receives:
        host_bytes = transfer.kv_buffer_size
    elif args.kv_offload_dir is not None:
        host_bytes = DEFAULT_DISK_STAGING
    else:
        host_bytes = 0
    config = KVTierConfig(
        identity=cache_identity(model_config, cache_config, parallel_config),
        num_host_blocks=host_bytes // bytes_per_block,
        disk_dir=args.kv_offload_dir,
        preemption_mode=args.preemption_mode,
        transfer=transfer,
    )
    if log:
        logger.info(
            "KV tiers: host %d blocks (%.2f GiB)%s, preemption by %s%s",
            config.num_host_blocks,
            config.num_host_blocks * bytes_per_block / 1024**3,
            f", disk {config.disk_dir}/{config.identity}" if config.disk_dir else "",
            config.preemption_mode,
            f", transfer as {transfer.kv_role}" if transfer is not None else "",
        )
    return config


def cache_identity(
    model_config: ModelConfig, cache_config: CacheConfig, parallel_config: ParallelConfig
) -> str:
    """A digest of what a KV block's bytes depend on: the weights (a fingerprint of the
    files), the model and cache dtypes, the block size and the cache's layout (with several
    ranks, the tensor and pipeline split)."""
    groups = cache_config.kv_groups
    described = {
        "version": FORMAT_VERSION,
        "weights": _weights_fingerprint(model_config),
        "architecture": model_config.architecture,
        "dtype": str(model_config.dtype),
        "cache_dtype": str(cache_config.cache_dtype),
        "quantization": model_config.quantization,
        "block_size": cache_config.block_size,
        "num_layers": model_config.num_layers,
        "num_kv_heads": num_kv_heads_per_rank(
            model_config.num_kv_heads, parallel_config.tensor_parallel_size
        ),
        "head_dim": model_config.head_dim,
        "groups": repr(groups) if groups is not None else None,
    }
    if parallel_config.world_size > 1:
        # Each rank's share of a block depends on the split; one rank's identity is kept as
        # it was, so a one-rank disk tier written before stays valid.
        described["tensor_parallel_size"] = parallel_config.tensor_parallel_size
        described["pipeline_parallel_size"] = parallel_config.pipeline_parallel_size
    text = json.dumps(described, sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest()[:32]


def _weights_fingerprint(model_config: ModelConfig) -> str:
    if model_config.load_format == "dummy":
        return f"dummy-seed-{model_config.seed}"
    path = Path(model_config.model)
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as handle:
            digest.update(handle.read(FINGERPRINT_BYTES))
            handle.seek(max(0, size - FINGERPRINT_BYTES))
            digest.update(handle.read(FINGERPRINT_BYTES))
    return digest.hexdigest()
