"""`exit_now` (pagedllm/process_exit.py): a process that ends through it runs its `atexit`
handlers and flushes its streams, skips the interpreter's teardown, and exits with the
status given."""

from __future__ import annotations

import subprocess
import sys

import pytest
from process_guard import dies_with_us

pytestmark = pytest.mark.slow  # another Python process

# An object still alive at exit prints from its finalizer during the teardown only; a
# handler registered with `atexit` and text left in stdout's buffer must both come out.
PROGRAM = """
import atexit
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pagedllm.process_exit import exit_now

class Finalized:
    def __del__(self):
        print("teardown ran", flush=True)

kept = Finalized()
atexit.register(lambda: print("atexit ran"))
sys.stdout.write("buffered, ")
# A thread that is no daemon and an executor's queued work finish before the exit.
threading.Thread(target=lambda: (time.sleep(0.2), sys.stdout.write("thread done, "))).start()
ThreadPoolExecutor(1).submit(lambda: (time.sleep(0.4), sys.stdout.write("queued done, ")))
exit_now(3)
"""


def test_exit_now_runs_atexit_flushes_and_skips_the_teardown():
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=dies_with_us(),
    )
    assert result.returncode == 3, result.stderr
    assert result.stdout == "buffered, thread done, queued done, atexit ran\n", result.stdout
    assert "teardown ran" not in result.stdout
