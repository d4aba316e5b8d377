"""The KV pool's default size (`default_kv_cache_memory`): what `max_num_seqs` requests at
`max_model_len` can use plus one request's margin for the prefix cache, bounded by a share
of the memory available; an explicit `kv_cache_memory` is taken as given."""

from __future__ import annotations

import pytest

from pagedllm.config import EngineArgs
from pagedllm.core import engine_config
from pagedllm.core.engine_config import (
    default_kv_cache_memory,
    kv_bytes_per_block,
    load_engine_config,
)

BLOCK = 1000  # bytes per block: round numbers below


def test_what_the_sequences_can_use_plus_one_request_and_the_null_block():
    # 4 sequences of 8 blocks, one more request of 8, the null block: 41 blocks.
    memory = default_kv_cache_memory(BLOCK, 8, 4, available_bytes=10**12)
    assert memory == 41 * BLOCK


def test_bounded_by_a_share_of_the_available_memory():
    memory = default_kv_cache_memory(BLOCK, 8, 256, available_bytes=100_000)
    assert memory == 50 * BLOCK  # half of 100 blocks' worth
    assert default_kv_cache_memory(BLOCK, 8, 256, 100_000, memory_fraction=0.2) == 20 * BLOCK


def test_whole_blocks_only():
    assert default_kv_cache_memory(BLOCK, 8, 256, available_bytes=101_999) == 50 * BLOCK


def test_never_less_than_one_full_request():
    # Half of 10 blocks' worth is 5, fewer than the 8 + the null block one request needs.
    assert default_kv_cache_memory(BLOCK, 8, 4, available_bytes=10 * BLOCK) == 9 * BLOCK


def test_the_fraction_is_checked():
    for fraction in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="memory_fraction"):
            default_kv_cache_memory(BLOCK, 8, 4, 10**9, memory_fraction=fraction)


def _config(tiny_llama, **args):
    _, _, config = load_engine_config(
        EngineArgs(model=str(tiny_llama), max_model_len=64, block_size=16, **args), log=False
    )
    return config


def test_the_engine_sizes_its_pool_by_max_num_seqs(tiny_llama, monkeypatch):
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 2**40)
    config = _config(tiny_llama, max_num_seqs=3)
    # 64 tokens in blocks of 16: 4 per request; (3 + 1) requests and the null block.
    assert config.cache_config.num_blocks == 4 * 4 + 1


def test_the_engine_sizes_its_pool_by_the_available_memory(tiny_llama, monkeypatch):
    config = _config(tiny_llama, max_num_seqs=3)
    per_block = kv_bytes_per_block(
        config.model_config, 16, config.cache_config.cache_dtype, kv_groups=None
    )
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 20 * per_block)
    assert _config(tiny_llama, max_num_seqs=256).cache_config.num_blocks == 10


def test_an_explicit_kv_cache_memory_wins(tiny_llama, monkeypatch):
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 1024)
    config = _config(tiny_llama, max_num_seqs=3, kv_cache_memory="1MiB")
    per_block = kv_bytes_per_block(
        config.model_config, 16, config.cache_config.cache_dtype, kv_groups=None
    )
    assert config.cache_config.kv_cache_memory == 1024**2
    assert config.cache_config.num_blocks == 1024**2 // per_block


def test_each_rank_and_data_parallel_core_gets_its_share(monkeypatch):
    from pagedllm.parallel_config import ParallelConfig

    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 12 * 2**30)
    layout = ParallelConfig(
        tensor_parallel_size=2, data_parallel_size=3, distributed_executor_backend="mp"
    )
    assert engine_config._available_memory_per_pool(layout) == 2 * 2**30
    assert engine_config._available_memory_per_pool(ParallelConfig()) == 12 * 2**30
