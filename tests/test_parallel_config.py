"""Parallel layouts checked at start-up against the model, and the KV cache sized per rank.

SmolLM2-135M (the default model: 9 heads, 3 KV heads, intermediate 1536, 30 layers) divides
by 3, not by 2: tensor_parallel_size=2 is refused naming the sizes that work, 3 accepted.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.config import EngineArgs, ModelConfig
from pagedllm.core.engine_config import build_engine_config, kv_bytes_per_block
from pagedllm.model.loader import ModelSource
from pagedllm.parallel_config import ParallelConfig, verify_parallel_layout

SMOLLM2 = SimpleNamespace(
    architectures=["LlamaForCausalLM"],
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
SOURCE = ModelSource("smollm2.gguf", is_gguf=True)  # only its kind is read


def _parallel(tp: int = 1, pp: int = 1) -> ParallelConfig:
    backend = "uni" if tp * pp == 1 else "mp"
    return ParallelConfig(tp, pp, distributed_executor_backend=backend)


def test_smollm2_tp2_refused_naming_the_sizes_that_work():
    with pytest.raises(ValueError, match="tensor_parallel_size=2") as error:
        verify_parallel_layout(SMOLLM2, _parallel(tp=2))
    # 9 heads and 3 KV heads allow 1, 3 and 9; the intermediate size 1536 rules out 9.
    assert "Sizes that work: 1, 3" in str(error.value)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (3, 1), (1, 2), (3, 2), (1, 30)])
def test_smollm2_layouts_accepted(tp, pp):
    verify_parallel_layout(SMOLLM2, _parallel(tp, pp))


def test_more_stages_than_layers_refused():
    with pytest.raises(ValueError, match="more stages than the model's 30 layers"):
        verify_parallel_layout(SMOLLM2, _parallel(pp=31))


def test_engine_config_refuses_tp2_at_start_up():
    args = EngineArgs(tensor_parallel_size=2, max_model_len=64, cpu_threads_bind="nobind")
    with pytest.raises(ValueError, match="Sizes that work: 1, 3"):
        build_engine_config(args, SOURCE, SMOLLM2, None, log=False)
    args = EngineArgs(tensor_parallel_size=3, max_model_len=64, cpu_threads_bind="nobind")
    config = build_engine_config(args, SOURCE, SMOLLM2, None, log=False)
    assert config.parallel_config.tensor_parallel_size == 3
    assert config.distributed_executor_backend == "mp"


def _model_config(hf_config) -> ModelConfig:
    return ModelConfig(
        model="x",
        hf_config=hf_config,
        dtype=torch.float32,
        max_model_len=64,
        eos_token_ids=frozenset(),
        seed=0,
        max_logprobs=0,
    )


@pytest.mark.parametrize(
    ("tp", "pp", "kv_heads", "layers"),
    [
        (1, 1, 3, 30),
        (3, 1, 1, 30),  # 3 KV heads over 3 ranks: one each
        (1, 2, 3, 15),
        (3, 2, 1, 15),
        (1, 4, 3, 8),  # 30 layers in 4 stages: 8, 8, 7, 7 (the largest counts)
    ],
)
def test_kv_bytes_per_block_per_rank(tp, pp, kv_heads, layers):
    model_config = _model_config(SMOLLM2)
    got = kv_bytes_per_block(model_config, 16, torch.float16, _parallel(tp, pp))
    head_dim = 576 // 9
    assert got == 2 * layers * kv_heads * head_dim * 2 * 16


def test_kv_heads_replicated_when_more_ranks_than_kv_heads():
    config = SimpleNamespace(
        **{**vars(SMOLLM2), "num_attention_heads": 8, "num_key_value_heads": 2}
    )
    # tp=4 > 2 KV heads: each rank holds one (replicated) head.
    got = kv_bytes_per_block(_model_config(config), 16, torch.float32, _parallel(4))
    assert got == 2 * 30 * 1 * (576 // 8) * 4 * 16


def test_pool_holds_the_same_blocks_per_rank_in_its_memory():
    """kv_cache_memory is each rank's: with tp=3 every rank holds a third of the KV heads,
    so the same memory holds three times the blocks."""
    blocks = {}
    for tp in (1, 3):
        args = EngineArgs(
            tensor_parallel_size=tp,
            max_model_len=64,
            kv_cache_memory="64MiB",
            cpu_threads_bind="nobind",
        )
        blocks[tp] = build_engine_config(
            args, SOURCE, SMOLLM2, None, log=False
        ).cache_config.num_blocks
    assert blocks[3] == 3 * blocks[1]
