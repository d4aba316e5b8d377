"""`pytest -p cuda_device_plugin`: every `LLM` the tests build runs on CUDA unless a test names
its own device. Not collected by pytest (CI has no GPU); where a GPU is lent, from the
repository root, with `tests` on PYTHONPATH:

    PYTHONPATH=tests python -m pytest -p cuda_device_plugin tests/kv_transfer

Engine-against-engine tests then check the CUDA paths (the torch attention backend, pinned
host memory for the KV tiers) against themselves and their own references on the device.
"""

from __future__ import annotations

import pagedllm.entrypoints.llm


def pytest_configure(config) -> None:
    original = pagedllm.entrypoints.llm.LLM.__init__

    def on_cuda(self, model=None, **engine_args) -> None:
        engine_args.setdefault("device", "cuda")
        original(self, model, **engine_args)
        for core in self.llm_engine.engine_cores:
            runner = core.model_executor.driver_worker.model_runner
            assert runner.device.type == engine_args["device"], runner.device
            assert all(t.device.type == runner.device.type for t in runner.kv_block_tensors())
            if runner.kv_tiers is not None and runner.device.type == "cuda":
                assert all(h.is_pinned() for h in runner.kv_tiers.host if h.numel())

    pagedllm.entrypoints.llm.LLM.__init__ = on_cuda
