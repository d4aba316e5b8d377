"""A peer's own virtualenv with the CPU torch: made the same way for every Python peer.

`torch==2.13.0+cpu` goes in first and the peer's requirement is then constrained to it
(unconstrained, pip would pull a multi-GB CUDA build of torch); after the install, a short
script run with the venv's Python imports the peer and prints its versions as one JSON line,
which proves the import works and is what the install step's stamp records.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.peers.common import PeerPaths, Runner, StepError

TORCH_REQUIREMENT = "torch==2.13.0+cpu"


def install_torch_venv(
    paths: PeerPaths, runner: Runner, name: str, venv: Path, requirement: str
) -> None:
    """Create `venv` (unless it exists), install the CPU torch, then `requirement` constrained
    to it; logs under the install logs as `<name>-*.log`."""
    pip = [str(venv / "bin" / "pip"), "install", "--progress-bar", "off"]
    constraints = venv.parent / "constraints.txt"
    log = paths.install_logs
    if not runner.dry_run:
        constraints.parent.mkdir(parents=True, exist_ok=True)
        constraints.write_text(TORCH_REQUIREMENT + "\n")
    if not (venv / "bin" / "python").exists():
        runner.run(f"{name} venv", [sys.executable, "-m", "venv", str(venv)],
                   log / f"{name}-venv.log")  # fmt: skip
    runner.run(f"{name} torch", [*pip, TORCH_REQUIREMENT], log / f"{name}-torch.log")
    runner.run(f"{name} install", [*pip, "-c", str(constraints), requirement],
               log / f"{name}-install.log")  # fmt: skip


def import_check_versions(
    paths: PeerPaths,
    runner: Runner,
    name: str,
    python: Path,
    script: str,
    env: dict[str, str] | None = None,
) -> dict[str, str]:
    """Run `script` (imports the peer, prints its versions as JSON) with `python`; the dict."""
    log = paths.install_logs / f"{name}-import.log"
    runner.run(f"{name} import check", [str(python), "-P", "-c", script], log, env=env)
    lines = log.read_text().strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        raise StepError(f"{name} import check printed no versions; see {log}")
    return json.loads(lines[-1])
