"""`distributed_executor_backend` name -> executor class, imported only when chosen."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.executor.abstract import Executor

# Every name in config.EXECUTOR_BACKENDS has an entry (tests/executor check it).
_EXECUTORS = {
    "uni": ("pagedllm.executor.uniproc_executor", "UniProcExecutor"),
    "mp": ("pagedllm.executor.multiproc_executor", "MultiprocExecutor"),
    "ray": ("pagedllm.executor.ray_executor", "RayExecutor"),
}


def executor_class(name: str) -> type[Executor]:
    """The class for a name that `EngineArgs` has already checked."""
    module_name, class_name = _EXECUTORS[name]
    return getattr(importlib.import_module(module_name), class_name)
