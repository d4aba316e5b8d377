"""The `mp` executor's cost per step: one `execute_model` RPC of a 64-request decode step.

Two workers with no model (`NullWorker`: `execute_model` returns None at once), so what is
timed is the executor's own work: pickling the `SchedulerOutput` once, broadcasting it
(shared-memory ring or one pipe per worker, `PAGEDLLM_BROADCAST`), each worker unpickling
it, and the replies gathered in rank order. Prints the pickled size and, per channel, the
median round trip; the faster is `shm_broadcast.DEFAULT_CHANNEL`.

    .venv/bin/python -m benchmarks.broadcast_cost [--requests 64 --repeats 2000]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time
from types import SimpleNamespace

from pagedllm.core.scheduler_output import CachedRequestData, SchedulerOutput
from pagedllm.executor.multiproc_executor import MultiprocExecutor
from pagedllm.parallel_config import ParallelConfig


class NullWorker:
    def __init__(self, config, rank: int, distributed_init_method: str) -> None:
        self.rank = rank

    def init_device(self) -> None:
        pass

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        return None


class NullExecutor(MultiprocExecutor):
    worker_class = "benchmarks.broadcast_cost:NullWorker"


def decode_step(num_requests: int, step: int) -> SchedulerOutput:
    """What the scheduler sends for `num_requests` decoding (a new block every 16 tokens)."""
    output = SchedulerOutput()
    for index in range(num_requests):
        request_id = f"cmpl-{index:08x}-5f2d1c7e9a8b4c3d-0"
        computed = 200 + step + index
        output.scheduled_cached_reqs.append(
            CachedRequestData(
                request_id=request_id,
                new_block_ids=[1000 + index] if computed % 16 == 0 else [],
                num_computed_tokens=computed,
                token_ids=[(index * 7919 + step) % 49152],
            )
        )
        output.num_scheduled_tokens[request_id] = 1
    return output


def measure(channel: str, num_requests: int, repeats: int, world_size: int) -> list[float]:
    os.environ["PAGEDLLM_BROADCAST"] = channel
    config = SimpleNamespace(
        parallel_config=ParallelConfig(
            tensor_parallel_size=world_size, distributed_executor_backend="mp"
        )
    )
    executor = NullExecutor(config)
    try:
        steps = [decode_step(num_requests, step) for step in range(16)]
        for step in steps * 10:  # warm-up
            executor.execute_model(step)
        samples = []
        for i in range(repeats):
            started = time.perf_counter()
            executor.execute_model(steps[i % len(steps)])
            samples.append(time.perf_counter() - started)
        return samples
    finally:
        executor.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    step = decode_step(args.requests, 0)
    payload = pickle.dumps(("execute_model", (step,), {}), protocol=pickle.HIGHEST_PROTOCOL)
    started = time.perf_counter()
    for _ in range(1000):
        pickle.loads(pickle.dumps(("execute_model", (step,), {}), pickle.HIGHEST_PROTOCOL))
    pickling_us = (time.perf_counter() - started) / 1000 * 1e6
    print(
        f"{args.requests}-request decode step: {len(payload)} bytes pickled; "
        f"pickle + unpickle {pickling_us:.0f} us"
    )
    for channel in ("shm", "pipe"):
        samples = measure(channel, args.requests, args.repeats, args.world_size)
        samples.sort()
        print(
            f"{channel:>4}: execute_model round trip to {args.world_size} workers: "
            f"median {statistics.median(samples) * 1e6:.0f} us, "
            f"p90 {samples[int(len(samples) * 0.9)] * 1e6:.0f} us"
        )


if __name__ == "__main__":
    main()
