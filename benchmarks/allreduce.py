"""The tensor-parallel all-reduce of a decode step: a 64 x hidden fp32 tensor between 2 ranks
on this host, through gloo (loopback TCP) and through shared memory (`shm_allreduce.py`).

Two spawned ranks, one thread each (as TP=2 on 2 cores runs), join a gloo world on
127.0.0.1; for each hidden size each path runs `--warmup` then `--repeats` all-reduces
back to back, and rank 0 prints the median and p90 per call. A decode step of a Llama
makes two per layer (after attention and after the MLP), plus one for the embedding.

    .venv/bin/python -m benchmarks.allreduce [--rows 64 --hidden 576 4096 --repeats 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from pagedllm.utils import free_port


def _rank(rank: int, world_size: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    from pagedllm.distributed import parallel_state
    from pagedllm.distributed.shm_allreduce import ShmAllReduce

    parallel_state.init_distributed_environment(
        world_size, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60
    )
    gloo = parallel_state.get_world_group()  # no shared memory: the world group uses gloo
    shm = ShmAllReduce.create(world_size) if rank == 0 else None
    name = [shm.name if shm else None]
    torch.distributed.broadcast_object_list(name, src=0)
    shm = shm or ShmAllReduce.attach(name[0], world_size, rank)
    gloo.barrier()
    if rank == 0:
        shm.unlink()
    paths = {"gloo": gloo.all_reduce, "shm": shm.all_reduce}
    report = []
    for hidden in args.hidden:
        x = torch.randn(args.rows, hidden)
        for path, all_reduce in paths.items():
            times = []
            for i in range(args.warmup + args.repeats):
                y = x.clone()
                if i == args.warmup:
                    gloo.barrier()  # the timed calls start together
                start = time.perf_counter()
                all_reduce(y)
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            times.sort()
            report.append((hidden, path, statistics.median(times), times[int(0.9 * len(times))]))
    shm.close()
    parallel_state.destroy_model_parallel()
    if rank == 0:
        results.put(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--hidden", type=int, nargs="+", default=[576, 4096])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        report = results.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    print(f"all-reduce of {args.rows} x hidden fp32, 2 ranks, 1 thread each ({args.repeats} calls)")
    print(f"{'hidden':>7} {'path':>5} {'KiB':>7} {'median us':>10} {'p90 us':>8}")
    for hidden, path, median, p90 in report:
        kib = args.rows * hidden * 4 / 1024
        print(f"{hidden:>7} {path:>5} {kib:>7.0f} {median * 1e6:>10.1f} {p90 * 1e6:>8.1f}")


if __name__ == "__main__":
    main()
