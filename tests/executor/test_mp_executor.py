"""The `mp` executor with a fake 2-rank world (workers with no model): RPCs in rank order
over both broadcast channels, a worker's exception, death and hang each raising with the
rank, and no worker process outliving its executor or the executor's owner."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from process_guard import dies_with_us

from pagedllm.executor.multiproc_executor import MultiprocExecutor, WorkerError
from pagedllm.parallel_config import ParallelConfig

pytestmark = pytest.mark.slow  # worker processes


class FakeExecutor(MultiprocExecutor):
    worker_class = "mp_fake_workers:FakeWorker"


def _config(tp: int = 2, pp: int = 1, **extra):
    parallel = ParallelConfig(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp"
    )
    return SimpleNamespace(parallel_config=parallel, **extra)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "\nState:\tZ" in status.read()  # a zombie has exited
    except FileNotFoundError:
        return True


# A bound on waits that only guards against a hang (the machine may be busy).
HANG_GUARD_S = 60.0


def _wait_gone(pids: list[int], timeout_s: float = HANG_GUARD_S) -> bool:
    """Polls until every process in `pids` has exited; False if one outlives `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def make_executor(monkeypatch):
    started: list[MultiprocExecutor] = []

    def make(config=None, channel: str = "shm", rpc_timeout_s: float | None = None):
        monkeypatch.setenv("PAGEDLLM_BROADCAST", channel)
        if rpc_timeout_s is not None:
            monkeypatch.setenv("PAGEDLLM_RPC_TIMEOUT_S", str(rpc_timeout_s))
        executor = FakeExecutor(config or _config())
        started.append(executor)
        return executor

    yield make
    for executor in started:  # also when the test failed
        executor.shutdown()


@pytest.mark.parametrize("channel", ["shm", "pipe"])
def test_rpc_replies_in_rank_order_and_shutdown_leaves_no_process(make_executor, channel):
    executor = make_executor(channel=channel)
    assert executor.collective_rpc("echo", ("hi",)) == [(0, "hi"), (1, "hi")]
    big = b"x" * (3 << 20)  # larger than a ring chunk: the overflow path
    assert executor.collective_rpc("echo", kwargs={"value": big}) == [(0, big), (1, big)]
    for i in range(20):  # more messages than the ring has chunks
        assert executor.collective_rpc("echo", (i,))[1] == (1, i)
    assert executor.execute_model("step") == "rank 0 ran step"  # tp=2: rank 0 samples
    pids = executor.collective_rpc("pid")
    assert pids == executor.worker_pids
    executor.shutdown()
    assert _wait_gone(pids)
    executor.shutdown()  # twice is fine


def test_output_rank_is_the_last_stage_and_futures_come_back_in_order(make_executor):
    executor = make_executor(_config(tp=1, pp=2))
    assert executor.execute_model("a") == "rank 1 ran a"
    first = executor.execute_model("b", non_block=True)
    second = executor.execute_model("c", non_block=True)
    assert second.result() == "rank 1 ran c" and first.done()
    assert first.result() == "rank 1 ran b"
    assert executor.collective_rpc("echo", (1,)) == [(0, 1), (1, 1)]


def test_a_worker_exception_names_its_rank_and_traceback(make_executor):
    executor = make_executor()
    pids = executor.worker_pids
    with pytest.raises(WorkerError) as raised:
        executor.collective_rpc("raise_on", (1,))
    message = str(raised.value)
    assert "worker rank 1 raised in raise_on: ValueError: boom on rank 1" in message
    assert "mp_fake_workers.py" in message  # the worker's traceback
    assert _wait_gone(pids)  # a broken world is stopped, with no shutdown() called
    with pytest.raises(WorkerError, match="workers are gone"):
        executor.collective_rpc("echo", (1,))


def test_a_failed_start_raises_and_leaves_no_process(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_BROADCAST", "shm")
    with pytest.raises(WorkerError, match=r"rank 1 raised in init_device.*no device for rank 1"):
        FakeExecutor(_config(fail_init_rank=1))
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagedllm")]


def test_a_dead_worker_raises_at_once_with_rank_and_exit_code(make_executor):
    executor = make_executor()
    pids = executor.worker_pids
    # At once: the death itself is reported, not the RPC timeout (600 s by default) that a
    # missed death would end in ("did not answer ... within").
    with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) died with exit code 7"):
        executor.collective_rpc("exit_on", (1, 7))
    assert _wait_gone(pids)


def test_a_hung_worker_raises_after_the_rpc_timeout(make_executor):
    executor = make_executor(rpc_timeout_s=1.0)
    pids = executor.worker_pids
    # The RPC timeout ends the wait: the worker would have answered after its 60 s sleep.
    with pytest.raises(WorkerError, match=r"rank\(s\) \[0\] did not answer sleep_on within 1 s"):
        executor.collective_rpc("sleep_on", (0, 60))
    assert _wait_gone(pids)


_OWNER = """
import sys, time
from types import SimpleNamespace
from pagedllm.executor.multiproc_executor import MultiprocExecutor
from pagedllm.parallel_config import ParallelConfig

class FakeExecutor(MultiprocExecutor):
    worker_class = "mp_fake_workers:FakeWorker"

config = SimpleNamespace(parallel_config=ParallelConfig(
    tensor_parallel_size=2, distributed_executor_backend="mp"))
executor = FakeExecutor(config)
print(*executor.worker_pids, flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)  # without shutdown(): the executor's finalizer stops the workers
time.sleep(120)
"""


@pytest.mark.parametrize("how", ["SIGKILL", "exit"])
def test_workers_die_with_the_executors_owner(how):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), "."])}
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, how],
        stdout=subprocess.PIPE, text=True, env=env, preexec_fn=dies_with_us(),
    )  # fmt: skip
    try:
        line = owner.stdout.readline()  # blocks until the workers are up (or it died)
        pids = [int(pid) for pid in line.split()]
        assert len(pids) == 2, line
        if how == "SIGKILL":
            owner.send_signal(signal.SIGKILL)
        assert owner.wait(timeout=HANG_GUARD_S) == (-signal.SIGKILL if how == "SIGKILL" else 0)
        assert _wait_gone(pids), "worker processes outlived their owner"
    finally:
        owner.kill()
        owner.wait(timeout=HANG_GUARD_S)
