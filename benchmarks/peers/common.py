"""Shared plumbing for the comparison: where things live, how commands run, stamp files.

`PeerPaths` names every path under the cache root (default `~/.cache/pagedllm-peers`) and
under the results directory. `Runner` runs a command with its output in a log file, or only
prints it in dry-run mode, and remembers every command for the report. A step that is done
leaves a stamp file (JSON: when, how long, what it made), so a re-run skips it.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OUR_BIN = Path(sys.executable).parent  # our .venv: pagedllm, transformers, torch
DEFAULT_PEERS_DIR = Path("~/.cache/pagedllm-peers").expanduser()
DEFAULT_OUT_DIR = REPO / "benchmarks" / "out" / "compare"
PLOTS_DIR = REPO / "benchmarks" / "plots"
MODEL_NAME = "SmolLM2-135M-Instruct"


class StepError(RuntimeError):
    """A step that could not run; its text goes into the report as the reason."""


@dataclass(frozen=True)
class PeerPaths:
    """Every path the comparison reads or writes, from two roots."""

    root: Path = DEFAULT_PEERS_DIR
    out: Path = DEFAULT_OUT_DIR

    @property
    def stamps(self) -> Path:
        return self.root / "stamps"

    @property
    def downloads(self) -> Path:
        return self.root / "downloads"

    @property
    def install_logs(self) -> Path:
        return self.root / "logs"

    @property
    def vllm_venv(self) -> Path:
        return self.root / "vllm" / "venv"

    @property
    def guidellm_venv(self) -> Path:
        return self.root / "guidellm" / "venv"

    @property
    def llama_src(self) -> Path:
        return self.root / "llama.cpp" / "src"

    @property
    def llama_build(self) -> Path:
        return self.root / "llama.cpp" / "build"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def hf_model(self) -> Path:
        return self.models / f"{MODEL_NAME}-fp32-hf"

    @property
    def gguf_f32(self) -> Path:
        return self.models / f"{MODEL_NAME}-f32.gguf"

    @property
    def run_logs(self) -> Path:
        return self.out / "logs"

    def make_dirs(self) -> None:
        for path in (self.stamps, self.downloads, self.install_logs, self.models, self.run_logs):
            path.mkdir(parents=True, exist_ok=True)


@dataclass
class Runner:
    """Runs commands (or prints them with `dry_run`); keeps each command for the report."""

    dry_run: bool = False
    commands: list[dict[str, Any]] = field(default_factory=list)

    def run(
        self,
        name: str,
        command: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float | None = None,
    ) -> float:
        """Runs `command` to its end with stdout+stderr in `log`; returns its seconds.

        Raises StepError (with the log's last lines) when it fails or times out."""
        self.note(name, command, env)
        print(f"$ {format_command(command, env)}\n  (log: {log})", flush=True)
        if self.dry_run:
            return 0.0
        log.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(log, "w") as out:
            try:
                result = subprocess.run(
                    command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                    env=merged_env(env), timeout=timeout, check=False,
                )  # fmt: skip
            except subprocess.TimeoutExpired as error:
                raise StepError(f"{name}: timed out after {timeout} s; {tail(log)}") from error
        if result.returncode != 0:
            raise StepError(f"{name}: exit {result.returncode}; {tail(log)}")
        return time.monotonic() - started

    def note(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        self.commands.append({"step": name, "command": format_command(command, env)})


def merged_env(extra: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, **(extra or {})}


def format_command(command: list[str], env: dict[str, str] | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(str(part) for part in command)


def tail(log: Path, lines: int = 6) -> str:
    """The last non-empty lines of a log, joined, for an error message."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {log})"
    # Progress bars redraw on one line: keep only each line's end.
    kept = [line.strip()[-300:] for line in text if line.strip()][-lines:]
    return f"last lines of {log}: " + " | ".join(kept)


def stamp_path(paths: PeerPaths, step: str) -> Path:
    return paths.stamps / f"{step}.json"


def read_stamp(paths: PeerPaths, step: str) -> dict[str, Any] | None:
    path = stamp_path(paths, step)
    return json.loads(path.read_text()) if path.is_file() else None


def write_stamp(paths: PeerPaths, step: str, seconds: float, **info: Any) -> None:
    record = {"step": step, "seconds": round(seconds, 1), "finished": time.ctime(), **info}
    stamp_path(paths, step).write_text(json.dumps(record, indent=2))


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
