"""Which CPU cores each rank's threads run on (`cpu_threads_bind`), and applying it in a worker.

Semantics of vLLM's VLLM_CPU_OMP_THREADS_BIND:
- explicit: "0-7|8-15" gives rank 0 cores 0-7 and rank 1 cores 8-15, one thread per core;
- "auto": one rank per NUMA node when the host has several (node i's cores, as this process
  may use them, to rank i; more ranks than nodes split each node's cores between the ranks
  it gets); on a single node, this process's allowed cores split evenly in contiguous runs;
  with more ranks than cores, ranks share cores, one thread each, with a warning (they
  will slow each other down);
- "nobind": nothing is changed.

`resolve_cpu_binding` is pure (the topology is passed in, so tests fake it);
`host_topology` reads this host's; `apply_cpu_binding` runs in the worker process before
its first parallel region and before the model loads.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
from dataclasses import dataclass

import torch

from pagedllm.parallel_config import parse_cpu_threads_bind

logger = logging.getLogger(__name__)

_NODE_ROOT = "/sys/devices/system/node"


@dataclass(frozen=True)
class RankBinding:
    cores: tuple[int, ...]
    num_threads: int


@dataclass(frozen=True)
class HostTopology:
    """The cores this process may use, and the NUMA nodes' cores (each node's list)."""

    allowed: tuple[int, ...]
    numa_nodes: tuple[tuple[int, ...], ...] = ()


def host_topology() -> HostTopology:
    allowed = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    if not allowed:
        allowed = tuple(range(os.cpu_count() or 1))
    return HostTopology(allowed, read_numa_nodes())


def read_numa_nodes(root: str = _NODE_ROOT) -> tuple[tuple[int, ...], ...]:
    """Each NUMA node's cores from sysfs (`nodeN/cpulist`), in node order; () if unknown."""
    nodes = []
    paths = glob.glob(os.path.join(root, "node[0-9]*", "cpulist"))
    for path in sorted(paths, key=lambda p: int(re.findall(r"node(\d+)", p)[-1])):
        try:
            with open(path) as cpulist:
                text = cpulist.read().strip()
        except OSError:
            continue
        if text:  # a memory-only node has no cores
            nodes.append(tuple(parse_cpu_threads_bind(text)[0]))
    return tuple(nodes)


def resolve_cpu_binding(
    spec: str, world_size: int, topology: HostTopology
) -> list[RankBinding] | None:
    """Each rank's cores and thread count for `spec`; None for "nobind"."""
    if spec == "nobind":
        return None
    if spec != "auto":
        ranks = parse_cpu_threads_bind(spec)
        if len(ranks) != world_size:
            raise ValueError(
                f"cpu_threads_bind lists {len(ranks)} core set(s) for {world_size} rank(s)"
            )
        return [RankBinding(tuple(cores), len(cores)) for cores in ranks]
    allowed = set(topology.allowed)
    nodes = [tuple(c for c in node if c in allowed) for node in topology.numa_nodes]
    nodes = [node for node in nodes if node]
    if len(nodes) > 1:
        return _bind_numa(nodes, world_size)
    return _split(sorted(allowed), world_size)


def _bind_numa(nodes: list[tuple[int, ...]], world_size: int) -> list[RankBinding]:
    if world_size <= len(nodes):
        return [RankBinding(node, len(node)) for node in nodes[:world_size]]
    # More ranks than nodes: node k gets ranks [k * n / N, (k + 1) * n / N) and splits its
    # cores between them.
    bindings: list[RankBinding] = []
    for k, node in enumerate(nodes):
        count = (k + 1) * world_size // len(nodes) - k * world_size // len(nodes)
        bindings.extend(_split(list(node), count))
    return bindings


def _split(cores: list[int], world_size: int) -> list[RankBinding]:
    if world_size > len(cores):
        logger.warning(
            "%d ranks on %d core(s): ranks share cores, one thread each, and slow each other down",
            world_size,
            len(cores),
        )
        return [RankBinding((cores[r % len(cores)],), 1) for r in range(world_size)]
    base, extra = divmod(len(cores), world_size)
    bindings, start = [], 0
    for rank in range(world_size):
        size = base + (1 if rank < extra else 0)
        bindings.append(RankBinding(tuple(cores[start : start + size]), size))
        start += size
    return bindings


def apply_cpu_binding(binding: RankBinding | None) -> None:
    """Pin every thread of this process to the rank's cores and size torch's thread pool.

    Call before the first parallel region: threads created later inherit the mask, and
    those that exist (listed in /proc/self/task) are moved here too."""
    if binding is None:
        return
    cores = set(binding.cores)
    if hasattr(os, "sched_setaffinity"):
        for tid in _thread_ids():
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                os.sched_setaffinity(tid, cores)
    torch.set_num_threads(binding.num_threads)
    logger.info("threads bound to cores %s (%d threads)", sorted(cores), binding.num_threads)


def _thread_ids() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # the calling thread
