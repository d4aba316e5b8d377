"""load_format="dummy": seeded random weights of the config's shapes, each rank only its shard,
no file read; a directory holding only config.json is a model of that shape (an 8B-shaped
Llama here, built on the meta device to count each rank's parameters)."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch
from tp_harness import build_model, tiny_config

from benchmarks.parallel_memory import LLAMA_3_8B
from pagedllm.config import EngineArgs
from pagedllm.distributed import parallel_state
from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model.loader import (
    ModelSource,
    initialize_dummy_weights,
    load_hf_config,
    load_weights,
    resolve_model,
    write_config_dir,
)

LLAMA3_8B = LLAMA_3_8B.hf_config()
LLAMA3_8B_PARAMS = 8_030_261_248


@contextmanager
def as_rank(tp_rank: int, tp: int, pp_rank: int = 0, pp: int = 1):
    """Build as if this process were (tp_rank, pp_rank) of a tp x pp layout: construction
    only reads the groups' sizes and ranks, so no process group is needed."""
    rank = pp_rank * tp + tp_rank
    saved = parallel_state._TP, parallel_state._PP
    parallel_state._TP = GroupCoordinator(
        list(range(pp_rank * tp, (pp_rank + 1) * tp)), rank, torch.device("cpu")
    )
    parallel_state._PP = GroupCoordinator(
        list(range(tp_rank, tp * pp, tp)), rank, torch.device("cpu")
    )
    try:
        yield
    finally:
        parallel_state._TP, parallel_state._PP = saved


def test_dummy_weights_are_seeded_and_read_no_file(tmp_path):
    config = tiny_config()
    source = ModelSource(str(tmp_path / "nothing-here"), is_gguf=False)  # never opened
    first, second = build_model(config), build_model(config)
    load_weights(first, source, config, load_format="dummy", seed=3)
    load_weights(second, source, config, load_format="dummy", seed=3)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
        assert torch.isfinite(a).all()
    norm = first.model.norm.weight
    assert 0.8 < float(norm.mean()) < 1.2  # norms near 1, projections near 0
    initialize_dummy_weights(second, seed=4)
    assert not torch.equal(first.lm_head.weight, second.lm_head.weight)
    with pytest.raises(ValueError, match="load_format"):
        load_weights(first, source, config, load_format="pt")


def test_each_rank_holds_its_shard_shapes():
    config = tiny_config(num_key_value_heads=1)  # one KV head: replicated on both ranks
    shapes = []
    for tp_rank in range(2):
        with as_rank(tp_rank, 2):
            model = build_model(config)
            initialize_dummy_weights(model)
            shapes.append({name: tuple(p.shape) for name, p in model.named_parameters()})
    for rank_shapes in shapes:
        assert rank_shapes["model.embed_tokens.weight"] == (256, 64)  # 509 padded to 512
        assert rank_shapes["lm_head.weight"] == (256, 64)
        # q: 2 of 4 heads; k, v: the one KV head each
        assert rank_shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((2 + 1 + 1) * 16, 64)
        assert rank_shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
        assert rank_shapes["model.layers.0.mlp.gate_up_proj.weight"] == (96, 64)
        assert rank_shapes["model.layers.0.mlp.down_proj.weight"] == (64, 48)


def test_pipeline_stage_builds_only_its_layers():
    config = tiny_config(tie_word_embeddings=True)
    with as_rank(0, 1, pp_rank=0, pp=2):
        first = {name for name, _ in build_model(config).named_parameters()}
    with as_rank(0, 1, pp_rank=1, pp=2):
        last = {name for name, _ in build_model(config).named_parameters()}
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0", "1"}
    assert "model.embed_tokens.weight" not in last and "model.norm.weight" in last
    assert "lm_head.weight" in last  # a tied head's own copy on the last stage
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"2"}


def _count_8b(config, tp_rank: int, tp: int) -> int:
    with as_rank(tp_rank, tp), torch.device("meta"):
        from pagedllm.model.models.llama import LlamaForCausalLM
        from pagedllm.ops.attention_registry import get_attention_backend

        model = LlamaForCausalLM(config, get_attention_backend("torch"), torch.bfloat16, 8192)
    return sum(p.numel() for p in model.parameters())


def test_config_only_directory_is_an_8b_model(tmp_path):
    directory = write_config_dir(str(tmp_path / "llama3-8b"), LLAMA3_8B)
    assert os.listdir(directory) == ["config.json"]
    source = resolve_model(directory)
    config = load_hf_config(source)
    assert _count_8b(config, 0, 1) == LLAMA3_8B_PARAMS
    per_rank = [_count_8b(config, r, 2) for r in range(2)]
    assert per_rank[0] == per_rank[1]
    # Everything split in two but the norms (65 vectors of 4096), which every rank holds.
    norms = (2 * 32 + 1) * 4096
    assert per_rank[0] == (LLAMA3_8B_PARAMS - norms) // 2 + norms
    EngineArgs(model=directory, load_format="dummy", skip_tokenizer_init=True)


def test_engine_args_load_format_and_quantization_checks():
    assert EngineArgs().load_format == "auto"
    with pytest.raises(ValueError, match="load_format"):
        EngineArgs(load_format="safetensors")
    EngineArgs(quantization="gguf", tensor_parallel_size=2)  # blocks split by rows
    EngineArgs(quantization="gguf", pipeline_parallel_size=2)
    EngineArgs(quantization="int8", tensor_parallel_size=2, pipeline_parallel_size=2)


def _dummy_fp8_model(tp_rank: int = 0, tp: int = 1, pp_rank: int = 0, pp: int = 1):
    from pagedllm.model.layers.w8a8_dummy import keep_dummy_w8a8_weights

    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    with as_rank(tp_rank, tp, pp_rank, pp):
        model = build_model(tiny_config())
        assert keep_dummy_w8a8_weights(model, "fp8", config, seed=3) == set()
    return model


def test_dummy_8_bit_layers_keep_each_ranks_rows_and_each_stages_layers():
    """Random FP8 layers go through the checkpoint's swap: each rank holds its rows of the
    one seeded full weight (o and down: output rows over the whole K), each stage only its
    own layers."""
    from pagedllm.model.layers.w8a8_linear import TiledDequantLinear
    from pagedllm.model.layers.w8a8_parallel import TiledDequantRowParallelLinear

    whole = _dummy_fp8_model()
    ranks = [_dummy_fp8_model(tp_rank, 2) for tp_rank in range(2)]
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"):
        parts = [rank.get_submodule(name) for rank in ranks]
        assert all(isinstance(part, TiledDequantRowParallelLinear) for part in parts)
        rows = torch.cat([part.weights.dequantize() for part in parts])
        assert torch.equal(rows, whole.get_submodule(name).weights.dequantize())
    qkv = ranks[1].get_submodule("model.layers.0.self_attn.qkv_proj")
    assert qkv.weights.values.shape == ((2 + 1 + 1) * 16, 64)  # 2 q heads, its k and v head
    last_stage = _dummy_fp8_model(pp_rank=1, pp=2)
    layers = {
        name.split(".")[2]
        for name, module in last_stage.named_modules()
        if isinstance(module, TiledDequantLinear)
    }
    assert layers == {"2"}
