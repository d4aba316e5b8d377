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
from pagedllm.core.messages import AbortRequests
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


async def send_while_the_restart_closes(
    args: EngineArgs, cancelled_by_its_caller: bool = False
) -> BaseException | None:
    """A request sent to a core that just died: with no core connected the send waits, until
    the restart (`kill_now`) closes the socket under it."""
    client = MPClient(args)
    os.kill(client.pid, signal.SIGKILL)
    send = asyncio.ensure_future(client.send(AbortRequests(["a-request"])))
    await asyncio.sleep(0.2)
    assert not send.done()  # nothing is connected to take it
    if cancelled_by_its_caller:  # a client's disconnect, at the same moment
        send.cancel()
    await client.kill_now()
    try:
        await send
    except BaseException as error:  # CancelledError included: what the request would see
        return error
    return None


def test_a_send_cut_short_by_the_restart_is_the_cores_death_not_a_cancellation(tiny_llama):
    # A cancelled send unwound the request's stream as if its own task had been cancelled:
    # the soak saw a stream end without its last chunk at a kill.
    error = asyncio.run(send_while_the_restart_closes(EngineArgs(model=str(tiny_llama))))
    assert isinstance(error, EngineDeadError), repr(error)


def test_a_send_its_caller_cancels_stays_cancelled_when_the_restart_closes_it(tiny_llama):
    args = EngineArgs(model=str(tiny_llama))
    error = asyncio.run(send_while_the_restart_closes(args, cancelled_by_its_caller=True))
    assert isinstance(error, asyncio.CancelledError), repr(error)
