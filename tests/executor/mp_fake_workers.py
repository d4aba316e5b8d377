"""Workers with no model for the `mp` executor's tests: each method misbehaves on one rank."""

from __future__ import annotations

import os
import time


class FakeWorker:
    def __init__(self, config, rank: int, distributed_init_method: str) -> None:
        self.config = config
        self.rank = rank
        self.init_method = distributed_init_method

    def init_device(self) -> None:
        if getattr(self.config, "fail_init_rank", None) == self.rank:
            raise RuntimeError(f"no device for rank {self.rank}")

    def echo(self, value):
        return self.rank, value

    def pid(self) -> int:
        return os.getpid()

    def raise_on(self, rank: int) -> None:
        if self.rank == rank:
            raise ValueError(f"boom on rank {rank}")

    def exit_on(self, rank: int, code: int) -> None:
        if self.rank == rank:
            os._exit(code)

    def sleep_on(self, rank: int, seconds: float) -> None:
        if self.rank == rank:
            time.sleep(seconds)

    def execute_model(self, scheduler_output):
        return f"rank {self.rank} ran {scheduler_output}"
