"""`RayWorkerWrapper`: the Ray actor that holds one rank's `Worker` (the `ray` executor).

The actor is created before the world's address is known (rank 0's node and a free port
there), so it builds its `Worker` only in `init_worker`; after that `execute_method` runs
any `Worker` method, as the `mp` executor's worker processes do. Nothing here imports Ray:
the executor wraps this class with `ray.remote`.
"""

from __future__ import annotations

import importlib
import socket
from typing import Any


class RayWorkerWrapper:
    def __init__(self, worker_class: str, config: Any, rank: int) -> None:
        self.worker_class, self.config, self.rank = worker_class, config, rank
        self.worker: Any = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def init_worker(self, distributed_init_method: str) -> None:
        module_name, _, class_name = self.worker_class.partition(":")
        worker_class = getattr(importlib.import_module(module_name), class_name)
        self.worker = worker_class(
            self.config, rank=self.rank, distributed_init_method=distributed_init_method
        )
        self.worker.init_device()

    def execute_method(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def execute_packed(self, method: str, packed: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        """`execute_method` with (args, kwargs) in one object: the executor puts it in the
        object store once for every actor."""
        args, kwargs = packed
        return self.execute_method(method, args, kwargs)
