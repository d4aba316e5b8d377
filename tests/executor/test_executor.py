"""The executor layer: every backend name has an executor, the core reaches the model only
through `Executor`, and the worker stages run in the order the KV prefault relies on."""

from __future__ import annotations

import pytest

from pagedllm.config import EXECUTOR_BACKENDS, EngineArgs
from pagedllm.core.engine_config import load_engine_config
from pagedllm.core.engine_core import EngineCore
from pagedllm.executor.abstract import Executor
from pagedllm.executor.multiproc_executor import MultiprocExecutor
from pagedllm.executor.ray_executor import RayExecutor
from pagedllm.executor.registry import executor_class
from pagedllm.executor.uniproc_executor import UniProcExecutor
from pagedllm.frontend.processor import InputProcessor
from pagedllm.sampling_params import SamplingParams


class RecordingExecutor(UniProcExecutor):
    """Records the worker methods the core calls, in order."""

    def _init_executor(self) -> None:
        self.calls: list[str] = []
        super()._init_executor()

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(method)
        return super().collective_rpc(method, args, kwargs)


class StingyExecutor(UniProcExecutor):
    def determine_available_memory(self) -> int:
        return 1024


def _config(tiny_llama):
    _, tokenizer, config = load_engine_config(
        EngineArgs(model=str(tiny_llama), max_model_len=64, kv_cache_memory="4MiB"), log=False
    )
    return tokenizer, config


def test_every_backend_name_has_an_executor():
    for name in EXECUTOR_BACKENDS:
        assert issubclass(executor_class(name), Executor)
    assert executor_class("uni") is UniProcExecutor
    assert executor_class("mp") is MultiprocExecutor
    assert executor_class("ray") is RayExecutor  # importable without Ray installed


def test_core_reaches_the_worker_only_through_the_executor(tiny_llama):
    tokenizer, config = _config(tiny_llama)
    core = EngineCore(config, tokenizer, executor=RecordingExecutor)
    executor = core.model_executor
    # The pool before the weights: its pages fault in while the model loads.
    assert executor.calls == ["determine_available_memory", "initialize_kv_cache", "load_model"]
    worker = executor.driver_worker
    assert worker.model_runner.kv_caches[0][0].shape[0] == config.cache_config.num_blocks
    _, request = InputProcessor(config, tokenizer).process_inputs(
        "r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True)
    )
    core.add_request(request)
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    assert len(tokens) == 3
    assert executor.calls[3:] == ["execute_model"] * 3
    assert executor.collective_rpc("determine_available_memory") == [
        config.cache_config.kv_cache_memory
    ]


def test_a_pool_larger_than_the_workers_can_give_is_refused(tiny_llama):
    tokenizer, config = _config(tiny_llama)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineCore(config, tokenizer, executor=StingyExecutor)
