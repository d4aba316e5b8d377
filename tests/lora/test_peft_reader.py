"""Reading PEFT adapters: what is served (safetensors and .bin, rslora scaling) and what is
refused with a message naming the problem."""

from __future__ import annotations

import gc
import json
import math
import os
import tracemalloc

import pytest
import torch
from lora_utils import make_peft_adapter
from safetensors.torch import load_file, save_file

from pagedllm.config import ModelConfig
from pagedllm.lora.peft import LoRAAdapterError, projection_shapes, read_adapter
from pagedllm.lora.request import LoRARequest


@pytest.fixture(scope="module")
def model_config(tiny_llama) -> ModelConfig:
    from transformers import AutoConfig

    return ModelConfig(
        str(tiny_llama), AutoConfig.from_pretrained(tiny_llama), torch.float32, 256, frozenset()
    )


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    return make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("adapter"), seed=3, rank=4)


def read(path, model_config, max_rank=16):
    request = LoRARequest("a", 1, str(path))
    return read_adapter(request, projection_shapes(model_config), max_rank)


def copy_adapter(source, destination, edit_config=None, edit_tensors=None):
    destination.mkdir(exist_ok=True)
    settings = json.loads((source / "adapter_config.json").read_text())
    if edit_config:
        settings.update(edit_config)
    (destination / "adapter_config.json").write_text(json.dumps(settings))
    tensors = load_file(source / "adapter_model.safetensors")
    if edit_tensors:
        tensors = edit_tensors(tensors)
    save_file(tensors, destination / "adapter_model.safetensors")
    return destination


def test_reads_every_projection_with_scaling(adapter, model_config):
    loaded = read(adapter, model_config)
    assert loaded.rank == 4 and loaded.scaling == 16 / 4
    assert len(loaded.modules) == 2 * 7  # two layers, seven projections
    tensors = load_file(adapter / "adapter_model.safetensors")
    name = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    torch.testing.assert_close(
        loaded.modules["model.layers.1.self_attn.k_proj"].lora_b, tensors[name] * 4
    )


def test_rslora_scales_by_the_square_root(adapter, model_config, tmp_path):
    loaded = read(copy_adapter(adapter, tmp_path / "rs", {"use_rslora": True}), model_config)
    assert loaded.scaling == pytest.approx(16 / math.sqrt(4))


def test_bin_weights_are_read(tiny_llama, model_config, tmp_path):
    path = make_peft_adapter(tiny_llama, tmp_path / "bin", seed=4, safe_serialization=False)
    assert len(read(path, model_config).modules) == 14


def drop_half(tensors):
    return {k: v for k, v in tensors.items() if "q_proj.lora_B" not in k}


def embedding_tensor(tensors):
    return tensors | {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 512)}


def lm_head_tensor(tensors):
    return tensors | {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}


def wrong_shape(tensors):
    name = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    return tensors | {name: torch.zeros(4, 65)}


def non_finite(tensors):
    name = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    return tensors | {name: torch.full((4, 64), float("nan"))}


def huge_finite(tensors):
    name = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    return tensors | {name: torch.full((4, 64), 1e30)}


def float64_past_fp32(tensors):
    # Finite as stored (float64), inf once served in fp32.
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    return tensors | {name: torch.full((64, 4), 1e300, dtype=torch.float64)}


@pytest.mark.parametrize(
    ("edit_config", "edit_tensors", "problem"),
    [
        ({"r": 32}, None, "rank r=32 is larger than this engine's max_lora_rank=16"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"use_dora": True}, None, "use_dora"),
        ({"bias": "all"}, None, "bias"),
        ({"rank_pattern": {"q_proj": 8}}, None, "rank_pattern"),
        ({"peft_type": "IA3"}, None, "peft_type 'IA3' is not supported"),
        ({"lora_alpha": "x"}, None, "lora_alpha must be a finite number"),
        (None, drop_half, "has lora_A only"),
        (None, embedding_tensor, "is not a LoRA A or B weight"),
        (None, lm_head_tensor, "module 'lm_head' cannot carry a LoRA adapter"),
        (None, wrong_shape, "has shape (4, 65), expected (4, 64)"),
        (None, non_finite, "must hold finite floats"),
        ({"lora_alpha": 1e300}, None, "times lora_alpha/r=2.5e+299 reaches"),
        (None, huge_finite, "up_proj.lora_A reaches 1e+30; served adapter weights must stay"),
        (None, float64_past_fp32, "q_proj.lora_B times lora_alpha/r=4 reaches inf"),
    ],
)
def test_refused_with_the_problem_named(
    adapter, model_config, tmp_path, edit_config, edit_tensors, problem
):
    path = copy_adapter(adapter, tmp_path / "bad", edit_config, edit_tensors)
    with pytest.raises(LoRAAdapterError, match="LoRA adapter 'a'") as error:
        read(path, model_config)
    assert problem in str(error.value)


def test_missing_or_broken_files(adapter, model_config, tmp_path):
    with pytest.raises(LoRAAdapterError, match="no directory"):
        read(tmp_path / "nowhere", model_config)
    broken = copy_adapter(adapter, tmp_path / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(LoRAAdapterError, match=r"cannot read adapter_model\.safetensors"):
        read(broken, model_config)
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match="not valid JSON"):
        read(broken, model_config)
    (broken / "adapter_config.json").unlink()
    with pytest.raises(LoRAAdapterError, match=r"adapter_config\.json is missing"):
        read(broken, model_config)


def test_a_weight_file_larger_than_any_adapter_of_the_rank_is_refused(
    adapter, model_config, tmp_path
):
    huge = copy_adapter(adapter, tmp_path / "huge")
    (huge / "adapter_model.safetensors").write_bytes(b"\x00" * (3 << 20))
    with pytest.raises(LoRAAdapterError, match="needs at most"):
        read(huge, model_config)


def test_reading_an_adapter_again_and_again_keeps_nothing(adapter, model_config):
    # The server reads every runtime-loaded adapter (its check in the API process, its load in
    # the engine core): a read must leave no memory behind. safetensors' `safe_open` kept ~28
    # bytes of every tensor it handed out for good (0.8.0).
    num_tensors = len(load_file(adapter / "adapter_model.safetensors"))
    for _ in range(300):  # torch's own small caches fill over the first few hundred
        read(adapter, model_config)
    gc.collect()
    kept = _bytes_kept_through(
        f"*{os.sep}pagedllm{os.sep}lora{os.sep}*", 50, lambda: read(adapter, model_config)
    )
    # The leak kept 28 bytes or more per tensor read; half of it is far above any noise.
    assert kept < 50 * num_tensors * 14, f"{kept} bytes kept by 50 reads of {num_tensors} tensors"


def _bytes_kept_through(file_pattern, num_calls, call) -> int:
    """Bytes still held after `num_calls` calls that were allocated with a frame of a file
    matching `file_pattern` on the stack. Counting only those keeps out what other threads
    left behind by earlier tests allocate meanwhile (the whole suite's total is noisy)."""
    only_theirs = [tracemalloc.Filter(True, file_pattern, all_frames=True)]
    tracemalloc.start(64)
    try:
        before = tracemalloc.take_snapshot().filter_traces(only_theirs)
        for _ in range(num_calls):
            call()
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(only_theirs)
    finally:
        tracemalloc.stop()
    return sum(stat.size_diff for stat in after.compare_to(before, "filename"))
