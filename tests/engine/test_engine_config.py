"""Building the engine configuration checks the attention backend's name without building
the backend: the server's API process builds the configuration but never runs the model,
so it must not compile or load the C++ extension."""

from __future__ import annotations

import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.engine_config import load_engine_config
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
