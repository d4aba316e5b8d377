"""Processes the tests start die with pytest however it ends (tests/process_guard.py): a
pytest killed outright (SIGKILL) or by SIGTERM, which run no fixture teardown, leaves
neither the session server of tests/session_server.py nor its engine core behind, nor
a child that a test's child starts (chromium under chromedriver) or a `multiprocessing`
child. Each test runs the killed pytest (or program) in a subprocess, waits for what it
started, kills it, and waits, bounded, until all of that is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import process_guard
import psutil
import pytest
from process_guard import dies_with_us

TESTS = Path(__file__).parent
# Bounds on waits that only guard against a hang (the machine may be busy).
START_TIMEOUT_S = 300.0
GONE_TIMEOUT_S = 60.0

# The inner pytest: the session server fixture itself, held until the process is killed.
INNER_TEST = """
import sys
import time
from pathlib import Path

sys.path[:0] = [{tests!r}, {entrypoints!r}]
from session_server import server  # noqa: E402, F401 - the session server fixture


def test_hold_the_server(server):
    Path({pid_file!r}).write_text(str(server.process.pid))
    time.sleep({hold_s})
"""

# A program that starts a wrapped executable and a multiprocessing child, then waits.
OWNER = """
import multiprocessing, os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from process_guard import die_with_parent, dies_with_us, dying_with_parent
import subprocess


def child(parent):
    die_with_parent(parent)
    time.sleep({hold_s})


if __name__ == "__main__":
    sleeper = dying_with_parent("/bin/sleep", Path({directory!r}))
    shell = subprocess.Popen(["/bin/sh", "-c", f"{{sleeper}} {hold_s} & wait"],
                             preexec_fn=dies_with_us())
    spawned = multiprocessing.get_context("spawn").Process(target=child, args=(os.getpid(),))
    spawned.start()
    print(shell.pid, spawned.pid, flush=True)
    time.sleep({hold_s})
"""


def wait_until(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie has ended: its pid is only waiting to be reaped)."""
    running = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
    return running


def kill_all(processes: list[psutil.Process]) -> None:
    for process in alive(processes):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


@pytest.mark.slow  # a pytest that starts the session server
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_session_server_dies_with_a_killed_pytest(tmp_path, signum):
    pid_file = tmp_path / "server.pid"
    inner = tmp_path / "test_inner.py"
    inner.write_text(
        INNER_TEST.format(
            tests=str(TESTS),
            entrypoints=str(TESTS / "entrypoints"),
            pid_file=str(pid_file),
            hold_s=START_TIMEOUT_S,
        )
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(inner)]
    paths = [str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    with open(tmp_path / "inner.log", "w") as log:
        pytest_process = subprocess.Popen(
            command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=dies_with_us(),
        )  # fmt: skip
    started: list[psutil.Process] = []
    try:

        def server_up() -> bool:
            assert pytest_process.poll() is None, (tmp_path / "inner.log").read_text()
            return pid_file.exists() and pid_file.read_text() != ""

        wait_until(server_up, "the inner pytest's session server", START_TIMEOUT_S)
        # The API process, its engine core, and multiprocessing's resource tracker.
        started = tree(int(pid_file.read_text()))
        cores = [p for p in started[1:] if "spawn_main" in " ".join(p.cmdline())]
        assert len(cores) == 1, [p.cmdline() for p in started]
        pytest_process.send_signal(signum)
        assert pytest_process.wait(GONE_TIMEOUT_S) == -signum
        wait_until(lambda: not alive(started), "the server and its children", GONE_TIMEOUT_S)
    finally:
        pytest_process.kill()
        pytest_process.wait()
        kill_all(started)


@pytest.mark.slow  # starts processes
def test_grandchildren_and_multiprocessing_children_die_with_their_parent(tmp_path):
    """`dying_with_parent` (a wrapped program a child starts, under a shell here) and
    `die_with_parent` (a spawned `multiprocessing` child) after a SIGKILL to the parent."""
    program = tmp_path / "owner.py"  # a file: multiprocessing's spawn imports it again
    program.write_text(OWNER.format(tests=str(TESTS), directory=str(tmp_path), hold_s=300))
    owner = subprocess.Popen(
        [sys.executable, str(program)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=dies_with_us(),
    )
    started: list[psutil.Process] = []
    try:
        shell_pid, spawned_pid = map(int, owner.stdout.readline().split())
        shell = psutil.Process(shell_pid)

        # The wrapper started, maybe still on its way to the sleep: killed now, the owner
        # may take the shell with it before the wrapper asks to die with the shell (the
        # wrapper then finds the owner gone).
        wait_until(lambda: bool(shell.children()), "the wrapper", GONE_TIMEOUT_S)
        started = [*tree(shell_pid), psutil.Process(spawned_pid)]
        owner.kill()
        owner.wait(GONE_TIMEOUT_S)
        wait_until(lambda: not alive(started), "the owner's children", GONE_TIMEOUT_S)
    finally:
        owner.kill()
        owner.wait()
        kill_all(started)


def test_a_fast_test_may_not_start_a_process(monkeypatch):
    monkeypatch.setattr(process_guard, "fast_test", "tests/test_x.py::test_y")
    with pytest.raises(RuntimeError, match="test_y starts a process: mark it slow"):
        dies_with_us()


def test_children_are_started_from_the_main_thread(monkeypatch):
    """PR_SET_PDEATHSIG follows the thread that started the child: another one is refused."""
    monkeypatch.setattr(process_guard, "fast_test", None)
    errors = []

    def start() -> None:
        try:
            dies_with_us()
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in errors[0]
    assert callable(dies_with_us())  # from the main thread
