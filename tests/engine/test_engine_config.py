"""Building the engine configuration checks the attention backend's name without building
the backend: the server's API process builds the configuration but never runs the model,
so it must not compile or load the C++ extension. Models it cannot serve are refused there,
by name."""

from __future__ import annotations

import json
import shutil
import types

import pytest

from pagedllm.config import EngineArgs
from pagedllm.core.engine_config import load_engine_config, verify_lora_config
from pagedllm.lora.config import LORA_ARCHITECTURES
from pagedllm.ops import attention_registry


def test_config_does_not_build_the_backend(tiny_llama, monkeypatch):
    def refuse():
        raise AssertionError("the backend was built while only the configuration was")

    monkeypatch.setitem(attention_registry._BACKENDS, "cpu", refuse)
    _, _, config = load_engine_config(
        EngineArgs(model=str(tiny_llama), attention_backend="cpu", max_model_len=64), log=False
    )
    assert config.attention_backend == "cpu"


def test_unknown_backend_is_refused_by_name(tiny_llama):
    args = EngineArgs(model=str(tiny_llama), attention_backend="flash", max_model_len=64)
    with pytest.raises(ValueError, match="attention_backend 'flash' is unknown"):
        load_engine_config(args, log=False)


@pytest.mark.parametrize(
    ("config_field", "refused"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "supported: Gemma3ForCausalLM"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 8}}, "8-bit GPTQ weights"),
        ({"quantization_config": {"quant_method": "awq", "version": "gemv"}}, "gemv packing"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes' are not"),
    ],
)
def test_unsupported_models_are_refused_naming_what_is(tiny_llama, tmp_path, config_field, refused):
    """An architecture or a checkpoint quantization pagedllm does not serve is refused at
    start-up, naming what it serves, before any weight is read."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_llama, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **config_field}))
    with pytest.raises(ValueError, match=refused):
        load_engine_config(EngineArgs(model=str(directory), max_model_len=64), log=False)


@pytest.mark.parametrize(
    ("quantization", "tp", "refused"), [("gguf", 2, True), ("gguf", 1, False), (None, 2, False)]
)
def test_lora_over_ranks_on_gguf_blocks_is_refused_by_name(quantization, tp, refused):
    model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(intermediate_size=64),
        architecture=LORA_ARCHITECTURES[0],
        quantization=quantization,
    )
    args = EngineArgs(enable_lora=True, tensor_parallel_size=tp)
    if not refused:
        verify_lora_config(args, model_config)
        return
    with pytest.raises(ValueError, match="quantization='gguf' and tensor_parallel_size=2"):
        verify_lora_config(args, model_config)
