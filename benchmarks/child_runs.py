"""Run one benchmark case per child process and collect what each prints as its last line.

A case that builds an engine (a layout, a model size) runs in a process of its own, so no
case inherits another's memory, threads or worker processes; the child prints one JSON
object as its last line of output.
"""

from __future__ import annotations

import json
import subprocess
import sys


def run_children(module: str, child_args: list[list[str]], output_json: str | None) -> list:
    """`python -m module *args` for each args; each child's last line, parsed, echoed as it
    comes and written to `output_json` at the end."""
    results = []
    for args in child_args:
        command = [sys.executable, "-m", module, *args]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(output.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    if output_json:
        with open(output_json, "w") as file:
            json.dump(results, file, indent=2)
    return results
