"""Processes that tests start die with the test process, however it ends (Linux).

A server a fixture starts must not outlive pytest: a pytest stopped by SIGTERM or SIGKILL
runs no fixture teardown, and a `pagedllm serve` left behind keeps its port, its memory
and its CPU. So every child a test starts asks the kernel for SIGKILL when its parent goes
(`prctl(PR_SET_PDEATHSIG, SIGKILL)`):

- `subprocess.Popen`/`subprocess.run`/`pexpect.spawn`: `preexec_fn=dies_with_us()`;
- a `multiprocessing` child: `die_with_parent(parent_pid)` first thing in its target.

The kernel sends the signal when the *thread* that started the child ends, not the
process: children are started from the main thread (`dies_with_us` refuses another).
Grandchildren are the children's business: a server's engine core watches its parent
(`pagedllm.core.engine_core_proc`), a core's workers set PDEATHSIG themselves
(`pagedllm.worker.worker_proc`); tests/test_process_guard.py checks the server's after a
SIGKILL or a SIGTERM to pytest.
Elsewhere than Linux these do nothing.

Starting a process makes a test slow (tests/tiers.py): `dies_with_us` refuses to start one
for a test that is not in the slow tier, so the fast tier stays free of child processes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_LINUX = sys.platform.startswith("linux")
# Looked up here, in the parent: a child between fork and exec should not load libraries.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if _LINUX else None
# The running test's id while it is not in the slow tier (set by tests/conftest.py).
fast_test: str | None = None


def _set_pdeathsig() -> None:
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def dies_with_us() -> Callable[[], None] | None:
    """A `preexec_fn` for a child of this process: SIGKILL when this process ends."""
    if fast_test is not None:
        raise RuntimeError(
            f"{fast_test} starts a process: mark it slow (tests/tiers.py), it then runs in "
            "`make test` but not in `make test-fast`"
        )
    if not _LINUX:
        return None
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "start test processes from the main thread: PR_SET_PDEATHSIG fires when the "
            "thread that started the child ends"
        )
    parent = os.getpid()

    def preexec() -> None:
        _set_pdeathsig()
        if os.getppid() != parent:  # the parent died before prctl ran
            os._exit(1)

    return preexec


def die_with_parent(parent_pid: int, ancestor_pid: int | None = None) -> None:
    """Called first in a `multiprocessing` child: SIGKILL when the parent (`parent_pid`,
    read before the child started) ends, and exit now if it already has, or if
    `ancestor_pid` (the process whose end ends the parent) has."""
    if not _LINUX:
        return
    _set_pdeathsig()
    if os.getppid() != parent_pid or (ancestor_pid is not None and not _running(ancestor_pid)):
        os._exit(1)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")  # not a zombie, not dead


def dying_with_parent(executable: str, directory: Path) -> Path:
    """A wrapper script in `directory` that runs `executable` (with its arguments) set to
    die with the process that runs the wrapper: for a grandchild that a child of this
    process starts without such care, as chromedriver starts chromium. The wrapper reads
    its parent only once it runs: a parent already gone by then went because this process
    did (the child dies with it), so the wrapper also exits when this process is gone."""
    wrapper = directory / f"{Path(executable).name}-dies-with-parent"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from process_guard import die_with_parent\n"
        f"die_with_parent(os.getppid(), ancestor_pid={os.getpid()})\n"
        f"os.execv({executable!r}, [{executable!r}, *sys.argv[1:]])\n"
    )
    wrapper.chmod(0o755)
    return wrapper
