"""A core client that killed its core leaves nothing open in the API process: a server that
restarts its core after each failure holds as many fds and threads after the tenth restart as
after the first, even while something (a request's exception traceback) still refers to the
replaced client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from pagedllm.client.core_client import MPClient
from pagedllm.config import EngineArgs
from pagedllm.errors import EngineDeadError

pytestmark = pytest.mark.slow  # starts engine-core processes

READY_TIMEOUT_S = 300.0  # a tiny model loads in seconds; the machine may be busy


def open_fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own fd, closed by now
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return fds


def num_threads() -> int:
    return len(os.listdir("/proc/self/task"))  # native ones too (ZMQ's I/O threads)


async def start_and_kill(args: EngineArgs, wait_ready: bool) -> MPClient:
    """A core that fails as the soak's kills make it fail (SIGKILL), replaced as AsyncLLM
    replaces it (`kill_now`)."""
    client = MPClient(args)
    if wait_ready:
        await client.wait_ready(READY_TIMEOUT_S)
    os.kill(client.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        while True:
            await client.recv()
    await client.kill_now()
    return client


def test_a_killed_core_client_releases_every_fd_and_thread_it_opened(tiny_llama):
    args = EngineArgs(model=str(tiny_llama))
    # The first client opens what the process keeps for good (the resource tracker's pipe).
    asyncio.run(start_and_kill(args, wait_ready=False))
    fds_before, threads_before = open_fds(), num_threads()
    kept = asyncio.run(start_and_kill(args, wait_ready=True))  # still referred to
    assert open_fds() == fds_before
    assert num_threads() == threads_before
    assert kept.closed and kept.pid is not None
    kept.kill()  # again, as the exit hook does: nothing left to do, no error
