"""The process groups of one engine core's ranks and the collectives the model calls on them.

Rank layout (vLLM's): `world_size = tp * pp`, global rank = `pp_rank * tp + tp_rank`; a
tensor-parallel group is the `tp` consecutive ranks of one stage, a pipeline group the `pp`
ranks with the same `tp_rank`. `init_distributed_environment` joins the world
(torch.distributed, "gloo" on the CPU and "nccl" on CUDA: `backend_for_device`), with a
timeout on every collective so a dead peer raises instead of hanging; then
`initialize_model_parallel` builds the groups. A TP group on the CPU whose ranks share a
host all-reduces through shared memory (`shm_allreduce.py`), otherwise through the backend.

With nothing initialized (the `uni` executor) `get_tp_group()` and `get_pp_group()` are
one-rank groups whose collectives are the identity, so model code calls them
unconditionally; the model's layers also read `world_size` once, at construction, and skip
the calls entirely when it is 1, so the single-rank forward is exactly what it was.
`single_rank_groups()` gives the same one-rank view for a while in an initialized rank
(a model built whole on one rank, such as a speculative draft model).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm.distributed.shm_allreduce import ShmAllReduce, shm_allreduce_supported

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


def backend_for_device(device: torch.device | str) -> str:
    """torch.distributed's backend for `device`: nccl for CUDA, gloo for everything else."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class GroupCoordinator:
    """One group of ranks. `rank_in_group` / `world_size` are within the group; `dst` and
    `src` arguments are ranks in the group too. Every rank of the group must make the same
    calls in the same order with tensors of the same shapes."""

    def __init__(
        self,
        ranks: list[int],
        global_rank: int,
        device: torch.device,
        device_group: dist.ProcessGroup | None = None,
        cpu_group: dist.ProcessGroup | None = None,
        shm: ShmAllReduce | None = None,
    ) -> None:
        self.ranks = list(ranks)
        self.global_rank = global_rank
        self.rank_in_group = self.ranks.index(global_rank)
        self.world_size = len(self.ranks)
        self.device = device
        self.device_group = device_group  # tensors on `device` (nccl on CUDA)
        self.cpu_group = cpu_group  # gloo: Python objects, the shm set-up
        self.shm = shm

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> GroupCoordinator:
        """The one-rank group of an uninitialized process: every collective is the identity."""
        return cls([0], 0, torch.device(device))

    # ---- where this rank sits ---------------------------------------------------------------
    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        return (self.rank_in_group + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank_in_group - 1) % self.world_size

    # ---- collectives ------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the group; may reduce in place (use the returned tensor)."""
        if self.world_size == 1:
            return tensor
        if self.shm is not None:
            return self.shm.all_reduce(tensor)
        tensor = tensor.contiguous()
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` concatenated along `dim`, in rank order, on every rank."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `tensor` concatenated along `dim` on rank `dst`; None elsewhere."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        if self.rank_in_group != dst:
            dist.gather(tensor, None, dst=self.ranks[dst], group=self.device_group)
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.gather(tensor, parts, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(parts, dim=dim)

    def all_gather_object(self, value: object) -> list[object]:
        """Every rank's picklable `value`, in rank order, on every rank (through the CPU
        group: small bookkeeping, not tensors)."""
        if self.world_size == 1:
            return [value]
        values: list[object] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.cpu_group)
        return values

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src`'s tensor on every rank (in place into `tensor`, which must be contiguous)."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=self.ranks[src], group=self.device_group)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Point to point to `dst` (default: the next rank, the next pipeline stage)."""
        if self.world_size == 1:
            raise RuntimeError("send in a one-rank group: there is no peer")
        dst = self.next_rank if dst is None else dst
        dist.send(tensor.contiguous(), dst=self.ranks[dst], group=self.device_group)

    def recv(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, src: int | None = None
    ) -> torch.Tensor:
        """A tensor of `shape` and `dtype` from `src` (default: the previous rank)."""
        if self.world_size == 1:
            raise RuntimeError("recv in a one-rank group: there is no peer")
        src = self.prev_rank if src is None else src
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(tensor, src=self.ranks[src], group=self.device_group)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
_SINGLE = GroupCoordinator.single()
_TIMEOUT_S = DEFAULT_TIMEOUT_S


def init_distributed_environment(
    world_size: int,
    rank: int,
    init_method: str,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device: torch.device | str | None = None,
) -> None:
    """Join the world of `world_size` ranks (`init_method`: "tcp://127.0.0.1:PORT", or
    "env://"). `backend` defaults to the one for `device` (default: the CPU); a collective
    whose peers do not all arrive within `timeout_s` raises."""
    global _WORLD, _TIMEOUT_S
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    device = torch.device(device)
    backend = backend or backend_for_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=timedelta(seconds=timeout_s),
        )
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"torch.distributed is already initialized as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, not {rank} of {world_size}"
        )
    _TIMEOUT_S = timeout_s
    ranks = list(range(world_size))
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(ranks, backend="gloo")
    _WORLD = GroupCoordinator(ranks, rank, device, dist.group.WORLD, cpu_group)


def initialize_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Build the TP and PP groups of the initialized world (every rank calls this)."""
    global _TP, _PP
    if _WORLD is None:
        raise RuntimeError("init_distributed_environment() first")
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp * pp != _WORLD.world_size:
        raise ValueError(
            f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} != world size "
            f"{_WORLD.world_size}"
        )
    for group in (_TP, _PP):  # a new layout replaces the old one
        if group is not None:
            group.destroy()
    tp_groups = [list(range(stage * tp, (stage + 1) * tp)) for stage in range(pp)]
    pp_groups = [list(range(tp_rank, tp * pp, tp)) for tp_rank in range(tp)]
    _TP = _build_group(tp_groups, shm_allowed=True)
    _PP = _build_group(pp_groups, shm_allowed=False)


def _build_group(all_ranks: list[list[int]], shm_allowed: bool) -> GroupCoordinator:
    """Every rank creates every group (torch.distributed's rule), keeps the one it is in."""
    assert _WORLD is not None
    rank, device = _WORLD.global_rank, _WORLD.device
    nccl = dist.get_backend() == "nccl"
    mine = None
    for ranks in all_ranks:
        device_group = dist.new_group(ranks, timeout=timedelta(seconds=_TIMEOUT_S))
        cpu_group = (
            dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=_TIMEOUT_S))
            if nccl
            else device_group
        )
        if rank in ranks:
            mine = GroupCoordinator(ranks, rank, device, device_group, cpu_group)
    assert mine is not None
    if shm_allowed and mine.world_size > 1 and device.type == "cpu":
        mine.shm = _shm_for(mine)
    return mine


def _shm_for(group: GroupCoordinator) -> ShmAllReduce | None:
    """The group's shared-memory all-reduce when all its ranks share this host."""
    # Decided together: every rank must take the same path.
    views: list[object] = [None] * group.world_size
    dist.all_gather_object(views, (_host_id(), shm_allreduce_supported()), group=group.cpu_group)
    if len(set(views)) != 1 or not views[0][1]:  # type: ignore[index]
        logger.info("TP group %s all-reduces through %s", group.ranks, dist.get_backend())
        return None
    size, rank = group.world_size, group.rank_in_group
    shm = ShmAllReduce.create(size, timeout_s=_TIMEOUT_S) if rank == 0 else None
    name = [shm.name if shm is not None else None]
    dist.broadcast_object_list(name, src=group.ranks[0], group=group.cpu_group)
    if shm is None:
        shm = ShmAllReduce.attach(name[0], size, rank, timeout_s=_TIMEOUT_S)
    dist.barrier(group=group.cpu_group)  # every rank attached: the name may go
    if rank == 0:
        shm.unlink()
    return shm


def _host_id() -> str:
    """Same string on ranks of one machine (and one boot): hostname plus the boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_id:
            return f"{socket.gethostname()}/{boot_id.read().strip()}"
    except OSError:
        return socket.gethostname()


def get_world_group() -> GroupCoordinator:
    return _WORLD or _SINGLE


def get_tp_group() -> GroupCoordinator:
    """This rank's tensor-parallel group (one rank when nothing was initialized)."""
    return _TP or _SINGLE


def get_pp_group() -> GroupCoordinator:
    """This rank's pipeline group (one rank when nothing was initialized)."""
    return _PP or _SINGLE


@contextmanager
def single_rank_groups() -> Iterator[None]:
    """Inside the block `get_tp_group()` and `get_pp_group()` are one-rank groups: a model
    built here is whole (every head, layer and vocabulary row) and calls no collective,
    since its layers read their groups at construction. A speculative draft model is built
    so on the sampling rank alone while its peers run the sharded target."""
    global _TP, _PP
    saved = _TP, _PP
    _TP = _PP = None
    try:
        yield
    finally:
        _TP, _PP = saved


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def destroy_model_parallel() -> None:
    """Drop the groups and leave torch.distributed (safe to call when nothing was set up)."""
    global _TP, _PP, _WORLD
    for group in (_TP, _PP, _WORLD):
        if group is not None:
            group.destroy()
    _TP = _PP = _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()
